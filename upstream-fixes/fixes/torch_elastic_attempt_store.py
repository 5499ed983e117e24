"""torch-elastic-attempt-store: a job restarted by torchrun comes back; each attempt keys its groups on its own."""

from upstream_diffs import Edit, Fix, NewFile, Variant

HELPER = '''def _agree_on_attempt(store, rank, world_size, timeout) -> int:
    """A number for this attempt of a torchrun job, the same on every rank and never used by an earlier one.

    The agent's store outlives the workers, so keys an earlier attempt wrote are still there. Rank 0 draws the next
    number from a counter; every other rank asks under a fresh random token and waits for the answer under that
    token (no rank can take an answer an earlier attempt left); rank 0 answers until each rank acknowledged it.
    ``TORCHELASTIC_RESTART_COUNT`` would not do: it counts one agent's restarts, and nodes disagree after an agent
    restarted alone.
    """
    import time
    import uuid

    if rank != 0:
        token = uuid.uuid4().hex
        store.set(f"/worker/attempt/ask/{rank}", token)
        attempt = int(store.get(f"/worker/attempt/answer/{token}"))
        store.set(f"/worker/attempt/got/{attempt}/{rank}", "1")
        return attempt
    attempt = store.add("/worker/attempt/counter", 1)
    pending, answered = set(range(1, world_size)), set()
    deadline = time.monotonic() + timeout.total_seconds()
    while pending:
        for peer in sorted(pending):
            if store.check([f"/worker/attempt/got/{attempt}/{peer}"]):
                pending.discard(peer)
            elif store.check([f"/worker/attempt/ask/{peer}"]):
                token = store.get(f"/worker/attempt/ask/{peer}").decode()
                if token not in answered:
                    store.set(f"/worker/attempt/answer/{token}", str(attempt))
                    answered.add(token)
        if pending and time.monotonic() > deadline:
            raise TimeoutError(
                f"torchrun attempt {attempt}: ranks {sorted(pending)} did not join within {timeout}"
            )
        if pending:
            time.sleep(0.02)
    return attempt


def _create_c10d_store('''


def _branch(test: str) -> tuple[str, str]:
    old = f'''    if {test}:
        # We create a new TCPStore for every retry so no need to add prefix for each attempt.
        return TCPStore(
            host_name=hostname,
            port=port,
            world_size=world_size,
            is_master=False,
            timeout=timeout,
        )
'''
    new = f'''    if {test}:
        # The agent's store serves every attempt of the job: key this attempt's groups under a prefix of its own.
        store = TCPStore(
            host_name=hostname,
            port=port,
            world_size=world_size,
            is_master=False,
            timeout=timeout,
        )
        attempt = _agree_on_attempt(store, rank, world_size, timeout)
        return PrefixStore(f"/worker/attempt_{{attempt}}/", store)
'''
    return old, new


TEST = '''import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import unittest

from torch.testing._internal.common_utils import find_free_port, run_tests

WORKER = textwrap.dedent("""
    import os, signal, sys
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        stale = store.check(["written-by-an-attempt"])
        store.set("written-by-an-attempt", "1")
        if stale:
            sys.exit("the restarted attempt reads keys an earlier attempt wrote")
    t = torch.ones(1)
    dist.all_reduce(t)
    marker = os.path.join(sys.argv[1], "killed")
    if dist.get_rank() == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    dist.destroy_process_group()
""")


class TestRestartedAttemptStore(unittest.TestCase):
    def test_restarted_workers_do_not_read_the_previous_attempts_keys(self):
        with tempfile.TemporaryDirectory() as work:
            script = os.path.join(work, "worker.py")
            with open(script, "w") as f:
                f.write(WORKER)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                   f"--master-port={find_free_port()}", "--max-restarts=1", script, work]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            self.assertTrue(os.path.exists(os.path.join(work, "killed")))
            self.assertEqual(done.returncode, 0, done.stderr[-4000:])


if __name__ == "__main__":
    run_tests()
'''

_OLD_213, _NEW_213 = _branch("_torchelastic_use_agent_store()")
_OLD_215, _NEW_215 = _branch("_agent_store_serves(hostname, port)")
_IMPORT = Edit("torch/distributed/rendezvous.py", "from torch.distributed import FileStore, Store, TCPStore\n",
               "from torch.distributed import FileStore, PrefixStore, Store, TCPStore\n")
_HELPER = Edit("torch/distributed/rendezvous.py", "def _create_c10d_store(", HELPER)
_NEW_TEST = NewFile("test/distributed/elastic/test_restarted_attempt_store.py", TEST)

FIX = Fix(
    id="torch-elastic-attempt-store",
    distribution="torch",
    kind="proposal",
    upstream="pytorch main (pytorch/pytorch#135712 closed, #167288 open)",
    summary="""
        torchrun's agent hosts one TCPStore for every attempt of a job, and since the rendezvous shares it
        (TORCHELASTIC_USE_AGENT_STORE) every worker of every attempt is a client of it with no per-attempt prefix.
        A restarted attempt's init_process_group reads the addresses the dead attempt published: gloo's
        connectFullMesh gets "connection refused" from the old port, or hangs; NCCL broadcasts the old unique id.

        In the agent-store branch of _create_c10d_store, agree on an attempt number that no earlier attempt used
        (rank 0 draws it from a counter in the store, the other ranks read it under fresh random tokens) and return
        the client under a prefix of that attempt. Every group the job builds later takes its keys from the default
        group's store, so all of them, and NCCL's unique-id exchange, are covered. TORCHELASTIC_RESTART_COUNT is not
        used: it counts one agent's restarts, and nodes disagree once one agent restarted alone.
    """,
    variants=(
        Variant(since="2.13.0", edits=(_IMPORT, _HELPER, Edit("torch/distributed/rendezvous.py", _OLD_213,
                                                              _NEW_213)), new_files=(_NEW_TEST,)),
        Variant(since="2.15.0", edits=(_IMPORT, _HELPER, Edit("torch/distributed/rendezvous.py", _OLD_215,
                                                              _NEW_215)), new_files=(_NEW_TEST,)),
    ),
)
