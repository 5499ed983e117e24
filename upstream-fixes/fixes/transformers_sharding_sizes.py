"""transformers-sharding-sizes: record the TP and FSDP degrees of a model sharded at load time."""

from upstream_diffs import LICENSE_HEADER, Edit, Fix, NewFile, Variant

TEST = LICENSE_HEADER + '''\
import sys

from transformers.testing_utils import (
    TestCasePlus,
    execute_subprocess_async,
    get_torch_dist_unique_port,
    require_torch,
)


class TestShardingDegrees(TestCasePlus):
    @require_torch
    def test_model_sharded_at_load_time_records_its_degrees(self):
        checkpoint = self.get_auto_remove_tmp_dir()
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            f"--master_port={get_torch_dist_unique_port()}",
            self.test_file_path,
            checkpoint,
        ]
        execute_subprocess_async(cmd, env=self.get_env())


if __name__ == "__main__":
    # Runs on each of 2 ranks (gloo, CPU): an FSDP-sharded load must say so, as tp_size already does for TP.
    import torch.distributed as dist

    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    checkpoint = sys.argv[1]
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        config = LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2,
        )
        LlamaForCausalLM(config).save_pretrained(checkpoint)
    dist.barrier()

    model = AutoModelForCausalLM.from_pretrained(checkpoint, distributed_config=DistributedConfig(fsdp_size=2))
    assert model.fsdp_size == 2, f"fsdp_size is {model.fsdp_size}, expected 2"
    assert model.tp_size == 1, f"tp_size is {model.tp_size}, expected 1"
    unsharded = LlamaForCausalLM.from_pretrained(checkpoint)
    assert unsharded.fsdp_size is None and unsharded.tp_size is None
    dist.destroy_process_group()
'''

MIXIN = "src/transformers/distributed/mixin.py"
CLASS_DEFAULT = Edit(MIXIN, "    _tp_size = None\n", "    _tp_size = None\n    _fsdp_size = None\n")
RECORD_BOTH = Edit(MIXIN,
                   "            model._device_mesh = device_mesh\n",
                   "            model._device_mesh = device_mesh\n"
                   "            model._tp_size = distributed_config.tp_size\n"
                   "            model._fsdp_size = distributed_config.fsdp_size\n")
RECORD_FSDP = Edit(MIXIN,
                   "            model._tp_size = distributed_config.tp_size\n",
                   "            model._tp_size = distributed_config.tp_size\n"
                   "            model._fsdp_size = distributed_config.fsdp_size\n")
FSDP_SIZE_PROPERTY = Edit(
    "src/transformers/modeling_utils.py",
    "        # if None, the model didn't undergo tensor parallel sharding\n"
    "        return self._tp_size\n",
    "        # if None, the model didn't undergo tensor parallel sharding\n"
    "        return self._tp_size\n"
    "\n"
    "    @property\n"
    "    def fsdp_size(self):\n"
    "        \"\"\"\n"
    "        Returns the model's fully sharded data parallelism degree.\n"
    "        \"\"\"\n"
    "        # if None, the model didn't undergo FSDP sharding\n"
    "        return self._fsdp_size\n")
TEST_FILE = NewFile("tests/distributed/test_sharding_degrees.py", TEST)

FIX = Fix(
    id="transformers-sharding-sizes",
    distribution="transformers",
    kind="backport",
    upstream="huggingface/transformers#48208 (_tp_size) and #48204 (_fsdp_size, fsdp_size), released in 5.18.0",
    summary="""
        maybe_distribute_model records only the device mesh, so a model sharded at load time does not say how it
        was sharded: _tp_size is set only by apply_tensor_parallelism (5.15) or not at all (5.16), and no FSDP degree is
        recorded. Trainer then builds no ParallelismConfig for an FSDP model and accelerate wraps it in DDP.

        Record both degrees where the mesh is recorded and expose fsdp_size next to tp_size.
    """,
    variants=(
        Variant("5.15", edits=(CLASS_DEFAULT, RECORD_BOTH, FSDP_SIZE_PROPERTY), new_files=(TEST_FILE,)),
        # 5.16 moved apply_tensor_parallelism's arguments (other context, same change)
        Variant("5.16", edits=(CLASS_DEFAULT, RECORD_BOTH, FSDP_SIZE_PROPERTY), new_files=(TEST_FILE,)),
        # 5.17 records _tp_size already (#48208)
        Variant("5.17", edits=(CLASS_DEFAULT, RECORD_FSDP, FSDP_SIZE_PROPERTY), new_files=(TEST_FILE,)),
    ),
)
