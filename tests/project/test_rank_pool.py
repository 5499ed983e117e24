"""The test pool itself: a rank that never answers is reported with every thread's stack, so a hang seen once in CI
says where it was."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
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


def test_a_script_without_a_main_guard_is_told_why_its_ranks_died(tmp_path):
    """Spawned ranks import the launching script again; without the guard they die starting a pool of their own,
    before the worker writes its stack file, and the launcher says so instead of failing on the missing file."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""\
        from shardadopt.testing import RankPool

        with RankPool(2) as pool:
            pool.run(len, "ab")
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    err = proc.stderr
    assert "FileNotFoundError" not in err, err
    assert "RankError: raised on rank(s) [0, 1]" in err, err
    assert "\nprocess exited (exit code 1) before the pool's worker started in it (no stack file)" in err, err
    assert 'put that code under `if __name__ == "__main__":`' in err, err
