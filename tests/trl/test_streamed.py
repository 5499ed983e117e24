"""Streamed data (a ``datasets`` dataset from ``to_iterable_dataset``) on tensor-parallel loads.

accelerate dispatches iterable datasets from rank 0 by default (``dispatch_batches=True``, which Trainer and TRL
inherit). On an adopted model it dispatches per data-parallel group: the ranks of a TP group get the same batch, the
data-parallel ranks disjoint pieces of the global batch. Losses, grad norms and parameters equal one process on the
same global batches (the accelerate loop) or a one-process Trainer on the same stream.
"""

from __future__ import annotations

import pytest

from shardadopt.selftest.accelerate import compare_training, train_rank, train_reference
from shardadopt.selftest.trainer import compare_logs, train_log
from shardadopt.testing.layouts import LayoutUnsupported, distributed_sizes

pytestmark = pytest.mark.multiproc

TRAINER_STEPS = 3


def _sizes(layout: str, world: int) -> tuple[dict, int]:
    try:
        return distributed_sizes(layout, world)
    except LayoutUnsupported as exc:
        pytest.skip(str(exc))


def _check_accelerate(results: list[dict], expected: dict, dp: int) -> None:
    problem = compare_training(results[0], expected)
    assert problem is None, problem
    for result in results[1:]:
        assert result["losses"] == results[0]["losses"] and result["norms"] == results[0]["norms"]
    batches = [r["batches"] for r in results]
    tp = len(results) // dp
    for group in range(dp):  # the ranks of a TP group (consecutive ranks) got the same batches
        members = batches[group * tp:(group + 1) * tp]
        assert all(b == members[0] for b in members), f"TP group {group} got different batches"
    if dp > 1:
        rows = lambda b: {tuple(row) for batch in b for row in batch}  # noqa: E731
        assert not rows(batches[0]) & rows(batches[-1]), "data-parallel ranks got overlapping batches"


@pytest.mark.parametrize("split_batches", [False, True])
def test_source_cuts_global_batches_per_data_parallel_rank(split_batches):
    """What rank 0 hands the dispatcher, for 4 processes in 2 data-parallel groups (ranks 0,1 and 2,3): per process,
    its group's piece of each global batch; 7 samples leave a short last global batch, padded from the epoch's
    first samples so that the pieces stay equal."""
    import torch

    from shardadopt.adopt import DataParallelSource

    rows = torch.arange(7)
    loader = torch.utils.data.DataLoader(rows, batch_size=4 if split_batches else 2)
    source = DataParallelSource(loader, [0, 0, 1, 1], split_batches)
    assert isinstance(source, torch.utils.data.DataLoader) and source.dataset is rows
    per_process = [b.tolist() for b in source]
    if split_batches:  # one global batch per read, already in process order
        per_process = [piece for b in per_process for piece in (b[:len(b) // 4], b[len(b) // 4:len(b) // 2],
                                                                  b[len(b) // 2:3 * len(b) // 4], b[3 * len(b) // 4:])]
    assert per_process == [[0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [4, 5], [6, 0], [6, 0]]
    assert source.last_global_size == 3
    assert len(source) == (2 if split_batches else 8)


def eval_gather_rank(path: str, sizes: dict, samples: int) -> list[int]:
    """Prepare a sharded model and a streamed eval set whose length does not fill the last global batch; what
    ``gather_for_metrics`` returns over the epoch."""
    import torch
    from datasets import Dataset

    import shardadopt
    from shardadopt.selftest.accelerate import _load
    from shardadopt.testing.accelerator import fresh_accelerator

    shardadopt.enable()
    try:
        accelerator = fresh_accelerator(cpu=True)
        model = accelerator.prepare(_load(path, sizes))
        stream = Dataset.from_dict({"index": list(range(samples))}).to_iterable_dataset().with_format("torch")
        loader = accelerator.prepare(torch.utils.data.DataLoader(stream, batch_size=2))
        seen = []
        with torch.no_grad():
            for batch in loader:
                model(input_ids=batch["index"].unsqueeze(1) % 7)  # every rank takes part in the forward
                seen.extend(accelerator.gather_for_metrics(batch["index"]).tolist())
        return seen
    finally:
        shardadopt.disable()


def test_tp_accelerate_loop_and_trainer_match_one_process(pool2, tiny_models):
    sizes, dp = _sizes("tp", 2)
    results = pool2.run(train_rank, tiny_models["qwen3"], sizes, dp, streamed=True, timeout=300)
    _check_accelerate(results, train_reference(tiny_models["qwen3"], dp), dp)
    logs = pool2.run(train_log, tiny_models, "tp", TRAINER_STEPS, streamed=True, timeout=300)
    expected = train_log(tiny_models, "tp", TRAINER_STEPS, single_process=True, streamed=True)
    for log in logs:
        problem = compare_logs(log, expected)
        assert problem is None, problem


def test_2d_accelerate_loop_trainer_and_metrics_match_one_process(pool4, tiny_models):
    sizes, dp = _sizes("2d", 4)
    results = pool4.run(train_rank, tiny_models["qwen3"], sizes, dp, streamed=True, timeout=400)
    _check_accelerate(results, train_reference(tiny_models["qwen3"], dp), dp)
    logs = pool4.run(train_log, tiny_models, "2d", TRAINER_STEPS, streamed=True, timeout=400)
    expected = train_log(tiny_models, "2d", TRAINER_STEPS, single_process=True, streamed=True)
    for log in logs:
        problem = compare_logs(log, expected)
        assert problem is None, problem
    # 7 samples: global batches of 4, the last one short (3 samples, padded to 2 per data-parallel rank)
    for seen in pool4.run(eval_gather_rank, tiny_models["qwen3"], sizes, 7, timeout=300):
        assert seen == list(range(7)), seen
