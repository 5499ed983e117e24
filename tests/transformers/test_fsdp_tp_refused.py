"""``transformers-fsdp-tp-refused``: transformers 5.16 / 5.17 accept ``DistributedConfig(fsdp_size=N, tp_size=M)`` but
apply TP alone; after ``enable()`` loading raises one clear error on every rank instead of an ``IndexError`` on some
ranks and a hang on the others.

The probe and the core check are tested on every release (synthetic upstream functions shaped like 5.17's and 5.18's);
the 4-rank load runs where the patch applies (5.16 / 5.17: ``.ci/matrix``).
"""

from __future__ import annotations

import textwrap
from importlib.metadata import version

import pytest
from packaging.version import Version

import shardadopt
from shardadopt.loadtime import UnsupportedShardingError, refuse_fsdp_with_tp
from shardadopt.patches.transformers_fsdp_tp_refused import fsdp_with_tp

ID = "transformers-fsdp-tp-refused"
TRANSFORMERS = Version(version("transformers"))
ACCEPTS_BUT_APPLIES_TP_ALONE = Version("5.16") <= TRANSFORMERS < Version("5.18")


def test_probe_reads_which_sharding_applies(tmp_path, monkeypatch):
    """5.17's ``if tp: ... elif fsdp:`` needs the refusal; 5.18's two independent ``if``s do not; a function that
    applies neither through those calls is unknown (the probe then reports ``unsupported``)."""
    monkeypatch.syspath_prepend(tmp_path)
    (tmp_path / "shapes.py").write_text(textwrap.dedent('''
        def either(model, distributed_config, device_mesh):
            if distributed_config.tp_size > 1:
                model = apply_tensor_parallelism(model, device_mesh)
            elif distributed_config.fsdp_size > 1:
                model = apply_fully_sharded_data_parallelism(model, device_mesh)
            return model

        def both(model, distributed_config, device_mesh):
            if distributed_config.tp_size > 1:
                model = apply_tensor_parallelism(model, device_mesh)
            if distributed_config.fsdp_size > 1:
                model = apply_fully_sharded_data_parallelism(model, device_mesh)
            return model

        def nested(self, model, distributed_config, device_mesh):
            if device_mesh is not None:
                if distributed_config.tp_size > 1:
                    model = apply_tensor_parallelism(model, device_mesh)
                else:
                    model = fsdp.apply_fully_sharded_data_parallelism(model, device_mesh)
            return model

        def renamed(model, distributed_config, device_mesh):
            if distributed_config.tp_size > 1:
                model = shard_tensors(model, device_mesh)
            elif distributed_config.fsdp_size > 1:
                model = shard_fully(model, device_mesh)
            return model
    '''))
    import shapes

    assert fsdp_with_tp(shapes.either) is False
    assert fsdp_with_tp(shapes.nested) is False
    assert fsdp_with_tp(shapes.both) is True
    assert fsdp_with_tp(shapes.renamed) is None


@pytest.mark.parametrize("config", [{"fsdp_size": 2, "tp_size": 2}, {"fsdp_size": 4, "tp_size": 2}])
def test_both_degrees_are_refused_with_the_fix(config):
    with pytest.raises(UnsupportedShardingError, match=r"transformers 5\.16\.1 cannot do") as raised:
        refuse_fsdp_with_tp(config, "5.16.1")
    message = str(raised.value)
    assert f"fsdp_size={config['fsdp_size']}, tp_size={config['tp_size']}" in message
    assert "transformers>=5.18" in message and "only one of fsdp_size / tp_size" in message
    assert isinstance(raised.value, ValueError)  # what DistributedConfig raises for configs it refuses


@pytest.mark.parametrize("config", [None, {"fsdp_size": 2}, {"tp_size": 2}, {"tp_size": 2, "fsdp_size": 1},
                                    {"fsdp_size": 1, "tp_size": 1}])
def test_one_degree_passes(config):
    refuse_fsdp_with_tp(config, "5.16.1")


def test_probe_follows_upstream():
    import transformers.distributed.mixin  # noqa: F401  (the patch's target module)

    try:
        state = {s.id: s for s in shardadopt.enable(only=[ID])}[ID]
    finally:
        shardadopt.disable()
    expected = "applied" if ACCEPTS_BUT_APPLIES_TP_ALONE else "not-needed"
    assert state.state == expected, state.reason


def load_2d(path: str) -> str:
    """On every rank: load fsdp_size=2 x tp_size=2 with the patch; the exception type and message."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    shardadopt.enable(only=[ID])
    try:
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                             distributed_config=DistributedConfig(fsdp_size=2, tp_size=2))
        return "loaded"
    except Exception as exc:  # noqa: BLE001  (the test compares what each rank raised)
        return f"{type(exc).__name__}: {exc}"
    finally:
        shardadopt.disable()


@pytest.mark.multiproc
@pytest.mark.skipif(not ACCEPTS_BUT_APPLIES_TP_ALONE,
                    reason=f"transformers {TRANSFORMERS} refuses fsdp x tp itself (5.15) or loads it (5.18+)")
def test_every_rank_raises_the_same_clear_error(tiny_models, pool4):
    outcomes = pool4.run(load_2d, tiny_models["qwen3"], timeout=120)
    assert len(set(outcomes)) == 1, outcomes
    assert outcomes[0].startswith("UnsupportedShardingError: DistributedConfig(fsdp_size=2, tp_size=2)"), outcomes[0]
