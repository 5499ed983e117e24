"""The test pool itself: a rank that never answers is reported with every thread's stack, so a hang seen once in CI
says where it was."""

from __future__ import annotations

import os
import signal
import time

import pytest

from shardadopt.testing import RankError, RankPool, RankTimeout

pytestmark = pytest.mark.multiproc


def _stuck_on_rank_one() -> int:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        _wait_for_a_peer_that_never_comes()
    return dist.get_rank()


def _wait_for_a_peer_that_never_comes() -> None:
    time.sleep(10**6)


def test_a_timeout_reports_the_silent_ranks_stacks():
    pool = RankPool(2)
    try:
        with pytest.raises(RankTimeout) as raised:
            pool.run(_stuck_on_rank_one, timeout=5)
    finally:
        pool.close(force=True)
    message = str(raised.value)
    assert "rank(s) [1] gave no answer within 5s" in message, message
    assert "--- rank 1, its threads ---" in message and "--- rank 0" not in message, message
    assert "_wait_for_a_peer_that_never_comes" in message and "_stuck_on_rank_one" in message, message


def _segfault_on_rank_one() -> int:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        _crash_in_native_code()
    return dist.get_rank()


def _crash_in_native_code() -> None:
    os.kill(os.getpid(), signal.SIGSEGV)


def test_a_rank_killed_by_a_signal_is_named_with_its_stack():
    """A segfaulting rank (gloo on CUDA tensors, torch 2.11) is reported by its signal and the stack it died in."""
    pool = RankPool(2)
    try:
        with pytest.raises(RankError) as raised:
            pool.run(_segfault_on_rank_one, timeout=60)
    finally:
        pool.close(force=True)
    message = str(raised.value)
    assert "--- rank 1 ---\nprocess died of SIGSEGV (signal 11) without answering; its stack (faulthandler):" in \
        message, message
    assert "Fatal Python error: Segmentation fault" in message, message
    assert "_crash_in_native_code" in message and "_segfault_on_rank_one" in message, message
