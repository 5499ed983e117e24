"""transformers-ep-expert-grad-scale: FSDP over the dispatched experts does not divide their gradients twice when
the ``efsdp`` mesh has one rank."""

from upstream_diffs import LICENSE_HEADER, Edit, Fix, NewFile, Variant

TEST = LICENSE_HEADER + '''\
import sys

from transformers.testing_utils import (
    TestCasePlus,
    execute_subprocess_async,
    get_torch_dist_unique_port,
    require_torch,
)


class TestExpertParallelFsdpGradients(TestCasePlus):
    @require_torch
    def test_single_rank_efsdp_expert_gradients_match_single_process(self):
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
    # Runs on each of 2 ranks (gloo, CPU): ep_size == fsdp_size == 2, so each expert lives whole on one rank
    # (efsdp_size == 1) and every gradient must be the single-process one for the global batch.
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.distributed import DistributedConfig

    checkpoint = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        torch.manual_seed(0)
        config = Qwen3MoeConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        )
        Qwen3MoeForCausalLM(config).save_pretrained(checkpoint)
    dist.barrier()
    input_ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))

    distributed_config = DistributedConfig(ep_size=2, fsdp_size=2)
    assert distributed_config.efsdp_size == 1
    model = AutoModelForCausalLM.from_pretrained(checkpoint, distributed_config=distributed_config)
    local_ids = input_ids.chunk(2)[rank]  # FSDP: each rank trains on its half of the batch
    model(input_ids=local_ids, labels=local_ids).loss.backward()

    reference = AutoModelForCausalLM.from_pretrained(checkpoint)
    reference(input_ids=input_ids, labels=input_ids).loss.backward()
    reference_grads = {name: param.grad for name, param in reference.named_parameters()}

    mismatched = []
    for name, param in model.named_parameters():
        # FSDP shards every parameter and EP the experts: gather each gradient whole
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        if not torch.allclose(grad, reference_grads[name], rtol=1e-5, atol=1e-7):
            mismatched.append(name)
    assert not mismatched, f"rank {rank}: gradients differ from a single process in {mismatched}"
    dist.destroy_process_group()
'''

FSDP = "src/transformers/distributed/fsdp.py"
TEST_FILE = NewFile("tests/fsdp/test_expert_parallel_fsdp_gradients.py", TEST)

FIX = Fix(
    id="transformers-ep-expert-grad-scale",
    distribution="transformers",
    kind="backport",
    upstream=("huggingface/transformers (PR not identified; found by diffing the 5.22.2 and 5.23.0 wheels), "
              "released in 5.23.0 (distributed/fsdp.py)"),
    summary="""
        apply_fully_sharded_data_parallelism shards the dispatched experts over the efsdp mesh with
        set_gradient_divide_factor(fsdp_size) and set_force_sum_reduction_for_comms(True) (5.19 forces the sum on
        non-NCCL backends only). When ep_size == fsdp_size (times tp_size) the efsdp mesh has one rank: FSDP2 does
        no reduce-scatter, its single-rank copy already divides by the factor, and the forced sum divides by it
        again, so every expert gradient is 1 / fsdp_size of the right value (0.5x on 2 ranks).

        Force the sum only when efsdp_size > 1, as 5.23.0 does (5.23.0 also divides by dp_size for HSDP, which
        is part of its HSDP support and not backported). The test runs one backward of a two-layer Qwen3-MoE with
        ep_size=2, fsdp_size=2 on 2 ranks (gloo, CPU), each rank on half of the batch, and compares every gradient,
        the experts' included, with one process on the whole batch.

        5.19.0 refuses ep_size != tp_size in prepare_distribute_model, so there efsdp_size == fsdp_size, and a
        one-rank efsdp mesh comes with a divide factor of 1: the double division cannot be reached, and the test
        stops at that refusal. The 5.19 variant applies the same guard for consistency; the test checks 5.20.2 on.
    """,
    variants=(
        # 5.19 forces the sum on non-NCCL backends only
        Variant("5.19", edits=(
            Edit(FSDP,
                 "                if torch.distributed.get_backend(expert_mesh.get_group()) != \"nccl\":\n"
                 "                    # Non-NCCL backends need to sum first, then apply the division otherwise it"
                 " runtime error.\n",
                 "                backend = torch.distributed.get_backend(expert_mesh.get_group())\n"
                 "                # No reduce-scatter if efsdp_size == 1: FSDP2 already divides, so a forced sum would"
                 " divide twice.\n"
                 "                if distributed_config.efsdp_size > 1 and backend != \"nccl\":\n"
                 "                    # Non-NCCL backends need to sum first, then apply the division otherwise it"
                 " runtime error.\n"),
        ), new_files=(TEST_FILE,)),
        # 5.20.2 forces it on every backend (5.20.0 and 5.20.1 as 5.19 did); 5.23.0's change, line for line
        Variant("5.20.2", edits=(
            Edit(FSDP,
                 "                # reject and NCCL zeroes in bfloat16 up to torch 2.13 (pytorch/pytorch#190747): sum,"
                 " divide locally.\n"
                 "                module.set_force_sum_reduction_for_comms(True)\n",
                 "                # reject and NCCL zeroes in bfloat16 up to torch 2.13 (pytorch/pytorch#190747): sum,"
                 " divide locally.\n"
                 "                if distributed_config.efsdp_size > 1:\n"
                 "                    # No reduce-scatter if efsdp_size == 1: FSDP2 already divides, so a forced sum"
                 " would divide twice.\n"
                 "                    module.set_force_sum_reduction_for_comms(True)\n"),
        ), new_files=(TEST_FILE,)),
    ),
)
