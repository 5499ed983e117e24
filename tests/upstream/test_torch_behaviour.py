"""The torch behaviours shardadopt works around (shardadopt.upstream.torchprobe), on whichever torch runs the suite.

CI runs this module on torch 2.13.0 and 2.15.0 (.ci/run) and .ci/matrix on 2.14.1. Each test checks that the
probe answers what torch really does here, and that the workaround gives the right result either way, so a torch
release that fixes one of them shows up as a probe flipping to "fixed" (``shardadopt doctor``), never as a failure.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from shardadopt import upstream
from shardadopt.gradnorm import total_norm
from shardadopt.gradnorm.layout import Group, count_shards
from shardadopt.parallel.optimizer_ready import make_shards_contiguous
from shardadopt.upstream import torchprobe

StridedShard = upstream.strided_shard_type()


def _adamw_step_on_column_shard(fused: bool, compact: bool) -> torch.Tensor:
    """One AdamW step on this rank's column shard of a weight, kept as a strided view (transformers 5.15 TP)."""
    full = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(full[:, 8:])
    if compact:
        assert make_shards_contiguous(model) == ["weight"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **({"fused": True} if fused else {"foreach": False}))
    (model.weight * torch.arange(64.0).reshape(8, 8).sin()).sum().backward()
    optimizer.step()
    return model.weight.detach().clone()


def test_fused_adamw_on_strided_shards():
    """Why Trainer's create_optimizer makes plain shards contiguous: fused CPU AdamW pairs a strided parameter with
    its contiguous grad element by element (torch 2.13 and 2.15: off by up to 2x the learning rate)."""
    reference = _adamw_step_on_column_shard(fused=False, compact=False)
    strided = _adamw_step_on_column_shard(fused=True, compact=False)
    assert torch.allclose(strided, reference, rtol=1e-6, atol=1e-7) == torchprobe.fused_adamw_strided_ok("cpu")
    torch.testing.assert_close(_adamw_step_on_column_shard(fused=True, compact=True), reference, rtol=1e-6,
                               atol=1e-7)


class _Mesh:
    """What count_shards reads from a DeviceMesh: the rank array and the size of each dim."""

    def __init__(self, ranks: torch.Tensor):
        self.mesh = ranks

    def size(self, dim: int) -> int:
        return self.mesh.shape[dim]


def test_strided_shard_counts_as_a_shard():
    """FSDP over TP leaves ``_StridedShard`` placements; torch 2.13 and 2.15 do not make them ``Shard``s."""
    placement = StridedShard(0, split_factor=2)
    assert isinstance(placement, Shard) == torchprobe.strided_shard_is_shard()
    mesh = _Mesh(torch.arange(4).reshape(2, 2))
    assert count_shards(mesh, (placement, Replicate()), Group(range(4), 0)) == 2
    assert count_shards(mesh, (placement, Shard(1)), Group(range(4), 0)) == 4


@pytest.mark.parametrize("norm_type", [math.inf, 2.0])
def test_norm_over_empty_shards(norm_type):
    """Uneven shards leave some ranks an empty piece; torch's inf-norm refuses an empty tensor (2.13, 2.15)."""
    try:
        torch.linalg.vector_norm(torch.empty(0), math.inf)
        accepts = True
    except RuntimeError as exc:
        assert "empty" in str(exc)
        accepts = False
    assert accepts == torchprobe.inf_norm_accepts_empty()
    grads = [torch.tensor([3.0, -4.0]), torch.empty(0), torch.tensor([1.5])]
    expected = torch.linalg.vector_norm(torch.cat(grads), norm_type)
    torch.testing.assert_close(total_norm(grads, norm_type), expected)


def test_report_names_every_probe():
    rows = torchprobe.report(("cpu",))
    assert [row["name"] for row in rows] == ["fused AdamW on strided cpu parameters", "_StridedShard is a Shard",
                                             "inf-norm of an empty shard"]
    assert all(isinstance(row["fixed"], bool) and row["workaround"] for row in rows)


CUDA_REFUSAL = "params, grads, exp_avgs, and exp_avg_sqs must have same dtype, device, and layout"


def test_a_probe_whose_call_raises_answers_and_doctor_shows_why(monkeypatch, capsys):
    """Fused AdamW refusing a strided parameter (torch 2.11 on CUDA) is a verdict, not a traceback in doctor."""
    from shardadopt import cli

    def refuse(self, closure=None):
        raise RuntimeError(CUDA_REFUSAL)

    monkeypatch.setattr(torch.optim.AdamW, "step", refuse)
    monkeypatch.setattr(torchprobe, "_FAILURES", {})
    torchprobe.fused_adamw_strided_ok.cache_clear()
    try:
        row = torchprobe.report(("cpu",))[0]
        assert row == {"name": "fused AdamW on strided cpu parameters", "fixed": False,
                       "workaround": "plain shards made contiguous before the optimizer is built",
                       "reason": f"RuntimeError: {CUDA_REFUSAL}"}
        cli.doctor()
        out = capsys.readouterr()
        assert "Traceback" not in out.out + out.err
        line = next(i for i, text in enumerate(out.out.splitlines()) if "fused AdamW on strided cpu" in text)
        assert "probe failed" in out.out.splitlines()[line]
        assert f"the probed call raised RuntimeError: {CUDA_REFUSAL}; the workaround stays on" in \
            out.out.splitlines()[line + 1]
    finally:
        torchprobe.fused_adamw_strided_ok.cache_clear()  # the next caller probes the real step again
