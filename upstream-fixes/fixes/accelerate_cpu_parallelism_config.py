"""accelerate-cpu-parallelism-config: accept ParallelismConfig on CPU processes (DistributedType.MULTI_CPU, gloo)."""

from upstream_diffs import LICENSE_HEADER, Edit, Fix, NewFile

TEST = LICENSE_HEADER + '''\
import sys
import unittest

from accelerate.test_utils import execute_subprocess_async, get_torch_dist_unique_port
from accelerate.utils import patch_environment


class ParallelismConfigOnCpuTester(unittest.TestCase):
    def test_tensor_parallel_config_on_two_cpu_processes(self):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            f"--master_port={get_torch_dist_unique_port()}",
            __file__,
        ]
        with patch_environment(omp_num_threads=1):
            execute_subprocess_async(cmd)


if __name__ == "__main__":
    # Runs on each of 2 CPU processes (gloo): a ParallelismConfig must be accepted, its mesh built on CPU, and the
    # two processes of the tensor parallel group must get the same batches.
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    accelerator = Accelerator(cpu=True, parallelism_config=ParallelismConfig(tp_size=2))
    assert accelerator.distributed_type == DistributedType.MULTI_CPU, accelerator.distributed_type
    assert accelerator.torch_device_mesh["tp"].size() == 2
    assert accelerator.tensor_parallel_rank == accelerator.process_index

    loader = accelerator.prepare(DataLoader(torch.arange(12.0), batch_size=3))
    batches = [batch.tolist() for batch in loader]
    everyone = [None] * accelerator.num_processes
    dist.all_gather_object(everyone, batches)
    assert everyone[0] == everyone[1], f"tensor parallel ranks got different batches: {everyone}"
    assert sum(everyone[0], []) == torch.arange(12.0).tolist(), everyone[0]

    # dp_shard_size asks for FSDP, which CPU processes cannot get from prepare: a whole model must not be DDP-wrapped
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, parallelism_config=ParallelismConfig(dp_shard_size=2))
    try:
        accelerator.prepare(torch.nn.Linear(4, 4))
    except ValueError as exc:
        assert "dp_shard_size=2" in str(exc), exc
    else:
        raise AssertionError("a whole model was prepared for dp_shard_size=2 on CPU processes")
    accelerator.end_training()  # destroys the process group
'''

FIX = Fix(
    id="accelerate-cpu-parallelism-config",
    distribution="accelerate",
    kind="proposal",
    upstream="huggingface/accelerate main (no upstream issue yet)",
    summary="""
        ParallelismConfig._validate_accelerator refuses DistributedType.MULTI_CPU, because Accelerator.multi_device
        lists only the MULTI_<accelerator> types. Tensor parallelism, HSDP and 2-D layouts therefore cannot run on CPU
        processes (gloo), not even the ParallelismConfig that transformers' Trainer builds for a model loaded with
        DistributedConfig(tp_size=...). Nothing downstream needs an accelerator: the device mesh is built for
        accelerator.device.type ("cpu" gives gloo groups), the dataloader split reads the mesh, and prepare_model keys
        its TP branch on parallelism_config.tp_enabled.

        Accept MULTI_CPU in this one check. multi_device keeps its meaning for its other readers (the DDP device_ids,
        join_uneven_inputs, load_state's map_location), which are device specific. What the check kept out must
        not pass silently now: prepare_model's MULTI_CPU branch DDP-wraps every model, so a ParallelismConfig with
        dp_shard_size > 1 (FSDP, which prepare gives only through the FSDP plugin, not on CPU processes) would train
        full replicas on every rank. It is refused there, naming the fix (shard the model while loading it). The
        test runs a tp_size=2 ParallelismConfig on two CPU processes and checks that both ranks of the TP group get
        the same batches, then that a whole model is refused under dp_shard_size=2.
    """,
    edits=(
        Edit("src/accelerate/parallelism_config.py",
             "            or accelerator.distributed_type == DistributedType.DEEPSPEED\n"
             "        ):\n",
             "            or accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MULTI_CPU)\n"
             "        ):\n"),
        Edit("src/accelerate/accelerator.py",
             "            elif self.distributed_type == DistributedType.MULTI_CPU:\n"
             "                kwargs = self.ddp_handler.to_kwargs() if self.ddp_handler else {}\n",
             "            elif self.distributed_type == DistributedType.MULTI_CPU:\n"
             "                if self.parallelism_config is not None and self.parallelism_config.dp_shard_enabled:\n"
             "                    size = self.parallelism_config.dp_shard_size\n"
             "                    raise ValueError(\n"
             "                        f\"ParallelismConfig(dp_shard_size={size}) asks for a model sharded over {size} \"\n"
             "                        \"processes, but on CPU processes `prepare` can only wrap it in DDP (a full replica \"\n"
             "                        \"on every process). Shard the model while loading it instead, e.g. transformers' \"\n"
             "                        f\"`from_pretrained(..., distributed_config=DistributedConfig(fsdp_size={size}))`.\"\n"
             "                    )\n"
             "                kwargs = self.ddp_handler.to_kwargs() if self.ddp_handler else {}\n"),
    ),
    new_files=(NewFile("tests/test_parallelism_config_cpu.py", TEST),),
)
