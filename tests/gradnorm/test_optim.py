"""shardadopt.parallel.optim: foreach/fused optimizers over DTensors on several meshes plus plain tensors."""

from __future__ import annotations

import pytest
import torch

from shardadopt.parallel.optim import split_param_groups, split_param_groups_by_mesh, unsplit_param_groups_by_mesh

STEPS = 4


def _values(seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = {"a": (8, 4), "b": (6, 4), "c": (4,), "d": (4, 6)}
    params = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=g) for k, s in shapes.items()} for _ in range(STEPS)]
    return params, grads


def _groups(params: dict):
    # two user groups with their own hyperparameters, each mixing meshes / DTensor and plain
    return [{"params": [params["a"], params["c"]], "lr": 0.1, "weight_decay": 0.0},
            {"params": [params["b"], params["d"]], "lr": 0.05, "weight_decay": 0.1}]


def _train(params: dict, grads: list, optimizer, scheduler, to_local=lambda k, g: g):
    for step_grads in grads:
        for k, p in params.items():
            p.grad = to_local(k, step_grads[k])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def reference(kind: str):
    params, grads = _values(0)
    params = {k: torch.nn.Parameter(v) for k, v in params.items()}
    optimizer = _make(kind, _groups(params), foreach=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda s: 1 / (s + 1), lambda s: 0.5 ** s])
    _train(params, grads, optimizer, scheduler)
    return {k: v.detach() for k, v in params.items()}, optimizer.state_dict()


def _make(kind: str, groups, **kw):
    if kind == "adamw":
        return torch.optim.AdamW(groups, betas=(0.9, 0.99), **kw)
    return torch.optim.SGD(groups, momentum=0.9, **kw)


def mixed_meshes(kind: str, split: bool, foreach: bool = True):
    """a: Shard(0) on mesh 'x', b: Replicate on mesh 'y', c: plain, d: Shard(1) on mesh 'x'."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    world = dist.get_world_size()
    mesh_x = init_device_mesh("cpu", (world,), mesh_dim_names=("x",))
    mesh_y = init_device_mesh("cpu", (world,), mesh_dim_names=("y",))
    layout = {"a": (mesh_x, [Shard(0)]), "b": (mesh_y, [Replicate()]), "d": (mesh_x, [Shard(1)])}
    values, grads = _values(0)
    params = {k: torch.nn.Parameter(distribute_tensor(v, *layout[k]) if k in layout else v.clone())
              for k, v in values.items()}
    optimizer = _make(kind, _groups(params), foreach=foreach)
    # the scheduler exists before the split, as in `prepare(model, optimizer, scheduler)`
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda s: 1 / (s + 1), lambda s: 0.5 ** s])
    before = [len(g["params"]) for g in optimizer.param_groups]
    if split:
        split_param_groups_by_mesh(optimizer)
    try:
        _train(params, grads, optimizer, scheduler,
               lambda k, g: distribute_tensor(g, *layout[k]) if k in layout else g)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    assert [len(g["params"]) for g in optimizer.param_groups] == before, "user's param groups must be kept"
    full = {k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for k, p in params.items()}
    state = optimizer.state_dict()
    # round trip: a fresh split optimizer loads the state and continues like the original
    resumed = _make(kind, _groups({k: torch.nn.Parameter(p.detach().clone()) for k, p in params.items()}),
                    foreach=foreach)
    split_param_groups_by_mesh(resumed)
    resumed.load_state_dict(state)
    return {"params": full, "groups": state["param_groups"], "lrs": [g["lr"] for g in optimizer.param_groups],
            "resumed_groups": resumed.state_dict()["param_groups"]}


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_split_matches_single_process(pool2, kind):
    expected, expected_state = reference(kind)
    for result in pool2.run(mixed_meshes, kind, True):
        assert "error" not in result, result
        for k, v in expected.items():
            torch.testing.assert_close(result["params"][k], v, rtol=1e-6, atol=1e-7)
        # the user's groups, with the scheduled lrs; only the foreach flag differs from the reference
        assert [{**g, "foreach": None} for g in result["groups"]] == [
            {**g, "foreach": None} for g in expected_state["param_groups"]]
        assert result["resumed_groups"] == result["groups"]


def test_without_split_foreach_fails_on_mixed_meshes(pool2):
    for result in pool2.run(mixed_meshes, "adamw", False):
        assert "error" in result and ("mixed" in result["error"] or "mesh" in result["error"]), result


def test_split_param_groups_is_pure_and_keeps_hyperparameters():
    plain32 = torch.nn.Parameter(torch.zeros(2))
    plain64 = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    other = torch.nn.Parameter(torch.zeros(3))
    groups = [{"params": [plain32, plain64, other], "lr": 0.3, "custom": "x"}, {"params": [other], "lr": 0.1}]
    out = split_param_groups(groups)
    assert [[id(p) for p in g["params"]] for g in out] == [[id(plain32), id(other)], [id(plain64)], [id(other)]]
    assert [(g["lr"], g.get("custom")) for g in out] == [(0.3, "x"), (0.3, "x"), (0.1, None)]
    assert out[2] is groups[1], "homogeneous groups are passed through unchanged"


def test_unsplit_removes_hooks():
    p = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([p], lr=0.1)
    split_param_groups_by_mesh(optimizer)
    split_param_groups_by_mesh(optimizer)  # idempotent
    # upstream-private: torch lists no optimizer step hooks
    assert len(optimizer._optimizer_step_pre_hooks) == 1
    unsplit_param_groups_by_mesh(optimizer)
    # upstream-private: as above
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        split_param_groups_by_mesh(object())
