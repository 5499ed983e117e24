"""transformers-sharded-clean-exit: a job that sharded a model while loading exits 0 on every rank when it succeeds."""

from upstream_diffs import LICENSE_HEADER, Edit, Fix, NewFile, Variant

TEST = LICENSE_HEADER + '''\
import json
import os
import sys

from transformers.testing_utils import (
    TestCasePlus,
    execute_subprocess_async,
    get_torch_dist_unique_port,
    require_torch,
)


class TestShardedLoadingCleanExit(TestCasePlus):
    @require_torch
    def test_gloo_process_groups_are_released_before_finalization(self):
        work_dir = self.get_auto_remove_tmp_dir()
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            f"--master_port={get_torch_dist_unique_port()}",
            self.test_file_path,
            work_dir,
        ]
        execute_subprocess_async(cmd, env=self.get_env())
        for rank in range(2):
            with open(os.path.join(work_dir, f"rank{rank}.json")) as report:
                state = json.load(report)
            # Groups left for finalization keep gloo worker threads that may take the GIL while the interpreter is
            # being torn down, which aborts the process (SIGABRT) after a job that succeeded.
            self.assertFalse(state["initialized"], f"rank {rank} left its process groups to interpreter finalization")


if __name__ == "__main__":
    # Runs on each of 2 ranks (gloo, CPU): a model sharded at load time, one training step, a successful exit.
    import atexit

    import torch
    import torch.distributed as dist

    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    work_dir = sys.argv[1]
    checkpoint = os.path.join(work_dir, "checkpoint")

    def record_state_at_exit():
        # Registered before the model is loaded, so it runs after anything loading registers (atexit is LIFO).
        with open(os.path.join(work_dir, f"rank{os.environ['RANK']}.json"), "w") as report:
            json.dump({"initialized": dist.is_initialized()}, report)

    atexit.register(record_state_at_exit)
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        config = LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
        LlamaForCausalLM(config).save_pretrained(checkpoint)
    dist.barrier()

    model = AutoModelForCausalLM.from_pretrained(checkpoint, distributed_config=DistributedConfig(fsdp_size=2))
    input_ids = torch.arange(16).reshape(2, 8) % 64
    model(input_ids=input_ids, labels=input_ids).loss.backward()
'''

RELEASE = '''\
def _release_gloo_process_groups() -> None:
    \"\"\"Destroy the gloo process groups at a successful exit; let their workers finish while Python is whole.

    A gloo worker drops the tensors of a collective after `wait()` returned, and dropping a tensor Python also holds
    takes the GIL. A worker that runs only once the interpreter is finalizing gets the GIL too late: CPython ends the
    thread inside a noexcept destructor and the process dies of SIGABRT ("terminate called without an active
    exception") after a job that succeeded. Destroying the groups is local (no collective); `gc.collect()` destructs,
    and so joins the workers of, groups only reference cycles still hold, while the model's FSDP states and device
    meshes hold the rest until finalization, so this then sleeps, at most 5 s, until no other thread is running.
    A failing process (uncaught exception) exits untouched, and NCCL groups are left alone: their shutdown and abort
    can wait on peers.
    \"\"\"
    # Imported here: this runs once, at exit.
    import gc
    import sys
    import threading
    import time

    if getattr(sys, "last_value", None) is not None or not torch.distributed.is_initialized():
        return

    def gloo_only(group) -> bool:
        backends = torch.distributed.get_backend_config(group).split(",")  # "gloo" or "cpu:gloo,cuda:nccl"
        return {backend.rsplit(":", 1)[-1].strip() for backend in backends} == {"gloo"}

    def other_threads_running() -> bool:
        me = str(threading.get_native_id())
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat", "rb") as stat:
                    state = stat.read().rsplit(b")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue  # the thread ended meanwhile
            # S: sleeping (an idle gloo worker waits on its queue), I: idle, Z/X: ended
            if tid != me and state not in (b"S", b"I", b"Z", b"X"):
                return True
        return False

    world = torch.distributed.group.WORLD
    groups = torch.distributed.distributed_c10d._world.pg_map
    for group in [group for group in groups if group is not world and gloo_only(group)]:
        torch.distributed.destroy_process_group(group)
    # Destroying the default group destroys every group: only when no other backend is left.
    if set(groups) == {world} and gloo_only(world):
        torch.distributed.destroy_process_group()
    gc.collect()

    deadline, quiet_samples = time.monotonic() + 5.0, 0
    while quiet_samples < 3 and time.monotonic() < deadline and os.path.isdir("/proc/self/task"):
        quiet_samples = 0 if other_threads_running() else quiet_samples + 1
        time.sleep(0.005)


_RELEASE_AT_EXIT_REGISTERED = False


def _release_process_groups_at_exit() -> None:
    \"\"\"Run `_release_gloo_process_groups` at interpreter exit (registered once per process).\"\"\"
    import atexit

    global _RELEASE_AT_EXIT_REGISTERED
    if not _RELEASE_AT_EXIT_REGISTERED:
        _RELEASE_AT_EXIT_REGISTERED = True
        atexit.register(_release_gloo_process_groups)


'''

UTILS = "src/transformers/distributed/utils.py"
# `_ensure_torch_distributed` runs once for every load that shards the model (it initializes torch.distributed where
# the user did not), in every release: the one place to arm the exit handler.
EDITS = (
    Edit(UTILS, "def _distributed_barrier(", RELEASE + "def _distributed_barrier("),
    Edit(
        UTILS,
        "    If `device_type` is not given, it is detected from the current accelerator.\n    \"\"\"\n",
        "    If `device_type` is not given, it is detected from the current accelerator.\n    \"\"\"\n"
        "    # The process groups of a model sharded at load time must not be left to interpreter finalization.\n"
        "    _release_process_groups_at_exit()\n",
    ),
)
TEST_FILE = NewFile("tests/distributed/test_sharded_loading_clean_exit.py", TEST)


def since(release: str) -> Variant:
    return Variant(release, edits=EDITS, new_files=(TEST_FILE,))


FIX = Fix(
    id="transformers-sharded-clean-exit",
    distribution="transformers",
    kind="proposal",
    upstream=("transformers main (not reported; pytorch/pytorch#179291, an atexit destroy_process_group in torch, "
              "was abandoned)"),
    summary="""
        from_pretrained(..., distributed_config=...) initializes torch.distributed where nobody did and builds device
        meshes whose process groups nothing destroys. On gloo, a worker thread drops the tensors of a completed
        collective after wait() returned, and dropping a tensor Python also holds takes the GIL. A worker that gets
        no CPU before the interpreter starts finalizing takes the GIL during finalization, CPython ends the thread
        inside a noexcept destructor and C++ calls std::terminate: "terminate called without an active exception",
        SIGABRT on one rank of a job that trained correctly, and torchrun SIGTERMs the others (gdb: runLoop ->
        ~AsyncAllreduceWork -> ~vector<Tensor> -> TensorImpl::decref_pyobject -> take_gil -> PyThread_exit_thread
        -> std::terminate, the main thread in Py_FinalizeEx). destroy_process_group alone does not prevent it:
        ProcessGroupGloo's shutdown leaves the workers running and only its destructor joins them, while the model's
        FSDP states and device meshes hold the groups until finalization.

        After a model is sharded at load time, register an exit handler that, at a successful exit (no uncaught
        exception), destroys the gloo groups (local, no collective), collects garbage and waits, the GIL released
        and at most 5 s, until no other thread of the process is running. Nothing waits for a peer; NCCL groups are
        left as they are (ProcessGroupNCCL's shutdown waits in ncclCommFinalize, and ncclCommAbort has been
        collective in some NCCL versions); a failing rank exits as before. The abort itself is a race (a few per cent
        of runs on a loaded machine), so the test checks its precondition deterministically: at finalization the
        process groups are gone.

        Left out of this diff (shardadopt has it): a public call to release the groups by hand for models sharded
        outside from_pretrained, and ignoring forked children that inherit the handler.
    """,
    variants=(
        since("5.15"),
    ),
)
