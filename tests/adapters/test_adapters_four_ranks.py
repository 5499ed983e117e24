"""PEFT LoRA (also DoRA and ``modules_to_save``) through the ordinary accelerate loop on 4 ranks: HSDP and 2-D
(fsdp x tp) loads equal one process.

The same checks as ``tests/adapters/test_adapters.py`` (``shardadopt.testing.lora.training.check_lora_training``).
transformers 5.15 can load neither layout (no ``dp_replicate_size``; ``fsdp_size`` with ``tp_size`` refused): skipped
with the reason.
"""

from __future__ import annotations

import pytest

from shardadopt.testing.layouts import LayoutUnsupported, distributed_sizes
from shardadopt.testing.lora.common import TARGETS
from shardadopt.testing.lora.training import check_lora_training, reference_cache

pytest.importorskip("peft", reason="the adapter tests need peft (shardadopt[peft])")

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def references(tiny_models):
    return reference_cache(tiny_models)


@pytest.mark.parametrize("layout, model", [("hsdp", "llama"), ("2d", "qwen3")])
def test_lora_four_ranks_match_single_process(request, tiny_models, references, tmp_path, layout, model):
    try:
        sizes, dp = distributed_sizes(layout, world=4)
    except LayoutUnsupported as exc:
        pytest.skip(f"{layout}: {exc}")
    pool = request.getfixturevalue("pool4")  # started only when a layout can load
    check_lora_training(pool, tiny_models[model], model, sizes, dp, references, str(tmp_path))


DORA_HEAD = {"use_dora": True, "modules_to_save": ["lm_head"]}


@pytest.mark.parametrize("layout", ["hsdp", "2d"])
def test_dora_and_modules_to_save_four_ranks_match_single_process(request, tiny_models, references, tmp_path,
                                                                   layout):
    """DoRA with ``modules_to_save=["lm_head"]`` on the tiny Llama (its tied head sits in the embedding's FSDP
    unit; on 2-D its TP plan is ``colwise_gather_output``): magnitudes (2-D: colwise sharded, rowwise whole) and the
    head's copy are averaged over the data-parallel ranks (HSDP: all 4; 2-D: the 2 with this rank's tp
    coordinate), as in ``tests/adapters/test_adapters.py``."""
    try:
        sizes, dp = distributed_sizes(layout, world=4)
    except LayoutUnsupported as exc:
        pytest.skip(f"{layout}: {exc}")
    expected = references("llama", dp, TARGETS, DORA_HEAD)["grads"]
    assert any("lora_magnitude_vector" in n for n in expected) and any(".modules_to_save." in n for n in expected)
    pool = request.getfixturevalue("pool4")
    check_lora_training(pool, tiny_models["llama"], "llama", sizes, dp, references, str(tmp_path), DORA_HEAD)


def test_untied_head_in_modules_to_save_refused_on_2d(request, tiny_models):
    """Qwen3's untied ``lm_head`` is an FSDP unit of its own on a fsdp x tp load (the FSDP plan groups it with the
    final norm): FSDP refuses to be copied, so its ``modules_to_save`` copy is refused by name."""
    from shardadopt.testing.lora.cases import adapter_case

    try:
        sizes, _ = distributed_sizes("2d", world=4)
    except LayoutUnsupported as exc:
        pytest.skip(f"2d: {exc}")
    pool = request.getfixturevalue("pool4")
    for result in pool.run(adapter_case, tiny_models["qwen3"], sizes, "modules-to-save"):
        assert result["error"] and result["error"].startswith("AdapterLayoutError: LoraConfig: "), result
        assert "modules_to_save of a module that is an FSDP unit of its own" in result["error"], result
