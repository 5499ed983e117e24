"""A rank that dies for good, with ``torchrun --max-restarts 1`` (torchrun's default, static rendezvous: one agent
store for every attempt): the job comes back by itself and ends where the uninterrupted run ends.

Each case runs ``shardadopt/testing/torchrun_worker.py`` on 2 ranks with a tiny Qwen3 (a Qwen3-MoE on ep, its
experts over the ranks; the accelerate loop: save_state every step, resume from ``shardadopt.checkpoint.latest``;
the Trainer: a checkpoint every step, ``train(resume_from_checkpoint=True)``), once uninterrupted and once with rank
1 SIGKILLing itself in step 3's backward: the restarted attempt must resume from step 2, see no key the dead attempt
wrote in its process groups' store (without the torch-elastic-attempt-store patch it does, when it gets that far:
gloo connects to the dead attempt's ports), and end with the same losses and final parameters. One more job per
layout kills a rank once per attempt at every other point of a step (fsdp: forward, the first step after a resume,
inside ``save_state``, the optimizer step, inside the checkpoint's publication; tp: the last three): each attempt
resumes from the newest complete checkpoint (a killed save is never published). The attempt handshake itself is
checked against stale keys of earlier attempts in one process.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardadopt.testing
from shardadopt.lifecycle import restarts
from shardadopt.selftest import checkpoint as scenario

pytestmark = pytest.mark.multiproc

WORKER = Path(shardadopt.testing.__file__).with_name("torchrun_worker.py")
TIMEOUT = 900  # seconds for one torchrun job, both attempts (about a minute each on 2 idle cores)
_REFERENCES: dict[tuple[str, str], dict] = {}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun(model: str, loop: str, layout: str, work: Path, kill: str, max_restarts: int) -> dict:
    """Run the worker under torchrun (its defaults but a free master port); rank 0's step records and parameters."""
    work.mkdir(parents=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(_free_port()), "--max-restarts", str(max_restarts), str(WORKER), "--model", model,
               "--loop", loop, "--layout", layout, "--work", str(work), "--kill", kill]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, start_new_session=True)
    assert done.returncode == 0, f"torchrun exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    steps = [json.loads(line) for line in (work / "steps.jsonl").read_text().splitlines()]
    killed = work / "killed"
    kills = [json.loads(line) for line in killed.read_text().splitlines()] if killed.exists() else []
    return {"steps": steps, "params": torch.load(work / "final.pt"), "kills": kills}


def _reference(model: str, loop: str, layout: str, root: Path) -> dict:
    if (loop, layout) not in _REFERENCES:
        _REFERENCES[loop, layout] = _torchrun(model, loop, layout, root / f"reference-{loop}-{layout}", "none", 0)
    return _REFERENCES[loop, layout]


# the kill inside save_state, and at every other point of a step: test_a_rank_killed_at_every_point_of_a_step_...
CASES = [("accelerate", "fsdp", "backward"), ("accelerate", "tp", "backward"), ("accelerate", "ep", "backward"),
         ("trainer", "fsdp", "backward")]
# ep: a MoE's experts over the ranks with ep_size=2 (and fsdp_size=2); older transformers lay EP out on the TP mesh,
# which the accelerate checkpoint does not cover (tests/checkpoint/test_checkpoint_integrations.py neither)
EP_SIZE = "ep_size" in scenario.LAYOUTS["ep"][1]


@pytest.mark.parametrize("loop,layout,kill", CASES, ids=["-".join(case) for case in CASES])
def test_a_killed_rank_restarts_and_ends_as_the_uninterrupted_run(tiny_models, tmp_path_factory, loop, layout,
                                                                  kill):
    if layout == "ep" and not EP_SIZE:
        pytest.skip("this transformers has no DistributedConfig(ep_size=...): EP rides on the TP mesh")
    root = tmp_path_factory.mktemp(f"restart-{loop}-{layout}-{kill}")
    model = tiny_models["qwen3moe" if layout == "ep" else "qwen3"]
    expected = _reference(model, loop, layout, root)
    result = _torchrun(model, loop, layout, root / "job", kill, 1)
    assert [k["point"] for k in result["kills"]] == [kill], "rank 1 did not kill itself"
    first = [s for s in result["steps"] if s["resumed_at"] == 0]
    resumed = [s for s in result["steps"] if s["resumed_at"] != 0]
    assert [s["step"] for s in first] == [1, 2], "the first attempt did not die in step 3"
    # step 3's checkpoint is incomplete in both cases (its save never began, or was killed): step 2 resumes
    assert {s["resumed_at"] for s in resumed} == {2} and [s["step"] for s in resumed] == [3, 4]
    _assert_as_uninterrupted(result, expected)


def _assert_as_uninterrupted(result: dict, expected: dict) -> None:
    assert not [s for s in result["steps"] if s["stale_key"]], "a restarted attempt read a dead attempt's keys"
    assert [s["step"] for s in result["steps"]] == [s["step"] for s in expected["steps"]]
    assert [s["loss"] for s in result["steps"]] == [s["loss"] for s in expected["steps"]]
    assert result["params"].keys() == expected["params"].keys()
    differ = [name for name, value in result["params"].items() if not torch.equal(value, expected["params"][name])]
    assert not differ, f"final parameters differ from the uninterrupted run: {differ}"


# One job per layout, one kill per attempt; "forward@2" is step 2's forward, "backward@first" the backward of the
# first step after this attempt's resume, "save" inside save_state (rank 1, DCP writing), "publish" inside the save's
# publication (rank 0: the completion marker written in the staging directory, the rename into place not done). Each
# kill: (point, step, the step the dying attempt had resumed at); each next attempt resumes at the newest complete
# checkpoint, the step before the kill's (a killed save or publication leaves no checkpoint). tp repeats the points
# whose state differs there (the DTensor save, optimizer state and publication); forward and backward are tp's own
# backward case above.
EVERY_POINT = {
    "fsdp": ("forward@2,backward@first,save@2,optimizer@3,publish@4",
             [("forward", 2, 0), ("backward", 2, 1), ("save", 2, 1), ("optimizer", 3, 1), ("publish", 4, 2)],
             {0: 0, 3: 1, 4: 2, 5: 3}),  # attempts 1 and 2 die before recording a step
    "tp": ("save@2,optimizer@3,publish@4", [("save", 2, 0), ("optimizer", 3, 1), ("publish", 4, 2)],
           {0: 0, 1: 1, 2: 2, 3: 3}),
}


@pytest.mark.parametrize("layout", sorted(EVERY_POINT))
def test_a_rank_killed_at_every_point_of_a_step_resumes_each_time_and_ends_as_uninterrupted(tiny_models,
                                                                                          tmp_path_factory, layout):
    kill, kills, resumed_at = EVERY_POINT[layout]
    root = tmp_path_factory.mktemp(f"every-point-{layout}")
    expected = _reference(tiny_models["qwen3"], "accelerate", layout, root)
    result = _torchrun(tiny_models["qwen3"], "accelerate", layout, root / "job", kill, len(kills))
    assert [(k["point"], k["step"], k["resumed_at"]) for k in result["kills"]] == kills
    resumed = {s["attempt"]: s["resumed_at"] for s in result["steps"]}
    assert resumed == resumed_at, resumed
    _assert_as_uninterrupted(result, expected)


TWO_NODE_WORKER = """
import json, os, signal, sys
import shardadopt
shardadopt.enable()
import torch, torch.distributed as dist
from shardadopt.lifecycle import restarts

dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
marker = os.path.join(sys.argv[1], "killed")
if dist.get_rank() == 1 and not os.path.exists(marker):
    open(marker, "w").close()
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as out:
    json.dump({"restart_count": os.environ["TORCHELASTIC_RESTART_COUNT"], "attempt": restarts.attempt_tag(),
               "total": total.item()}, out)
dist.destroy_process_group()
"""


def test_two_nodes_agree_on_the_attempt_their_restart_counts_may_disagree_on(tmp_path):
    """Two torchrun agents (``--nnodes 2 --rdzv-backend c10d``, one rank each), the rank of node 1 killed: node 1's
    agent counts a restart, node 0's may only follow the new round; both ranks must take the same attempt's keys."""
    script = tmp_path / "worker.py"
    script.write_text(TWO_NODE_WORKER)
    endpoint = f"127.0.0.1:{_free_port()}"
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
                                "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "two-nodes",
                                "--max-restarts", "1", str(script), str(tmp_path)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
              for _ in range(2)]
    outputs = [agent.communicate(timeout=TIMEOUT)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(out[-4000:] for out in outputs)
    assert (tmp_path / "killed").exists()
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    # the agents' restart counts may differ (node 0's agent may only follow the new round): the attempt may not
    assert ranks[0]["attempt"] == ranks[1]["attempt"] and ranks[0]["total"] == ranks[1]["total"] == 3.0, ranks


def _attempt(store: dist.Store, world: int) -> list[int]:
    """Every rank of one attempt agreeing on its number, each rank a thread with its own view of ``store``."""
    agreed = [0] * world

    def rank(r: int) -> None:
        agreed[r] = restarts.agree_on_attempt(store, r, world, timedelta(seconds=60))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return agreed


def test_each_attempt_agrees_on_a_number_no_earlier_attempt_used():
    """Stale questions and answers of earlier attempts (one that died mid-handshake included) are never taken."""
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=60))
    first = _attempt(store, 4)
    assert len(set(first)) == 1
    store.set(f"{restarts.NAMESPACE}/ask/2", "a-question-whose-rank-died")  # an attempt that died mid-handshake
    store.add(f"{restarts.NAMESPACE}/counter", 1)
    second = _attempt(store, 4)
    assert len(set(second)) == 1 and second[0] > first[0] + 1
    # the job's id: drawn by the first to ask, the same for every later question (any rank, any attempt)
    assert len({restarts.job_id(store) for _ in range(3)}) == 1
    assert restarts.job_id(dist.HashStore()) != restarts.job_id(store)  # another job's store: another id
