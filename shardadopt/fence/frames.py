"""Where the main thread is: inside ``torch.distributed`` (waiting on peers) or elsewhere, read from another thread.

The hang decision tells a rank waiting in a collective or a rendezvous for a hung peer from the hung rank itself (hung
in its own code: a dataloader, a read, a lock); the backstop after a trip finds a main thread that stays in one
``torch.distributed`` call the break did not reach.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch.distributed as dist

from shardadopt import upstream

_TORCH_DISTRIBUTED = os.path.dirname(dist.__file__) + os.sep
_DCP_FILE_IO = os.path.join(_TORCH_DISTRIBUTED, "checkpoint", "")  # + "*filesystem.py": DCP's reads and writes


def _main_thread_frame_in_torch_distributed() -> Any:
    """The main thread's innermost Python frame when it is ``torch.distributed`` code, else None."""
    frame = upstream.thread_frame(threading.main_thread().ident)
    return frame if frame is not None and frame.f_code.co_filename.startswith(_TORCH_DISTRIBUTED) else None


def waiting_in_torch_distributed() -> bool:
    """Whether the main thread's innermost Python frame is ``torch.distributed`` code: a stalled rank there waits in
    a collective or a process group's rendezvous for a peer (or is blocked inside DCP's writes, which the save's
    progress counts tell apart), where a rank hung in its own code (a dataloader, a read, a lock) is elsewhere."""
    return _main_thread_frame_in_torch_distributed() is not None


def main_thread_call() -> tuple[Any, int] | None:
    """(innermost frame, instruction) of the main thread when that frame is ``torch.distributed`` code waiting on
    peers (not DCP's file I/O: a long ``fsync`` of a big shard is no wait), else None. The same pair at two reads
    means the thread did not move in between: it is blocked in a call from there."""
    frame = _main_thread_frame_in_torch_distributed()
    if frame is None or (frame.f_code.co_filename.startswith(_DCP_FILE_IO)
                         and frame.f_code.co_filename.endswith("filesystem.py")):
        return None
    return frame, frame.f_lasti
