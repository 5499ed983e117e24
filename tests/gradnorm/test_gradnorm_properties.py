"""Property tests of the grad-norm core in one process: a simulated world of N ranks.

Full tensors are sharded the way DTensor does it (placements applied left to right over the mesh dims, torch.chunk
pieces padded with empty ones, _StridedShard's split-then-interleave), over random meshes of 1-3 dims that may
cover only part of the world (the other ranks hold copies of the sub-mesh, in a random rank order), and plain
tensors held by a random number of ranks. Every virtual rank runs the core on its own pieces, the payloads are
combined as the all-reduce would, and the result is compared with ``torch.linalg.vector_norm`` over the
concatenated full tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard

from shardadopt import upstream
from shardadopt.gradnorm import clip_grads_with_norm_, total_norm
from shardadopt.gradnorm.core import Piece, check_norm_type, finish, local_payload, reduce_op
from shardadopt.gradnorm.layout import Group, LayoutError, count_shards, to_pieces

StridedShard = upstream.strided_shard_type()

NORM_TYPES = [0.0, 1.0, 2.0, 3.5, math.inf]
# fp32 per-piece norms (what torch computes too) raised to p and summed in fp64: a few fp32 ulps.
RTOL = 4e-6


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class OnMesh:
    shape: tuple[int, ...]  # mesh shape; its size divides the world, the other ranks hold copies
    placements: tuple


@dataclass(frozen=True)
class Plain:
    pieces: int  # the full tensor is cut into this many pieces along dim 0, each held by world/pieces ranks


@dataclass
class World:
    size: int
    order: list[int]  # a permutation of the ranks: meshes and plain pieces are laid out in this order
    tensors: list[torch.Tensor]
    layouts: list


@st.composite
def placements(draw, ndim: int):
    dim = st.integers(0, ndim - 1)
    return draw(st.one_of(st.just(Replicate()), dim.map(Shard),
                          st.tuples(dim, st.integers(1, 3)).map(lambda a: StridedShard(a[0], split_factor=a[1]))))


@st.composite
def mesh_shapes(draw, world: int):
    rest = draw(st.sampled_from(divisors(world)))
    ndim = draw(st.integers(1, 3))
    shape = []
    for _ in range(ndim - 1):
        f = draw(st.sampled_from(divisors(rest)))
        shape.append(f)
        rest //= f
    return tuple(draw(st.permutations(shape + [rest])))


@st.composite
def worlds(draw, max_world: int = 8, max_tensors: int = 4):
    size = draw(st.integers(1, max_world))
    tensors, layouts = [], []
    for _ in range(draw(st.integers(1, max_tensors))):
        shape = tuple(draw(st.lists(st.integers(0, 7), min_size=1, max_size=3)))
        gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
        values = torch.randn(shape, generator=gen, dtype=torch.float64) * 10.0 ** draw(st.integers(-3, 3))
        values[torch.rand(shape, generator=gen) < draw(st.sampled_from([0.0, 0.3]))] = 0.0
        tensors.append(values.to(draw(st.sampled_from([torch.float32, torch.bfloat16]))))
        if draw(st.integers(0, 3)) == 0:
            layouts.append(Plain(draw(st.sampled_from(divisors(size)))))
        else:
            mesh = draw(mesh_shapes(size))
            layouts.append(OnMesh(mesh, tuple(draw(placements(len(shape))) for _ in mesh)))
    return World(size, draw(st.permutations(range(size))), tensors, layouts)


def chunk(t: torch.Tensor, n: int, dim: int) -> list[torch.Tensor]:
    """torch.chunk padded with empty pieces to exactly n, as DTensor's Shard does."""
    parts = list(torch.chunk(t, n, dim)) if t.shape[dim] else []
    return parts + [t.narrow(dim, 0, 0)] * (n - len(parts))


def local_shard(full: torch.Tensor, mesh_shape: tuple[int, ...], coordinate: tuple[int, ...], placements):
    local = full
    for size, coord, placement in zip(mesh_shape, coordinate, placements):
        if isinstance(placement, StridedShard):
            firsts = chunk(local, placement.split_factor, placement.dim)
            seconds = [chunk(f, size, placement.dim) for f in firsts]
            local = torch.cat([s[coord] for s in seconds], placement.dim)
        elif isinstance(placement, Shard):
            local = chunk(local, size, placement.dim)[coord]
    return local


class StubMesh:
    """What count_shards reads from a DeviceMesh: the rank array and the size of each dim."""

    def __init__(self, ranks: torch.Tensor):
        self.mesh = ranks

    def size(self, dim: int) -> int:
        return self.mesh.shape[dim]

    def __repr__(self) -> str:
        return f"StubMesh({self.mesh.tolist()})"


def rank_pieces(world: World, rank: int, tensors: list[torch.Tensor] | None = None) -> list[Piece]:
    """What virtual ``rank`` holds, with replica counts from the layout module (count_shards) for meshes."""
    group = Group(range(world.size), rank)
    position = world.order.index(rank)
    pieces = []
    for full, layout in zip(tensors or world.tensors, world.layouts):
        if isinstance(layout, Plain):
            pieces.append(Piece(chunk(full, layout.pieces, 0)[position % layout.pieces], world.size // layout.pieces))
            continue
        size = math.prod(layout.shape)
        copy, index = divmod(position, size)
        ranks = torch.tensor(world.order[copy * size:(copy + 1) * size]).reshape(layout.shape)
        coordinate = tuple(int(c) for c in torch.unravel_index(torch.tensor(index), layout.shape))
        shards = count_shards(StubMesh(ranks), layout.placements, group)
        pieces.append(Piece(local_shard(full, layout.shape, coordinate, layout.placements), world.size // shards))
    return pieces


def combine(payloads: list[torch.Tensor], p: float) -> torch.Tensor:
    """What the all-reduce computes. The MAX uses torch.fmax, which drops NaN like the loosest real backend, so a
    test of the NaN flag cannot pass by luck."""
    if reduce_op(p) == "sum":
        return torch.stack(payloads).sum(dim=0)
    out = payloads[0]
    for payload in payloads[1:]:
        out = torch.fmax(out, payload)
    return out


def simulate(world: World, p: float, foreach=None, tensors=None) -> list[torch.Tensor]:
    """The norm every virtual rank ends with (fp32, as the public functions return it)."""
    payloads = [local_payload(rank_pieces(world, r, tensors), p, "cpu", foreach) for r in range(world.size)]
    reduced = combine(payloads, p)
    return [finish(reduced.clone(), p).float() for _ in range(world.size)]


def reference(tensors: list[torch.Tensor], p: float) -> torch.Tensor:
    flat = torch.cat([t.double().flatten() for t in tensors])
    # An empty vector has norm 0 (vector_norm refuses it for p = inf: max has no identity, but |x| >= 0 does).
    return torch.linalg.vector_norm(flat, p) if flat.numel() else torch.zeros((), dtype=torch.float64)


def assert_same_on_all_ranks(totals: list[torch.Tensor]) -> None:
    for t in totals[1:]:
        assert torch.equal(t, totals[0]) or (t.isnan() and totals[0].isnan())


@settings(max_examples=300, deadline=None)
@given(world=worlds(), p=st.sampled_from(NORM_TYPES), foreach=st.sampled_from([None, False]))
def test_norm_matches_full_tensor_reference(world, p, foreach):
    totals = simulate(world, p, foreach)
    assert_same_on_all_ranks(totals)
    torch.testing.assert_close(totals[0].double(), reference(world.tensors, p), rtol=RTOL, atol=1e-30)


@settings(max_examples=200, deadline=None)
@given(world=worlds(), p=st.sampled_from([1.0, 2.0, 3.5, math.inf]), ratio=st.floats(0.01, 3.0))
def test_clip_same_coefficient_and_never_increases(world, p, ratio):
    total = simulate(world, p)[0]
    max_norm = float(total) * ratio
    coefs, clipped_by_rank = [], []
    for rank in range(world.size):
        params = []
        for piece in rank_pieces(world, rank):
            param = torch.nn.Parameter(torch.zeros_like(piece.tensor))
            param.grad = piece.tensor.clone()  # every rank owns its copy, as on a real machine
            params.append(param)
        clip_grads_with_norm_(params, max_norm, total)
        coefs.append(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        clipped_by_rank.append([q.grad for q in params])
        for piece, param in zip(rank_pieces(world, rank), params):
            assert torch.equal(param.grad, piece.tensor * coefs[-1])  # replicas stay bitwise identical
    assert_same_on_all_ranks(coefs)
    # The norm after clipping, from the clipped full tensors (clipping scales every element by one coefficient).
    after = reference([t * coefs[0] for t in world.tensors], p)
    assert after <= total.double() * (1 + RTOL)
    if ratio < 1:  # max_norm, short of torch's eps in the coefficient (2% of a 5e-5 norm: seen in a repeated suite)
        expected = max_norm * float(total) / (float(total) + 1e-6)
        torch.testing.assert_close(after, torch.tensor(expected, dtype=torch.float64), rtol=1e-2, atol=1e-30)


@settings(max_examples=200, deadline=None)
@given(world=worlds(), p=st.sampled_from(NORM_TYPES), sign=st.sampled_from([-1, 1]), exponent=st.integers(-8, 8),
       mantissa=st.floats(1.0, 2.0, exclude_max=True))
def test_scaling_all_grads_scales_the_norm(world, p, sign, exponent, mantissa):
    # A power of two scales bf16 values exactly; other factors only when every tensor is fp32.
    if any(t.dtype != torch.float32 for t in world.tensors):
        mantissa = 1.0
    c = sign * mantissa * 2.0**exponent
    scaled = [(t.double() * c).to(t.dtype) for t in world.tensors]
    expected = simulate(world, p)[0].double() * (1.0 if p == 0 else abs(c))
    torch.testing.assert_close(simulate(world, p, tensors=scaled)[0].double(), expected, rtol=2 * RTOL, atol=1e-30)


@settings(max_examples=200, deadline=None)
@given(world=worlds(), p=st.sampled_from(NORM_TYPES), bad=st.lists(st.sampled_from([math.inf, -math.inf, math.nan]),
                                                                     min_size=1, max_size=3), data=st.data())
def test_nonfinite_values_propagate_to_every_rank(world, p, bad, data):
    candidates = [i for i, t in enumerate(world.tensors) if t.numel()]
    assume(candidates)
    tensors = [t.clone() for t in world.tensors]
    for value in bad:
        t = tensors[data.draw(st.sampled_from(candidates))]
        t.view(-1)[data.draw(st.integers(0, t.numel() - 1))] = value
    totals = simulate(world, p, tensors=tensors)
    assert_same_on_all_ranks(totals)
    expected = reference(tensors, p)
    if expected.isfinite():  # p = 0 counts nonzeros: NaN and inf are just nonzero
        torch.testing.assert_close(totals[0].double(), expected, rtol=RTOL, atol=1e-30)
    else:
        torch.testing.assert_close(totals[0].double(), expected, equal_nan=True)


@settings(max_examples=200, deadline=None)
@given(world=worlds(max_tensors=1), data=st.data())
def test_count_shards_matches_brute_force_count(world, data):
    """Every element is counted exactly once: the pieces' weights 1/replicas sum to 1 per element."""
    full = torch.arange(world.tensors[0].numel(), dtype=torch.float64).reshape(world.tensors[0].shape)
    weight = torch.zeros_like(full).flatten()
    for rank in range(world.size):
        (piece,) = rank_pieces(world, rank, [full])
        weight.index_add_(0, piece.tensor.flatten().long(), torch.full((piece.tensor.numel(),), 1 / piece.replicas,
                                                                       dtype=torch.float64))
    torch.testing.assert_close(weight, torch.ones_like(weight))


# --- single-process behaviour of the public functions and the errors ---------------------------------------------

@pytest.mark.parametrize("p", [1.0, 2.0, 3.5, math.inf])
def test_single_process_equals_torch(p):
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=gen) for s in [(7, 3), (11,), (2, 2, 2)]]
    torch.testing.assert_close(total_norm(tensors, p), torch.nn.utils.get_total_norm(tensors, p), rtol=1e-6, atol=0)
    ours = [torch.nn.Parameter(torch.zeros_like(t)) for t in tensors]
    theirs = [torch.nn.Parameter(torch.zeros_like(t)) for t in tensors]
    for a, b, t in zip(ours, theirs, tensors):
        a.grad, b.grad = t.clone(), t.clone()
    from shardadopt.gradnorm import clip_grad_norm_

    clip_grad_norm_(ours, 0.5, p)
    torch.nn.utils.clip_grad_norm_(theirs, 0.5, p)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)


def test_empty_and_bf16_result_dtype():
    assert total_norm([]).item() == 0.0
    assert total_norm([torch.ones(4, dtype=torch.bfloat16)]).dtype == torch.float32
    assert total_norm([torch.ones(4, dtype=torch.float64)]).dtype == torch.float64


def test_p0_counts_nonzero_elements():
    tensors = [torch.tensor([0.0, 1.0, 2.0]), torch.tensor([0.0, 0.0]), torch.tensor([3.0])]
    assert total_norm(tensors, 0).item() == 3.0  # torch's get_total_norm says 2 (tensors with a nonzero)


def test_error_if_nonfinite():
    with pytest.raises(RuntimeError, match="non-finite"):
        total_norm([torch.tensor([1.0, math.nan])], 2.0, error_if_nonfinite=True)


def test_negative_norm_type_refused():
    with pytest.raises(ValueError, match="norm_type"):
        check_norm_type(-1)
    with pytest.raises(ValueError, match="norm_type"):
        reduce_op(math.nan)


def test_piece_needs_positive_replicas():
    with pytest.raises(ValueError, match="replicas"):
        local_payload([Piece(torch.ones(1), 0)], 2.0)


def test_count_shards_errors_name_the_problem():
    mesh = StubMesh(torch.tensor([[0, 1], [2, 3]]))
    with pytest.raises(LayoutError, match="not in the process group"):
        count_shards(mesh, (Shard(0), Shard(0)), Group([0, 1], 0))
    with pytest.raises(LayoutError, match="does not include it"):
        count_shards(mesh, (Shard(0), Shard(0)), Group(range(8), 5))
    with pytest.raises(LayoutError, match="does not divide"):
        count_shards(StubMesh(torch.tensor([0, 1])), (Shard(0),), Group(range(3), 0))
    assert count_shards(mesh, (Replicate(), StridedShard(0, split_factor=2)), Group(range(8), 0)) == 2


def test_plain_replication_is_validated():
    group = Group(range(4), 0)
    pieces, errors = to_pieces([torch.ones(2), torch.ones(3)], group, lambda t: 2 if t.numel() == 2 else 7)
    assert [p.replicas for p in pieces] == [2] and len(errors) == 1 and "from 1 to the group size 4" in str(errors[0])
    pieces, errors = to_pieces([torch.ones(2)], group, None)
    assert pieces[0].replicas == 4 and not errors
    pieces, errors = to_pieces([torch.ones(2)], group, {}.__getitem__)
    assert not pieces and "plain_replication raised KeyError" in str(errors[0])


def test_cached_plans_keep_no_gradient_alive():
    """A plan is cached per layout and reused every step; it must not hold the gradients of the call that built it
    (a 245M model's step held one gradient shard too many after ``zero_grad``: docs/benchmarks.md)."""
    import gc
    import weakref

    from shardadopt.gradnorm import clip_grad_norm_

    params = [torch.nn.Parameter(torch.zeros(s)) for s in [(5, 3), (7,)]]
    for step in range(2):
        for param in params:
            param.grad = torch.full_like(param, 1.0 + step)
        grads = [weakref.ref(param.grad) for param in params]
        expected = torch.nn.utils.get_total_norm([param.grad for param in params])
        torch.testing.assert_close(clip_grad_norm_(params, 0.5), expected)
        for param in params:
            param.grad = None  # what optimizer.zero_grad() does
        gc.collect()
        assert [ref() for ref in grads] == [None, None], f"step {step}: a gradient outlived zero_grad"
