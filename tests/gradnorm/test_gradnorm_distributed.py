"""The grad norm on real gloo ranks: real DTensors from load-time-sharded tiny models, and hand-made DTensors.

Every rank runs forward/backward on the same batch. For data-parallel layouts (FSDP, HSDP) the gradients are
averaged over identical batches, so they equal one process's gradients on that batch; TP and EP ranks must see the
same batch anyway. The reference is ``torch.nn.utils.get_total_norm`` / ``clip_grad_norm_`` on the unsharded model
in this (parent) process.

Tolerance: the norm is compared with rtol 1e-6 twice: with the reference (end to end, which includes the sharded
model's own fp32 rounding of the gradients) and with a fp64 ``vector_norm`` over the gathered gradients of the same
distributed run (our reduction alone; a fp32 ``vector_norm`` over all ~10^5 elements is itself off by ~1e-5 for
p = 1). Each rank's clipped gradients must be exactly its gradients times the coefficient; the gathered clipped
gradients are compared with the reference's at rtol 1e-5, as the sharded matmuls sum in a different order.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from packaging.version import Version

from shardadopt import upstream

pytestmark = pytest.mark.multiproc

NORM_TYPES = [1.0, 2.0, math.inf]
MAX_NORM = 1.0  # below every total norm here, so clipping really scales
BATCH_SEED = 0


def _transformers_version() -> Version:
    from importlib.metadata import version

    return Version(version("transformers"))


# transformers < 5.21 has no ep_size: EP is tp_size + enable_expert_parallel (experts as plain local tensors).
EP = (dict(ep_size=2, fsdp_size=2) if _transformers_version() >= Version("5.21")
      else dict(tp_size=2, enable_expert_parallel=True))


def _count_collectives(fn: Callable, *args, **kwargs):
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:
        out = fn(*args, **kwargs)
    return out, comm.get_total_counts()


def layout_run(path: str, config: dict) -> dict:
    """On every rank: load sharded, one backward, our norm for each p (and its collectives), then clip."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import shardadopt
    from shardadopt.gradnorm import clip_grad_norm_, total_norm
    from shardadopt.parallel.topology import topology
    from shardadopt.testing import full, token_batch

    # The backports (F2 on 5.15/5.16: the grouped GEMM's backward leaves the sentinel-tail rows of d_input
    # undefined, NaN now and then even on CPU; F3: EP router gradients) make old releases' EP gradients correct; this
    # file tests the norm over them. F2 acts in the experts' forward, so they stay enabled through the backward.
    shardadopt.enable()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     distributed_config=DistributedConfig(**config))
        ids = token_batch(BATCH_SEED, 2)
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        shardadopt.disable()
    named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    grads = [p.grad for _, p in named]
    # Old transformers keep TP/EP shards as plain tensors: the topology says how many ranks hold each.
    replication = topology(model).grad_replication(model.parameters())
    plain_sharded = any(replication(g) != dist.get_world_size() for g in grads if not isinstance(g, DTensor))
    out: dict = {"norms": {}, "gathered": {}, "clip": {}, "plain_sharded": plain_sharded}
    for p in NORM_TYPES:
        norm, count = _count_collectives(total_norm, grads, p, plain_replication=replication)
        out["norms"][p] = (norm.item(), count)
        if not plain_sharded:
            out["gathered"][p] = torch.linalg.vector_norm(torch.cat([full(g).flatten() for g in grads]), p,
                                                         dtype=torch.float64).item()
    saved = [upstream.dtensor_local(g).clone() if isinstance(g, DTensor) else g.clone() for g in grads]
    for p in NORM_TYPES:
        norm, count = _count_collectives(clip_grad_norm_, model.parameters(), MAX_NORM, p,
                                         plain_replication=replication)
        coef = torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0)
        local = [upstream.dtensor_local(g) if isinstance(g, DTensor) else g for g in grads]
        scaled_exactly = all(torch.equal(after, before * coef) for after, before in zip(local, saved))
        clipped = {n: full(p_.grad).clone() for n, p_ in named} if not plain_sharded else None
        out["clip"][p] = (norm.item(), count, scaled_exactly, clipped if dist.get_rank() == 0 else None)
        for g, before in zip(local, saved):
            g.copy_(before)
    return out


@pytest.fixture(scope="module")
def reference(tiny_models):
    """Single-process norms and clipped grads for each tiny model, computed once in the parent."""
    from transformers import AutoModelForCausalLM

    from shardadopt.testing import token_batch

    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            model = AutoModelForCausalLM.from_pretrained(tiny_models[name], dtype=torch.float32)
            ids = token_batch(BATCH_SEED, 2)
            model(input_ids=ids, labels=ids).loss.backward()
            named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
            saved = {n: p.grad.clone() for n, p in named}
            entry = {"norms": {}, "clipped": {}}
            for p in NORM_TYPES:
                entry["norms"][p] = torch.nn.utils.get_total_norm([g for g in saved.values()], p).item()
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, p)
                entry["clipped"][p] = {n: q.grad.clone() for n, q in named}
                for n, q in named:
                    q.grad.copy_(saved[n])
            cache[name] = entry
        return cache[name]

    return get


def check_layout(results: list[dict], ref: dict, *, compare_reference: bool = True) -> None:
    for p in NORM_TYPES:
        values = [r["norms"][p][0] for r in results]
        assert len(set(values)) == 1, f"p={p}: ranks disagree: {values}"
        assert all(r["norms"][p][1] == 1 for r in results), [r["norms"][p][1] for r in results]
        if not results[0]["plain_sharded"]:
            assert values[0] == pytest.approx(results[0]["gathered"][p], rel=1e-6, abs=0)
        if compare_reference:
            assert values[0] == pytest.approx(ref["norms"][p], rel=1e-6, abs=0), p
        for r in results:
            norm, count, scaled_exactly, clipped = r["clip"][p]
            assert norm == values[0] and count == 1 and scaled_exactly
            if compare_reference and clipped is not None:
                for name, grad in clipped.items():
                    torch.testing.assert_close(grad, ref["clipped"][p][name], rtol=1e-5, atol=1e-7,
                                               msg=lambda m, name=name, p=p: f"{name}, p={p}: {m}")


LAYOUTS_2 = [
    pytest.param("qwen3", dict(fsdp_size=2), id="fsdp"),
    pytest.param("qwen3", dict(tp_size=2), id="tp"),
    pytest.param("qwen3moe", EP, id="ep+fsdp" if "ep_size" in EP else "ep(tp)"),
]
LAYOUTS_4 = [
    pytest.param("qwen3", dict(dp_replicate_size=2, fsdp_size=2), id="hsdp"),
    pytest.param("qwen3moe", dict(fsdp_size=2, tp_size=2), id="fsdp x tp"),
    pytest.param("qwen3moe", dict(ep_size=2, fsdp_size=2, tp_size=2), id="ep x fsdp x tp"),
]


def skip_unless_loadable(config: dict) -> None:
    """transformers 5.15 .. 5.17 cannot load some layouts (no dp_replicate_size; no fsdp_size x tp_size)."""
    from shardadopt.testing.layouts import unloadable_reason

    reason = unloadable_reason(config)
    if reason:
        pytest.skip(f"transformers {_transformers_version()}: {reason}")


@pytest.mark.parametrize("name,config", LAYOUTS_2)
def test_layout_2_ranks(pool2, tiny_models, reference, name, config):
    skip_unless_loadable(config)
    results = pool2.run(layout_run, tiny_models[name], config)
    check_layout(results, reference(name))


@pytest.mark.parametrize("name,config", LAYOUTS_4)
def test_layout_4_ranks(pool4, tiny_models, reference, name, config):
    skip_unless_loadable(config)
    results = pool4.run(layout_run, tiny_models[name], config)
    check_layout(results, reference(name))


# --- hand-made DTensors: every placement kind, sub-meshes, Partial, errors -------------------------------------

def placements_run(seed: int) -> list[tuple]:
    """Random full tensors distributed with many placements over a 2x2 mesh and its 1-D sub-meshes; our norm and
    the reference over the full tensors, plus collective counts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from shardadopt.gradnorm import total_norm

    StridedShard = upstream.strided_shard_type()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    gen = torch.Generator().manual_seed(seed)  # the same full tensors on every rank
    layouts = [  # (mesh, placements, shape): uneven shards on purpose
        (mesh, [Shard(0), Shard(1)], (5, 3)), (mesh, [Replicate(), Shard(0)], (7,)),
        (mesh, [StridedShard(0, split_factor=2), Shard(0)], (6, 2)), (mesh, [Shard(0), Shard(0)], (9, 2)),
        (mesh, [Replicate(), Replicate()], (1, 1)), (mesh["dp"], [Shard(0)], (3, 3)),
        (mesh["tp"], [Shard(1)], (4, 5)), (mesh["tp"], [Replicate()], (6,)),
    ]
    fulls, tensors = [], []
    for m, pl, shape in layouts:
        fulls.append(torch.randn(shape, generator=gen))
        # src_data_rank=None: split locally (every rank has the same full tensor), uneven _StridedShard allowed
        tensors.append(distribute_tensor(fulls[-1], m, pl, src_data_rank=None))
    plain = torch.randn(4, generator=gen)  # replicated on every rank
    fulls.append(plain)
    tensors.append(plain)
    out = []
    for p in NORM_TYPES + [0.0, 3.5]:
        norm, count = _count_collectives(total_norm, tensors, p)
        out.append((p, norm.item(), torch.linalg.vector_norm(torch.cat([f.flatten() for f in fulls]), p).item(),
                    count))
    # A Partial gradient is reduced first (one more collective), never counted from its local values.
    # (Both copies of the tp sub-mesh hold the same pending sum, 1 + 2, as data-parallel replicas do.)
    partial = DTensor.from_local(torch.full((3,), mesh["tp"].get_local_rank() + 1.0), mesh["tp"], [Partial()])
    norm, count = _count_collectives(total_norm, [partial], 2.0)
    out.append(("partial", norm.item(), partial.full_tensor().norm().item(), count))
    return out


def test_placements_and_submeshes(pool4):
    for rank_results in pool4.run(placements_run, 7):
        for p, ours, expected, count in rank_results:
            assert ours == pytest.approx(expected, rel=1e-6, abs=0), p
            assert count == (2 if p == "partial" else 1), (p, count)


def planned_calls_run(seed: int) -> list:
    """The layout is worked out once (shardadopt.gradnorm.plan) and reused: repeated calls on the same DTensors see
    new values, a new placement or a new plain_replication answer is a new layout, and the first layout still
    counts right after them. Each entry: (what, ours, reference over the full tensors, collectives)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from shardadopt.gradnorm import clip_grad_norm_, total_norm

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    gen = torch.Generator().manual_seed(seed)
    fulls = [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen)]

    def reference(tensors) -> float:
        return torch.linalg.vector_norm(torch.cat([t.full_tensor().flatten() for t in tensors])).item()

    out = []
    sharded = [distribute_tensor(fulls[0], mesh, [Shard(0), Shard(1)], src_data_rank=None),
               distribute_tensor(fulls[1], mesh["tp"], [Shard(0)], src_data_rank=None)]
    for step in range(3):  # the same layout, new values every call
        norm, count = _count_collectives(total_norm, sharded)
        out.append((f"step {step}", norm.item(), reference(sharded), count))
        for t in sharded:
            upstream.dtensor_local(t).mul_(1.5)
    replicated = [distribute_tensor(f, mesh, [Replicate(), Replicate()], src_data_rank=None) for f in fulls]
    norm, count = _count_collectives(total_norm, replicated)
    out.append(("replicated", norm.item(), reference(replicated), count))
    # A plain tensor: the same one on every rank (the default count), then a different one per rank (count 1).
    mine = torch.full((3,), float(dist.get_rank() + 1))
    for name, plain, replicas, full in [
            ("plain on every rank", torch.ones(3), None, torch.ones(3)),
            ("plain per rank", mine, lambda t: 1, torch.cat([torch.full((3,), r + 1.0) for r in range(4)]))]:
        norm, count = _count_collectives(total_norm, [*sharded, plain], plain_replication=replicas)
        expected = torch.linalg.vector_norm(torch.cat([*(t.full_tensor().flatten() for t in sharded), full]))
        out.append((name, norm.item(), expected.item(), count))
    norm, count = _count_collectives(total_norm, sharded)
    out.append(("first layout again", norm.item(), reference(sharded), count))
    # clip_grad_norm_ scales through the plan: every local piece by the same coefficient
    params = [torch.nn.Parameter(distribute_tensor(torch.zeros_like(f), t.device_mesh, t.placements))
              for f, t in zip(fulls, sharded)]
    for param, t in zip(params, sharded):
        param.grad = t
    before = reference(sharded)
    norm, count = _count_collectives(clip_grad_norm_, params, 1.0)
    out.append(("clipped", reference(sharded), min(1.0, 1.0 / (before + 1e-6)) * before, count))
    return out


def test_planned_calls_follow_values_and_layouts(pool4):
    for rank_results in pool4.run(planned_calls_run, 3):
        for what, ours, expected, count in rank_results:
            assert ours == pytest.approx(expected, rel=1e-6, abs=0), what
            assert count == 1, (what, count)


def same_length_layouts_run(seed: int) -> list:
    """Calls with as many tensors as the previous call but another layout at some position: the plan last used
    for that many tensors must not be taken for them (each would be weighted, grouped or typed wrongly). Each
    entry: (what, p, ours, reference over the full tensors in fp64, collectives, result dtype, expected dtype)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from shardadopt.gradnorm import total_norm

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    gen = torch.Generator().manual_seed(seed)
    sharded = distribute_tensor(torch.randn(8, 3, generator=gen), mesh, [Shard(0), Shard(1)], src_data_rank=None)
    replicated = distribute_tensor(torch.randn(5, generator=gen), mesh["tp"], [Replicate()], src_data_rank=None)
    wide = distribute_tensor(torch.randn(6, 3, generator=gen), mesh, [Shard(1), Replicate()], src_data_rank=None)
    as_fp64 = distribute_tensor(torch.randn(8, 3, generator=gen, dtype=torch.float64), mesh, [Shard(0), Shard(1)],
                                src_data_rank=None)
    plain = torch.full((3,), 2.0)
    mine = torch.full((3,), dist.get_rank() + 1.0)  # a different plain tensor on every rank
    # The same mesh and placements object, a local shard that is empty on some ranks or on none.
    on_dp = (Shard(0),)
    sizes = {"full": [1, 1], "empty on rank 1": [1, 0]}  # torch.chunk sizes of 2 and 1 elements

    def on_dp_mesh(what: str) -> DTensor:
        local = torch.full((sizes[what][mesh["dp"].get_local_rank()],), 1.0 + mesh["dp"].get_local_rank())
        return DTensor.from_local(local, mesh["dp"], on_dp, run_check=False, shape=torch.Size([sum(sizes[what])]),
                                  stride=(1,))

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    cases = [  # (what, tensors, plain_replication, full tensors of the reference)
        ("sharded, replicated", [sharded, replicated], None, None),
        ("replicated, sharded", [replicated, sharded], None, None),
        ("sharded, wide", [sharded, wide], None, None),
        ("sharded, fp64 shard", [sharded, as_fp64], None, None),
        ("sharded, plain on every rank", [sharded, plain], None, None),
        ("sharded, plain per rank", [sharded, mine], lambda t: 1,
         [full(sharded), torch.cat([torch.full((3,), r + 1.0) for r in range(4)])]),
        ("sharded, plain on every rank again", [sharded, plain], None, None),
        ("dp shard, none empty", [on_dp_mesh("full"), sharded], None, None),
        ("dp shard, empty on a rank", [on_dp_mesh("empty on rank 1"), sharded], None, None),
        ("sharded, replicated again", [sharded, replicated], None, None),
        # another spec object with the same mesh and placements objects: the plan's identity test falls back to them
        ("sharded (new spec), replicated", [DTensor.from_local(upstream.dtensor_local(sharded), mesh,
                                                               sharded.placements, run_check=False,
                                                               shape=sharded.shape, stride=sharded.stride()),
                                           replicated], None, None),
    ]
    out = []
    for p in (2.0, math.inf, 1.0, 0.0, 3.0):
        for what, tensors, replication, fulls in cases:
            fulls = fulls or [full(t) for t in tensors]
            expected = torch.linalg.vector_norm(torch.cat([f.double().flatten() for f in fulls]), p).item()
            wanted = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
            norm, count = _count_collectives(total_norm, tensors, p, plain_replication=replication)
            out.append((what, p, norm.item(), expected, count, norm.dtype, wanted))
    return out


def test_same_length_other_layout_is_planned_anew(pool4):
    for rank_results in pool4.run(same_length_layouts_run, 5):
        for what, p, ours, expected, count, dtype, wanted in rank_results:
            assert ours == pytest.approx(expected, rel=1e-6, abs=0), (what, p)
            assert count == 1 and dtype == wanted, (what, p, count, dtype)


def training_changes_run(path: str, config: dict) -> list:
    """The user's loop on a sharded model, clipping ``model.parameters()`` every step while the set of gradients
    changes between steps: parameters frozen (``requires_grad`` off, their gradients None after
    ``zero_grad()``), unfrozen again, one gradient dropped by hand, a new parameter added to the clipped list.
    Each step: (what, norm, reference over the gathered gradients in fp64, collectives, clipped exactly)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import shardadopt
    from shardadopt.parallel.topology import topology
    from shardadopt.testing import full, token_batch

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 distributed_config=DistributedConfig(**config))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    if any(not isinstance(p, DTensor) and topology(model).plain_replication(p) != dist.get_world_size()
           for p in model.parameters()):
        return None  # shards kept as plain tensors (old transformers): no gathered reference
    extra = torch.nn.Parameter(torch.zeros(4))  # a new plain parameter, the same on every rank
    frozen = [p for n, p in model.named_parameters() if ".layers.0." in n]
    steps = ["all", "layer 0 frozen", "layer 0 unfrozen", "one grad dropped", "a parameter added", "all again"]
    out = []
    for step, what in enumerate(steps):
        for p in frozen:
            p.requires_grad_(what != "layer 0 frozen")
        ids = token_batch(step, 2)
        model(input_ids=ids, labels=ids).loss.backward()
        params = list(model.parameters())
        if what == "one grad dropped":
            params[-1].grad = None
        if what == "a parameter added":
            extra.grad = torch.arange(4.0)
            params.append(extra)
        replication = topology(model).grad_replication(params)
        grads = [p.grad for p in params if p.grad is not None]
        expected = torch.linalg.vector_norm(torch.cat([full(g).double().flatten() for g in grads])).item()
        before = [upstream.dtensor_local(g).clone() if isinstance(g, DTensor) else g.clone() for g in grads]
        norm, count = _count_collectives(shardadopt.clip_grad_norm_, params, MAX_NORM, plain_replication=replication)
        coef = torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0)
        after = [upstream.dtensor_local(g) if isinstance(g, DTensor) else g for g in grads]
        exact = all(torch.equal(a, b * coef) for a, b in zip(after, before))
        out.append((what, norm.item(), expected, count, exact, dist.get_rank()))
        optimizer.step()
        optimizer.zero_grad()
    return out


@pytest.mark.parametrize("name,config", [pytest.param("qwen3", dict(fsdp_size=2), id="fsdp"),
                                         pytest.param("qwen3", dict(tp_size=2), id="tp"),
                                         pytest.param("qwen3moe", dict(ep_size=2, fsdp_size=2), id="ep+fsdp")])
def test_norm_follows_the_gradients_between_steps(pool2, tiny_models, name, config):
    skip_unless_loadable(config)
    results = pool2.run(training_changes_run, tiny_models[name], config)
    if results[0] is None:
        pytest.skip(f"transformers {_transformers_version()} keeps these shards as plain tensors: no gathered "
                    f"reference (test_layout_2_ranks compares them with the one-process model)")
    for rank_results in results:
        for what, ours, expected, count, exact, rank in rank_results:
            assert ours == pytest.approx(expected, rel=1e-6, abs=0), (what, rank)
            assert count == 1 and exact, (what, rank, count)


def nonfinite_run(bad_rank: int, value: float) -> dict:
    """A non-finite value on one rank only: every rank sees it, and error_if_nonfinite raises everywhere."""
    import torch.distributed as dist

    from shardadopt.gradnorm import total_norm

    grads = [torch.ones(3), torch.ones(2)]
    if dist.get_rank() == bad_rank:
        grads[1][0] = value
    norms = {p: total_norm(grads, p, plain_replication=lambda t: 1).item() for p in NORM_TYPES}
    try:
        total_norm(grads, 2.0, error_if_nonfinite=True, plain_replication=lambda t: 1)
        raised = False
    except RuntimeError as exc:
        raised = "non-finite" in str(exc)
    return {"norms": norms, "raised": raised}


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_nonfinite_on_one_rank_reaches_all(pool2, value):
    results = pool2.run(nonfinite_run, 1, value)
    for r in results:
        assert r["raised"]
        for p, norm in r["norms"].items():
            assert (math.isnan(norm) if math.isnan(value) else norm == math.inf), (p, norm)


def layout_error_run() -> dict:
    """A plain tensor whose replication rank 1 cannot count: rank 1 raises, rank 0 gets NaN, nobody hangs. And a
    group that misses some of a DTensor's mesh ranks is refused."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from shardadopt.gradnorm import LayoutError, total_norm

    out = {}
    try:
        out["norm"] = total_norm([torch.ones(2)], plain_replication=lambda t: 1 + 5 * dist.get_rank()).item()
    except LayoutError as exc:
        out["error"] = str(exc)
    dt = distribute_tensor(torch.ones(4), init_device_mesh("cpu", (2,)), [Shard(0)])
    solo = dist.new_group([0])  # every rank must create it
    if dist.get_rank() == 0:
        try:
            total_norm([dt], group=solo)
        except LayoutError as exc:
            out["group_error"] = str(exc)
    dist.barrier()
    return out


def test_layout_errors_raise_without_hanging(pool2):
    ok, bad = pool2.run(layout_error_run)
    assert math.isnan(ok["norm"]) and "plain_replication returned 6" in bad["error"]
    assert "are not in the process group" in ok["group_error"] and "group=None" in ok["group_error"]
