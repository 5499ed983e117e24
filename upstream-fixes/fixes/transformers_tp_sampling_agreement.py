"""transformers-tp-sampling-agreement: generate() gives the ranks of a tensor-parallel group the random state of
the group's first rank, so per-rank seeds sample the same tokens on one model replica."""

from upstream_diffs import LICENSE_HEADER, Edit, Fix, NewFile

TEST = LICENSE_HEADER + '''\
import sys

from transformers.testing_utils import (
    TestCasePlus,
    execute_subprocess_async,
    get_torch_dist_unique_port,
    require_torch,
)


class TestTensorParallelSampling(TestCasePlus):
    @require_torch
    def test_tp_ranks_sample_the_same_tokens(self):
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
    # Runs on each of 2 ranks (gloo, CPU), tp_size=2, each process seeded by its rank as training scripts (and TRL's
    # set_seed(seed, device_specific=True)) do: both ranks hold one replica and must sample the same tokens.
    import torch
    import torch.distributed as dist

    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    checkpoint = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2,
        )
        LlamaForCausalLM(config).save_pretrained(checkpoint)
    dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(checkpoint, distributed_config=DistributedConfig(tp_size=2))
    torch.manual_seed(rank)
    prompt = torch.arange(1, 13).reshape(2, 6)
    tokens = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, max_new_tokens=8)
    gathered = [None, None]
    dist.all_gather_object(gathered, tokens.tolist())
    assert gathered[0] == gathered[1], f"the tensor-parallel ranks sampled different tokens: {gathered}"
    dist.destroy_process_group()
'''

ANCHOR = "        self._validate_model_kwargs(model_kwargs.copy())\n"
AGREE = ANCHOR + '''\
        # The ranks of a tensor-parallel group hold one model replica and must sample the same tokens, but processes
        # are usually seeded per rank: give every rank of the group the random state of the group's first rank.
        distributed_config = getattr(self.config, "distributed_config", None)
        device_mesh = getattr(self, "_device_mesh", None)
        if device_mesh is not None and getattr(distributed_config, "tp_size", 1) > 1:
            tp_dim = "tp" if "tp" in (device_mesh.mesh_dim_names or ()) else device_mesh.ndim - 1
            on_accelerator = self.device.type not in ("cpu", "meta")
            device_module = torch.get_device_module(self.device) if on_accelerator else None
            rng_states = [torch.get_rng_state(), device_module.get_rng_state(self.device) if on_accelerator else None]
            dist.broadcast_object_list(
                rng_states, group_src=0, group=device_mesh.get_group(tp_dim), device=self.device if on_accelerator else None
            )
            torch.set_rng_state(rng_states[0])
            if on_accelerator:
                device_module.set_rng_state(rng_states[1], self.device)
'''

FIX = Fix(
    id="transformers-tp-sampling-agreement",
    distribution="transformers",
    kind="proposal",
    upstream="huggingface/transformers main (not reported upstream yet; still present in 5.25.0)",
    summary="""
        generate(do_sample=True) draws every token with torch.multinomial from the calling process's generator.
        Training scripts seed each process differently (TRL's GRPO and RLOO trainers call set_seed(seed,
        device_specific=True)), so the ranks of a tensor-parallel group, which hold one model replica and compute
        the same logits, sample different tokens: the next forward (and the training step after it) mixes several
        batches on one replica, with no error (TRL GRPO, tp_size=2: first-step grad norm 4.85 where one process
        gives 3.05).

        Before decoding, give every rank of the tensor-parallel group the CPU (and accelerator) random state of the
        group's first rank. Data-parallel ranks keep distinct streams (each group takes its own first rank's). The
        test seeds two tp_size=2 ranks differently (gloo, CPU) and checks they sample the same tokens.
    """,
    edits=(Edit("src/transformers/generation/utils.py", ANCHOR, AGREE),),
    new_files=(NewFile("tests/generation/test_tensor_parallel_sampling.py", TEST),),
)
