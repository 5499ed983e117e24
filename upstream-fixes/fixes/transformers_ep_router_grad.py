"""transformers-ep-router-grad: sum the expert-parallel router's score gradient over the EP group before the
non-local mask (transformers 5.15 layout: ``RouterParallel._prepare_output_fn``)."""

from upstream_diffs import LICENSE_HEADER, Edit, Fix, NewFile

TEST = LICENSE_HEADER + '''\
import sys

from transformers.testing_utils import (
    TestCasePlus,
    execute_subprocess_async,
    get_torch_dist_unique_port,
    require_torch,
)


class TestExpertParallelRouterGradients(TestCasePlus):
    @require_torch
    def test_expert_parallel_gradients_match_single_process(self):
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
    # Runs on each of 2 ranks (gloo, CPU), 2 experts per rank, the same batch on both: every gradient (the routers',
    # and those of every layer before an MoE block) must be the single-process one.
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.distributed import DistributedConfig
    from transformers.integrations.moe import ExpertsInterface

    def looped_experts_forward(self, hidden_states, top_k_index, top_k_weights):
        # One matmul per local expert: the sentinel index of the other rank's experts matches none of them, so the
        # test checks the router's gradient, whatever the built-in kernels do with sentinel slots.
        final_hidden_states = torch.zeros_like(hidden_states)
        for expert in range(self.num_experts):
            token_idx, top_k_pos = torch.where(top_k_index == expert)
            gate, up = torch.nn.functional.linear(hidden_states[token_idx], self.gate_up_proj[expert]).chunk(2, dim=-1)
            expert_out = torch.nn.functional.linear(self.act_fn(gate) * up, self.down_proj[expert])
            final_hidden_states.index_add_(0, token_idx, expert_out * top_k_weights[token_idx, top_k_pos, None])
        return final_hidden_states

    ExpertsInterface.register("looped", looped_experts_forward)
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
    input_ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    model = AutoModelForCausalLM.from_pretrained(
        checkpoint,
        experts_implementation="looped",
        distributed_config=DistributedConfig(tp_size=2, enable_expert_parallel=True),
    )
    model(input_ids=input_ids, labels=input_ids).loss.backward()

    reference = AutoModelForCausalLM.from_pretrained(checkpoint, experts_implementation="looped")
    reference(input_ids=input_ids, labels=input_ids).loss.backward()
    reference_grads = {name: param.grad for name, param in reference.named_parameters()}

    mismatched = []
    for name, param in model.named_parameters():
        # The experts' gradients are a DTensor sharded by expert (5.16+) or a plain tensor of this rank's 2 experts
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        expected = reference_grads[name]
        if grad.shape != expected.shape:
            expected = expected[2 * rank : 2 * rank + 2]
        if not torch.allclose(grad, expected, rtol=1e-5, atol=1e-7):
            mismatched.append(name)
    assert not mismatched, f"rank {rank}: gradients differ from a single process in {mismatched}"
    dist.destroy_process_group()
'''

TENSOR_PARALLEL = "src/transformers/integrations/tensor_parallel.py"
TEST_FILE = NewFile("tests/tensor_parallel/test_expert_parallel_router_gradients.py", TEST)

FIX = Fix(
    id="transformers-ep-router-grad",
    distribution="transformers",
    kind="backport",
    upstream="huggingface/transformers#48205, released in 5.17.0",
    summary="""
        Under expert parallelism RouterParallel zeroes the routing scores of the experts a rank does not own. In
        backward each rank's score gradient therefore covers only its own experts' slots, and nothing adds the other
        ranks' slots: the router and every layer before an MoE block get partial gradients that differ between
        ranks.

        Sum the score gradient over the EP group before the mask (each slot has exactly one owning rank, so the sum
        is exact), only while autograd records, as 5.17.0 does in EpRouterParallel; this is the same change in the
        5.15 layout, with the all_reduce_backward helper of this file. The test runs one backward of a two-layer
        Qwen3-MoE over 2 expert-parallel ranks (gloo, CPU) and compares every gradient with one process on the
        same batch. Its experts run a plain loop over the local experts (registered in ExpertsInterface), so the
        test checks the router alone: grouped_mm reads the uninitialized rows that transformers-ep-grouped-mm-sentinel
        fixes, and on 5.15 the experts' routing-weight all_reduce_backward sums the NaN of those rows (and, with
        batched_mm, the gradient of the sentinel slots' wasted compute) into the owning rank's slot.
    """,
    edits=(
        Edit(TENSOR_PARALLEL,
             "        router_logits, router_scores, router_indices, *extra_outputs = outputs\n",
             "        router_logits, router_scores, router_indices, *extra_outputs = outputs\n"
             "        # Each rank's score gradient covers only its local experts' slots; sum the per-rank partials\n"
             "        # before the mask (each slot has exactly one owning rank, so the sum is exact).\n"
             "        if torch.is_grad_enabled() and router_scores.requires_grad:\n"
             "            router_scores = all_reduce_backward(router_scores, device_mesh)\n"),
    ),
    new_files=(TEST_FILE,),
)
