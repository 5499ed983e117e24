"""transformers-ep-grouped-mm-sentinel: mask the sentinel-tail rows of each grouped GEMM output under expert
parallelism."""

from upstream_diffs import LICENSE_HEADER, Edit, Fix, NewFile

TEST = LICENSE_HEADER + '''\
import sys

from transformers.testing_utils import (
    TestCasePlus,
    execute_subprocess_async,
    get_torch_dist_unique_port,
    require_torch,
)


class TestExpertParallelGroupedMmSentinel(TestCasePlus):
    @require_torch
    def test_grouped_mm_expert_parallel_gradients_are_finite(self):
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
    # Runs on each of 2 ranks (gloo, CPU), 2 experts per rank. The slots routed to the other rank's experts are
    # sentinels that `grouped_mm` skips, leaving those rows of its output uninitialized. Deterministic algorithms
    # make torch fill uninitialized memory with NaN (`torch.utils.deterministic.fill_uninitialized_memory`), so
    # those rows are NaN on every run, as they can be on any run on GPU.
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.distributed import DistributedConfig

    torch.use_deterministic_algorithms(True)
    checkpoint = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        torch.manual_seed(0)
        config = Qwen3MoeConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        )
        Qwen3MoeForCausalLM(config).save_pretrained(checkpoint)
    dist.barrier()
    input_ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    model = AutoModelForCausalLM.from_pretrained(
        checkpoint,
        experts_implementation="grouped_mm",
        distributed_config=DistributedConfig(tp_size=2, enable_expert_parallel=True),
    )
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()

    # Reference: the same batch in one process, without expert parallelism (no sentinel slots)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, experts_implementation="grouped_mm")
    reference_loss = reference(input_ids=input_ids, labels=input_ids).loss
    reference_loss.backward()
    reference_grads = {name: param.grad for name, param in reference.named_parameters()}

    torch.testing.assert_close(loss, reference_loss)
    # The experts' gradients are a DTensor sharded by expert (5.16+) or a plain tensor of this rank's 2 experts
    grads = {
        name: param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        for name, param in model.named_parameters()
    }
    non_finite = [name for name, grad in grads.items() if not torch.isfinite(grad).all()]
    assert not non_finite, f"rank {rank}: non-finite gradients in {non_finite}"
    # The experts of the only MoE layer get their gradient from the loss alone, not through the router.
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"):
        expected = reference_grads[name]
        if grads[name].shape != expected.shape:
            expected = expected[2 * rank : 2 * rank + 2]
        torch.testing.assert_close(grads[name], expected, msg=f"rank {rank}: {name}")
    dist.destroy_process_group()
'''

MOE = "src/transformers/integrations/moe.py"

FIX = Fix(
    id="transformers-ep-grouped-mm-sentinel",
    distribution="transformers",
    kind="backport",
    upstream="huggingface/transformers#48205, released in 5.17.0",
    summary="""
        Under expert parallelism the slots routed to another rank's experts are sentinels, sorted to the tail
        beyond offsets[-1]. grouped_mm skips those rows and leaves them uninitialized in its output and in its
        backward d_input. grouped_mm_experts_forward masks only the GEMM input and the weighted output, so the
        routing-weight gradient at a sentinel slot is 0 * (uninitialized row), NaN whenever that memory holds NaN or
        Inf: on GPU, now and then on CPU, and on every run with torch.use_deterministic_algorithms(True) (which
        fills uninitialized memory with NaN). The NaN reaches the router and everything before it.

        Mask the output of each grouped GEMM instead of the weighted output, as 5.17.0 does. The test trains one
        step of a one-layer Qwen3-MoE over 2 expert-parallel ranks (gloo, CPU) with deterministic algorithms on, so
        the skipped rows are NaN on every run, and checks that the loss matches one process, that every gradient is
        finite and that the experts' gradients match one process. The router and the layers before it still get
        partial gradients under expert parallelism on these releases (transformers-ep-router-grad), so the test
        does not compare them.
    """,
    edits=(
        Edit(MOE,
             "        selected_hidden_states_g, selected_weights, offsets, bias=selected_biases,"
             " is_transposed=self.is_transposed\n"
             "    )  # (S, 2 * intermediate_dim) or  (S, intermediate_dim) depending on whether we have gating\n"
             "\n",
             "        selected_hidden_states_g, selected_weights, offsets, bias=selected_biases,"
             " is_transposed=self.is_transposed\n"
             "    )  # (S, 2 * intermediate_dim) or  (S, intermediate_dim) depending on whether we have gating\n"
             "\n"
             "    # Zero the sentinel-tail rows the kernel left uninitialized (fwd output and bwd `d_input`).\n"
             "    proj_out = proj_out.masked_fill(sentinel_mask, 0.0)\n"
             "\n"),
        Edit(MOE,
             "        proj_out, selected_weights, offsets, bias=selected_biases, is_transposed=self.is_transposed\n"
             "    )  # (S, hidden_dim)\n"
             "\n"
             "    # Apply routing weights\n"
             "    weighted_out = proj_out * sample_weights_g.unsqueeze(-1)  # (S, hidden_dim)\n"
             "\n"
             "    # Post-mask (fwd path).\n"
             "    weighted_out.masked_fill_(sentinel_mask, 0.0)\n"
             "\n",
             "        proj_out, selected_weights, offsets, bias=selected_biases, is_transposed=self.is_transposed\n"
             "    )  # (S, hidden_dim)\n"
             "\n"
             "    # Same: zero the uninitialized sentinel-tail rows.\n"
             "    proj_out = proj_out.masked_fill(sentinel_mask, 0.0)\n"
             "\n"
             "    # Apply routing weights\n"
             "    weighted_out = proj_out * sample_weights_g.unsqueeze(-1)  # (S, hidden_dim)\n"
             "\n"),
    ),
    new_files=(NewFile("tests/tensor_parallel/test_expert_parallel_grouped_mm_sentinel.py", TEST),),
)
