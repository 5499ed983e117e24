"""Whether gloo's collectives work on a device's tensors here, asked of two throwaway processes.

``selftest --device cuda --backend gloo`` lets ranks share a GPU over gloo. On torch 2.11 (H200, CUDA 13.0) both
ranks die of SIGSEGV inside the functional collectives DTensor uses (``full_tensor`` -> ``wait_tensor``) on gloo
with CUDA tensors. A selftest must not find that out by losing every scenario to "exited without answering": it
runs the smallest reproducer, ``distribute_tensor(...).full_tensor()`` on 2 ranks, in subprocesses first, and a
rank killed by a signal or an error becomes a reason the caller can act on.

    python -m shardadopt.selftest.device_check RANK WORLD PORT DEVICE    # one rank of the check
"""

from __future__ import annotations

import os
import subprocess
import sys

from shardadopt.testing.pool import free_port, signal_name

CHECK_SECONDS = 120.0  # two processes importing torch on a loaded machine, plus one collective


def gloo_collectives_problem(device: str, nproc: int = 2, timeout: float = CHECK_SECONDS,
                             module: str = __name__) -> str | None:
    """None when ``distribute_tensor(...).full_tensor()`` on ``nproc`` gloo ranks with ``device`` tensors works,
    else what happened (the rank, its signal or error, and the last lines it printed).

    A rank killed by a signal is asked once more: the crash this check exists for repeats on every run, while
    torch's CPU gloo collectives have been seen to die of a signal once in a while on an overloaded machine.

    Args:
        device: ``"cuda"`` (ranks share the GPUs round-robin) or ``"cpu"``.
        nproc: ranks to start.
        timeout: seconds before the check counts as failed.
        module: the module run as each rank (``python -m``); tests pass one that crashes.

    Returns:
        None, or a one-paragraph reason.
    """
    problem, signalled = _check_once(device, nproc, timeout, module)
    if signalled:
        problem, _ = _check_once(device, nproc, timeout, module)
    return problem


def _check_once(device: str, nproc: int, timeout: float, module: str) -> tuple[str | None, bool]:
    """The check's problem (None: it worked), and whether a rank died of a signal."""
    port = str(free_port())
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", module, str(rank), str(nproc), port, device], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(nproc)]
    problems = []
    signalled = False
    for rank, proc in enumerate(procs):
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            output, _ = proc.communicate()
            problems.append(f"rank {rank} gave no answer within {timeout:.0f}s")
            continue
        if proc.returncode != 0:
            signalled = signalled or proc.returncode < 0
            tail = "\n".join(output.strip().splitlines()[-8:])
            problems.append(f"rank {rank} died of {signal_name(proc.returncode)}:\n{tail}")
    return "\n".join(problems) or None, signalled


def _rank(rank: int, world: int, port: str, device: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh(device, (world,))
        full = torch.arange(8.0 * world).reshape(2 * world, 4)
        gathered = distribute_tensor(full.to(device), mesh, [Shard(0)]).full_tensor()
        if not torch.equal(gathered.cpu(), full):
            raise SystemExit(f"full_tensor gathered {gathered.cpu().tolist()}, expected {full.tolist()}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
