"""transformers-sharded-transpose-check: Transpose(check_dims=True) compares the tensor a sharded load read (this
rank's slice) with the local shard's shape too, so a slice already in the param's layout is not transposed."""

from upstream_diffs import LICENSE_HEADER, Edit, Fix, NewFile

TEST = LICENSE_HEADER + '''\
import sys

from transformers.testing_utils import (
    TestCasePlus,
    execute_subprocess_async,
    get_torch_dist_unique_port,
    require_torch,
)


class TestShardedLoadOfTransposedExperts(TestCasePlus):
    @require_torch
    def test_stacked_experts_keep_their_layout(self):
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
    # Runs on each of 2 ranks (gloo, CPU). Qwen3-VL-MoE's conversion transposes the stacked experts only where the
    # checkpoint tensor's shape is not the param's: a checkpoint saved by transformers is in the param's layout, and
    # with fsdp_size=2 each rank's slice of it must be kept as it is, as one process keeps the whole tensor.
    import torch
    import torch.distributed as dist

    from transformers import AutoModelForImageTextToText, Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration
    from transformers.distributed import DistributedConfig

    checkpoint = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        torch.manual_seed(0)
        config = Qwen3VLMoeConfig(
            text_config={
                "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 8,
                "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
                "num_experts": 4, "num_experts_per_tok": 2,
            },
            vision_config={
                "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 32,
                "num_position_embeddings": 16, "deepstack_visual_indexes": [0],
            },
        )
        Qwen3VLMoeForConditionalGeneration(config).save_pretrained(checkpoint)
    dist.barrier()

    reference = AutoModelForImageTextToText.from_pretrained(checkpoint)
    model = AutoModelForImageTextToText.from_pretrained(
        checkpoint, distributed_config=DistributedConfig(fsdp_size=2)
    )
    names = [name for name, _ in reference.named_parameters() if ".experts." in name]
    assert names, "the tiny model has no stacked experts"
    for name in names:
        got = model.get_parameter(name).full_tensor()
        assert torch.equal(got, reference.get_parameter(name)), f"rank {rank}: {name} differs from one process"
    dist.destroy_process_group()
'''

CHECK_OLD = """            # NOTE: this rely on the first param name, so cannot be used for many-to-one operation
            expected_shape = kwargs["model"].get_parameter(kwargs["full_layer_name"]).shape
            # The shapes are the same: do NOT transpose
            if tensor.shape == expected_shape:
"""
CHECK_NEW = """            # NOTE: this rely on the first param name, so cannot be used for many-to-one operation
            param = kwargs["model"].get_parameter(kwargs["full_layer_name"])
            expected_shapes = [param.shape]
            # A param sharded at load time gets this rank's slice of the checkpoint tensor, read before the
            # conversion: in the param's layout it has the local shard's shape, never the global one
            if is_dtensor(param):
                expected_shapes.append(param.to_local().shape)
            # The shapes are the same: do NOT transpose
            if tensor.shape in expected_shapes:
"""
LOADING = "src/transformers/core_model_loading.py"

FIX = Fix(
    id="transformers-sharded-transpose-check",
    distribution="transformers",
    kind="proposal",
    upstream="huggingface/transformers main (not reported upstream yet; still present in 5.25.0)",
    summary="""
        Qwen3-VL-MoE checkpoints exist with the stacked experts in two layouts, so its conversion mapping
        transposes gate_up_proj/down_proj only where the checkpoint tensor's shape is not the param's
        (Transpose(1, 2, check_dims=True)). When the model is sharded at load time (fsdp_size, ep_size),
        convert_and_load_state_dict_in_model reads each rank's slice of the checkpoint tensor before the
        conversion runs, and Transpose.convert compares that slice ([experts / 2, ...]) with the param's
        global shape: never equal, so a slice already in the param's layout (every checkpoint save_pretrained
        writes) is transposed. down_proj then mismatches and the load raises; a gate_up_proj with
        hidden_size == 2 * moe_intermediate_size is transposed without an error.

        Compare with the local shard's shape too. A slice of a checkpoint in the other layout never has the
        local shard's shape (the transposed dims are not the ones sharded, or such a tensor is read whole), so
        the layout is decided as one process decides it on the whole tensor. transformers 5.15's
        local-tensor TP layers (the EP path there) need the same with the layer's expected sharded shape
        (shardadopt's patch does both). The test saves a tiny Qwen3-VL-MoE and loads it with fsdp_size=2 (gloo,
        CPU): every expert tensor must equal one process's.
    """,
    edits=(Edit(LOADING, CHECK_OLD, CHECK_NEW),),
    new_files=(NewFile("tests/distributed/test_sharded_transpose_check.py", TEST),),
)
