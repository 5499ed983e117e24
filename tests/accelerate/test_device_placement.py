"""Which device each collective's tensors are on, under the backends a GPU job uses (NCCL, gloo beside NCCL).

No GPU and no NCCL here: the backend is what torch.distributed reports (monkeypatched), and the checks are on
the decisions shardadopt takes from it — the device a tensor is created on or moved to before a collective.
benchmarks/gpu_check.py runs the real thing on a CUDA machine.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch
import torch.distributed as dist

from shardadopt import checkpoint
from shardadopt.checkpoint.export import _p2p_device
from shardadopt.cli import main
from shardadopt.gradnorm import _payload_device
from shardadopt.hpo import channel
from shardadopt.testing import RankPool


@pytest.fixture
def backend(monkeypatch):
    """Make the default group look like ``name`` (e.g. "nccl", "gloo", "cpu:gloo,cuda:nccl") on GPU 3."""
    def use(name: str) -> None:
        capability = {"nccl": ["cuda"], "gloo": ["cpu", "cuda"]}.get(name, ["cpu", "cuda"])
        monkeypatch.setattr(dist, "get_backend", lambda group=None: name)
        monkeypatch.setattr(dist.distributed_c10d, "_device_capability",  # upstream-private: a mock backend
                            lambda group=None: capability)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)

    return use


CPU, GPU1 = torch.device("cpu"), torch.device("cuda", 1)


@pytest.mark.parametrize("name, local, expected", [
    ("nccl", GPU1, GPU1),                          # shards on the GPU go as they are
    ("nccl", CPU, torch.device("cuda", 3)),        # CPU-offloaded shards through the current GPU (NCCL: CUDA only)
    ("gloo", GPU1, CPU),                           # gloo's send/recv take host memory only
    ("gloo", CPU, CPU),
    ("cpu:gloo,cuda:nccl", GPU1, GPU1),            # each device type has its backend
    ("cpu:gloo,cuda:nccl", CPU, CPU),
])
def test_checkpoint_gather_sends_where_the_backend_can(backend, name, local, expected):
    backend(name)
    assert _p2p_device(local) == expected


@pytest.mark.parametrize("name, first, expected", [
    ("nccl", CPU, torch.device("cuda", 3)),        # CPU-offloaded grads under NCCL: all-reduce on the GPU
    ("nccl", GPU1, GPU1),
    ("gloo", GPU1, GPU1),                          # gloo all-reduces CUDA tensors
    ("gloo", CPU, CPU),
])
def test_grad_norm_payload_device(backend, name, first, expected):
    backend(name)
    assert _payload_device(first, None) == expected


class _StandInGroup:
    """What the mocked ``ProcessGroupGloo`` constructor returns: weakly referable, as a backend is (the fence
    protects it weakly)."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 2


def test_hpo_control_group_is_gloo_on_cpu_beside_nccl(monkeypatch, backend):
    """The control messages never touch the (NCCL) training group: a gloo group of their own, CPU tensors."""
    backend("nccl")
    created = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "ProcessGroupGloo", lambda *args: created.append(args) or _StandInGroup())
    monkeypatch.setattr(dist, "PrefixStore", lambda prefix, store: store)
    monkeypatch.setattr(channel.upstream, "default_store", lambda: None)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(channel, "_GROUPS", [None, {}])
    ctl = channel.Channel(timeout=30)
    assert [args[1:3] for args in created] == [(0, 2)]  # a gloo backend over the whole world
    assert ctl._table.device == CPU
    with pytest.raises(ValueError, match="must use gloo"):
        channel.Channel(group=object(), timeout=30)  # an NCCL group passed by hand


def test_cuda_rng_state_round_trip_and_cpu_only_resume(monkeypatch, tmp_path):
    """A GPU rank saves its current device's CUDA RNG state; a CPU-only resume restores the rest and says so."""
    cuda_state = torch.arange(16, dtype=torch.uint8)
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": cuda_state.clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": restored.append(state))
    torch.manual_seed(7)
    checkpoint.save_rng_state(str(tmp_path))
    expected = torch.rand(3)
    torch.manual_seed(8)
    assert checkpoint.load_rng_state(str(tmp_path))
    assert torch.equal(torch.rand(3), expected) and len(restored) == 1 and torch.equal(restored[0], cuda_state)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    torch.manual_seed(8)
    with pytest.warns(UserWarning, match="CUDA random streams are not"):
        assert checkpoint.load_rng_state(str(tmp_path))
    assert torch.equal(torch.rand(3), expected) and len(restored) == 1


def test_cpu_rng_state_only_where_cuda_is_unused(monkeypatch, tmp_path):
    """CUDA present but never initialised (a CPU job on a GPU machine): no CUDA state, no CUDA context created."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": pytest.fail("CUDA touched"))
    checkpoint.save_rng_state(str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert checkpoint.load_rng_state(str(tmp_path))


def test_checkpoint_scenario_feeds_batches_where_the_model_is():
    """The selftest/test-suite training loop draws batches on the CPU RNG and moves them to the model's device
    (with --device cuda the model is on the GPU)."""
    from shardadopt.selftest.checkpoint import train_steps

    class Recorder(torch.nn.Module):
        device = torch.device("meta")  # what transformers' PreTrainedModel.device reports; any non-CPU device

        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(()))
            self.seen: list[torch.device] = []

        def forward(self, input_ids, labels):
            self.seen.append(input_ids.device)
            return types.SimpleNamespace(loss=self.weight * 2.0)

    model = Recorder()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    assert len(train_steps(model, optimizer, scheduler, None, 2)) == 2
    assert model.seen == [torch.device("meta")] * 2


def test_rank_pool_refuses_nccl_on_cpu():
    with pytest.raises(ValueError, match="cannot run ranks on 'cpu'"):
        RankPool(2, device="cpu", backend="nccl")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals of a machine without CUDA")
@pytest.mark.parametrize("argv, message", [
    (["selftest", "--device", "cpu", "--backend", "nccl"], "runs on gloo"),
    (["selftest", "--device", "cuda"], "no CUDA device here"),
    (["selftest", "--device", "cuda", "--backend", "gloo"], "no CUDA device here"),
])
def test_selftest_device_and_backend_refusals(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
