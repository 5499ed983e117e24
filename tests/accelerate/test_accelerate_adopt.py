"""An ordinary accelerate loop on load-time-sharded models (2 ranks) equals one process on the same global batch."""

from __future__ import annotations

import pytest

from shardadopt.selftest.accelerate import compare_training, eval_rank, train_rank, train_reference
from shardadopt.testing.layouts import distributed_sizes


def _new_transformers() -> bool:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) >= Version("5.17")


# The model per layout; the DistributedConfig sizes come from the installed transformers (EP without ep_size is
# enable_expert_parallel on the tp mesh).
MODELS = {"fsdp": "llama", "tp": "qwen3", "ep": "qwen3moe"}


def _layout(name: str) -> tuple[str, dict, int]:
    """(model, DistributedConfig sizes, data-parallel size) on 2 ranks."""
    sizes, dp = distributed_sizes(name, 2)
    return MODELS[name], sizes, dp


@pytest.fixture(scope="module")
def references(tiny_models):
    cache = {}

    def get(model: str, dp: int):
        if (model, dp) not in cache:
            cache[model, dp] = train_reference(tiny_models[model], dp)
        return cache[model, dp]

    return get


# TP on qwen3 with accumulation needs patch transformers-tp-replicated-grad-accumulation (q_norm/k_norm grads).
@pytest.mark.parametrize("layout, order", [("fsdp", "together"), ("tp", "loader-first"), ("ep", "separate")])
def test_training_matches_single_process(pool2, tiny_models, references, layout, order):
    model, sizes, dp = _layout(layout)
    results = pool2.run(train_rank, tiny_models[model], sizes, dp, order, timeout=300)
    expected = references(model, dp)
    problem = compare_training(results[0], expected)
    assert problem is None, problem
    for result in results[1:]:
        assert result["losses"] == results[0]["losses"] and result["norms"] == results[0]["norms"]
        assert result["unchanged"], "prepare() changed this rank's local parameters"
    # data: dp ranks see disjoint batches, ranks of a TP group identical ones
    first, second = (r["batches"] for r in results)
    if dp == 1:
        assert first == second
    else:
        flat = lambda batches: {tuple(row) for b in batches for row in b}  # noqa: E731
        assert not flat(first) & flat(second)
    # accumulate(): FSDP2 modules reduce only on the final micro-step
    flags = results[0]["sync_flags"]
    if any(f is not None for f in flags):
        assert flags == [False, True] * (len(flags) // 2), flags


def fused_and_loop_step(path: str, sizes: dict) -> dict:
    """One accelerate step with fused AdamW and one with single-tensor AdamW, each on a fresh load of the model."""
    import torch

    import shardadopt
    from shardadopt.selftest.accelerate import PER_DP_BATCH, _dataset, _load
    from shardadopt.testing import full
    from shardadopt.testing.accelerator import fresh_accelerator

    shardadopt.enable()
    params, strided = [], []
    try:
        for fused in (True, False):
            accelerator = fresh_accelerator(cpu=True)
            model = _load(path, sizes)
            strided = [n for n, p in model.named_parameters() if not p.is_contiguous()]
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, **({"fused": True} if fused else
                                                                           {"foreach": False}))
            loader = torch.utils.data.DataLoader(_dataset(1, steps=1, accum=1), batch_size=PER_DP_BATCH)
            model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
            for batch in loader:
                accelerator.backward(model(input_ids=batch, labels=batch).loss)
                optimizer.step()
            params.append({n: full(p).detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters()})
    finally:
        shardadopt.disable()
    fused, loop = params
    return {"strided": strided,
            "differ": [n for n in loop if not torch.allclose(fused[n], loop[n], rtol=1e-5, atol=1e-6)]}


def test_fused_adamw_steps_tp_shards_right(pool2, tiny_models):
    """transformers 5.15 keeps TP row-parallel shards as plain strided views (o_proj, down_proj); torch's fused
    AdamW mis-updated them through accelerate (torchprobe.fused_adamw_strided_ok). Newer releases shard TP as
    DTensors: the same loop must hold there too."""
    for rank, result in enumerate(pool2.run(fused_and_loop_step, tiny_models["llama"], {"tp_size": 2}, timeout=300)):
        assert result["differ"] == [], f"rank {rank}: fused AdamW differs on {result['differ']} " \
                                       f"(strided before prepare: {result['strided']})"


def test_ep_experts_stay_as_loaded_and_differ_between_ranks(pool2, tiny_models):
    """transformers#45662: adoption must not overwrite a rank's experts with rank 0's copy."""
    model, sizes, dp = _layout("ep")
    results = pool2.run(expert_snapshot, tiny_models[model], sizes)
    for result in results:
        assert result["unchanged"], "prepare() changed this rank's experts"
    assert results[0]["experts"] != results[1]["experts"], "each EP rank must keep its own experts"


def expert_snapshot(path: str, sizes: dict):
    import torch

    import shardadopt
    from shardadopt.selftest.accelerate import _load
    from shardadopt.testing.accelerator import fresh_accelerator
    from shardadopt.testing.models import local_copy

    shardadopt.enable()
    try:
        accelerator = fresh_accelerator(cpu=True)
        model = _load(path, sizes)
        before = {n: local_copy(p) for n, p in model.named_parameters() if ".experts." in n}
        model = accelerator.prepare(model)
        after = {n: local_copy(p) for n, p in model.named_parameters() if ".experts." in n}
        return {"unchanged": all(torch.equal(after[n], before[n]) for n in before) and len(before) > 0,
                "experts": [round(float(v.sum()), 4) for v in after.values()]}
    finally:
        shardadopt.disable()


def test_without_enable_upstream_fails(pool2, tiny_models):
    """The same TP loop without shardadopt: accelerate DDP-wraps the DTensor model (or trains on wrong data)."""
    model, sizes, dp = _layout("tp")
    results = pool2.run(train_rank, tiny_models[model], sizes, dp, "together", False, timeout=300)
    problem = compare_training(results[0], train_reference(tiny_models[model], dp))
    assert problem is not None
    if _new_transformers():
        assert "mixed torch.Tensor and DTensor" in results[0].get("error", ""), results[0]


def test_gather_for_metrics_returns_each_sample_once_under_tp(pool2, tiny_models):
    model, sizes, _ = _layout("tp")
    for result in pool2.run(eval_rank, tiny_models[model], sizes, 7):
        assert result["tensors"] == result["expected"]
        assert result["objects"] == [row[0] for row in result["expected"]]


# -- AdoptionKwargs and bad input (hand-sharded tiny models: cheap, and every layout is possible) ----------------

def _hand_sharded(layout: str):
    from shardadopt.testing.models import hand_sharded_mlp

    return hand_sharded_mlp(layout, width=4)


def _loader(n: int = 16):
    import torch

    return torch.utils.data.DataLoader(torch.arange(n * 4, dtype=torch.float32).reshape(n, 4), batch_size=2)


def adopt_worker(case: str, patched: bool = True) -> dict:
    """Build the accelerator/model/dataloader of ``case`` and prepare them; the error text or what was adopted."""
    import torch
    from accelerate import DataLoaderConfiguration

    import shardadopt
    from shardadopt.adopt import AdoptionKwargs, adopted, adoption_kwargs
    from shardadopt.testing.accelerator import fresh_accelerator

    shardadopt.enable() if patched else shardadopt.disable()
    try:
        handlers, config, layout = [], {}, case
        if case == "ambiguous-override":
            handlers, layout = [AdoptionKwargs(topology={"tp": 2}, reshard_checkpoints=False)], "ambiguous"
        elif case == "tp-no-split":
            handlers, layout = [AdoptionKwargs(split_optimizer=False)], "tp"
        elif case.endswith("-dispatch"):
            config, layout = {"dataloader_config": DataLoaderConfiguration(dispatch_batches=True)}, case[:-9]
        elif case in ("loader-from-plain-accelerator", "second-model-other-layout"):
            layout = "tp"
        elif case == "loader-split-by-other-model":
            layout = "fsdp"
        elif case == "no-cpu-flag":
            layout = "fsdp"
        try:
            # without cpu=True a CPU-only Accelerator treats each process as a job of its own
            accelerator = fresh_accelerator(cpu=case != "no-cpu-flag", kwargs_handlers=handlers, **config)
            model = _hand_sharded(layout)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
            if case == "loader-split-by-other-model":
                # a loader prepared next to a TP model (one data-parallel rank), then handed to an Accelerator
                # whose FSDP model needs two
                first = fresh_accelerator(cpu=True)
                _, loader = first.prepare(_hand_sharded("tp"), _loader())
                loader = accelerator.prepare(loader)
                model, optimizer = accelerator.prepare(model, optimizer)
            elif case == "loader-from-plain-accelerator":
                # a loader split by process by an Accelerator without a model, handed to one with a TP model
                loader = fresh_accelerator(cpu=True).prepare(_loader())
                model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
            elif case == "second-model-other-layout":
                model, optimizer, loader = accelerator.prepare(model, optimizer, _loader())
                accelerator.prepare(_hand_sharded("fsdp"))
            else:
                model, optimizer, loader = accelerator.prepare(model, optimizer, _loader())
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        state = adopted(accelerator)
        layout_seen = state.layout if state else None
        return {"source": layout_seen.source if layout_seen else None,
                "tp": (layout_seen.tp_size, layout_seen.tp_rank) if layout_seen else None,
                "dp": (layout_seen.dp_size, layout_seen.dp_rank) if layout_seen else None,
                "kwargs": adoption_kwargs(accelerator),
                "groups": len(optimizer.optimizer.param_groups),
                "split": getattr(optimizer.optimizer, "_shardadopt_split", None) is not None,
                "rows": [row[0] for batch in loader for row in batch.tolist()]}
    finally:
        shardadopt.disable()


def test_adoption_kwargs_defaults_need_no_configuration():
    import shardadopt
    from shardadopt.adopt import AdoptionKwargs, adoption_kwargs
    from shardadopt.testing.accelerator import fresh_accelerator

    assert shardadopt.AdoptionKwargs is AdoptionKwargs
    defaults = AdoptionKwargs()
    assert (defaults.topology, defaults.reshard_checkpoints, defaults.split_optimizer) == (None, True, True)
    assert defaults.to_kwargs() == {}, "defaults are what KwargsHandler.to_kwargs() leaves out"
    shardadopt.enable()
    try:
        assert adoption_kwargs(fresh_accelerator(cpu=True)) == defaults
        handler = AdoptionKwargs(topology={"tp": 2}, reshard_checkpoints=False)
        accelerator = fresh_accelerator(cpu=True, kwargs_handlers=[handler])
        assert adoption_kwargs(accelerator) is handler
        assert handler.to_kwargs() == {"topology": {"tp": 2}, "reshard_checkpoints": False}
        with pytest.raises(ValueError, match="only pass one shardadopt.AdoptionKwargs"):
            fresh_accelerator(cpu=True, kwargs_handlers=[handler, AdoptionKwargs()])
    finally:
        shardadopt.disable()
    with pytest.raises(KeyError):  # upstream alone does not know the handler class
        fresh_accelerator(cpu=True, kwargs_handlers=[AdoptionKwargs()])


def test_adoption_kwargs_topology_override_reaches_topology(pool2):
    for rank, result in enumerate(pool2.run(adopt_worker, "ambiguous-override")):
        assert "error" not in result, result
        assert result["source"] == "override" and result["tp"] == (2, rank) and result["dp"] == (1, 0)
        assert result["kwargs"].reshard_checkpoints is False
        assert result["rows"] == [4 * i for i in range(16)], "a TP group sees the whole dataset, in order"


def test_adoption_kwargs_split_optimizer(pool2):
    split, kept = pool2.run(adopt_worker, "tp")[0], pool2.run(adopt_worker, "tp-no-split")[0]
    assert split["split"] and not kept["split"]
    assert split["groups"] == kept["groups"] == 1, "the user's param groups stay as built"


def test_model_mesh_not_covering_world_is_a_clear_error(pool2):
    for result in pool2.run(adopt_worker, "partial-mesh"):
        assert result["error"].startswith("TopologyError"), result
        assert "but the world has 2" in result["error"] and "init_device_mesh over all ranks" in result["error"]


def test_accelerator_without_cpu_flag_on_cpu_is_a_clear_error(pool2):
    for result in pool2.run(adopt_worker, "no-cpu-flag"):
        assert result["error"].startswith("AdoptionError"), result
        assert "sharded over 2 processes" in result["error"] and "Accelerator(cpu=True)" in result["error"]


def test_ambiguous_hand_sharded_mesh_names_the_override(pool2):
    for result in pool2.run(adopt_worker, "ambiguous"):
        assert result["error"].startswith("TopologyError") and "ambiguous" in result["error"], result
        assert "kwargs_handlers=[shardadopt.AdoptionKwargs(topology=" in result["error"]


def test_dataloader_split_for_another_model_is_a_clear_error(pool2):
    for result in pool2.run(adopt_worker, "loader-split-by-other-model"):
        assert result.get("error", "").startswith("AdoptionError"), result
        assert "already split for 1 data-parallel ranks" in result["error"]
        assert "Prepare a separate dataloader" in result["error"]


def test_dataloader_split_by_process_elsewhere_is_resplit(pool2):
    """A loader an Accelerator split by process (2 ranks) is fixed up for a TP model: both ranks get all rows."""
    for result in pool2.run(adopt_worker, "loader-from-plain-accelerator"):
        assert result["source"] == "hand-sharded" and result["dp"] == (1, 0), result
        assert result["rows"] == [4 * i for i in range(16)], result


def test_second_model_with_other_data_layout_is_a_clear_error(pool2):
    for result in pool2.run(adopt_worker, "second-model-other-layout"):
        assert result["error"].startswith("AdoptionError") and "One Accelerator splits data one way" in result["error"]


def test_dispatch_batches(pool2):
    """dispatch_batches: rank 0 reads and dispatches per data-parallel group (TP: both ranks get every batch)."""
    for result in pool2.run(adopt_worker, "tp-dispatch"):
        assert result["dp"] == (1, 0), result
        assert result["rows"] == [4 * i for i in range(16)], "a TP group sees the whole dataset, in order"
    results = pool2.run(adopt_worker, "fsdp-dispatch")
    assert [r["dp"] for r in results] == [(2, 0), (2, 1)], results
    first, second = (r["rows"] for r in results)
    assert sorted(first + second) == [4 * i for i in range(16)] and not set(first) & set(second)
