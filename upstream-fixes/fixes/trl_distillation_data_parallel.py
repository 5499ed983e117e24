"""trl-distillation-data-parallel: DistillationTrainer seeds and sizes its sampler's blocks by data-parallel rank
where the ranks of a model-parallel group (tensor parallelism) share one batch."""

from upstream_diffs import LICENSE_HEADER, Edit, Fix, NewFile

TEST = LICENSE_HEADER + '''\
import sys

from transformers.testing_utils import execute_subprocess_async, get_torch_dist_unique_port

from .testing_utils import TrlTestCase


class TestDistillationModelParallelSeeding(TrlTestCase):
    def test_tensor_parallel_ranks_seed_and_count_as_one_data_parallel_rank(self):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            f"--master_port={get_torch_dist_unique_port()}",
            __file__,
            self.tmp_dir,
        ]
        execute_subprocess_async(cmd)


if __name__ == "__main__":
    # Runs on each of 2 ranks (gloo, CPU): a tp_size=2 student is one replica, one data-parallel rank. Both ranks must
    # leave __init__ with the same random state (they sample one batch's completions), and the sampler's blocks must
    # hold one data-parallel rank's generation batch.
    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.distributed import DistributedConfig

    from trl import DistillationConfig, DistillationTrainer

    dist.init_process_group("gloo")
    model_id = "trl-internal-testing/tiny-Qwen3ForCausalLM"
    model = AutoModelForCausalLM.from_pretrained(
        model_id, dtype=torch.float32, distributed_config=DistributedConfig(tp_size=2)
    )
    teacher = AutoModelForCausalLM.from_pretrained(model_id, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_id, padding_side="left")
    dataset = Dataset.from_dict({"prompt": ["The sky is", "The sea is", "A cat is", "A dog is"] * 2})
    args = DistillationConfig(
        output_dir=sys.argv[1],
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_completion_length=8,
        use_cpu=True,
        bf16=False,
        report_to="none",
    )
    trainer = DistillationTrainer(
        model=model, teacher_model=teacher, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    states = [None, None]
    dist.all_gather_object(states, torch.get_rng_state())
    assert torch.equal(states[0], states[1]), "the tensor-parallel ranks were seeded differently"
    assert trainer._get_train_sampler().batch_size == 2 * 2, "the sampler's blocks count the tensor-parallel ranks"
    dist.destroy_process_group()
'''

SEED = """\
        # Ensure each process receives a unique seed so different processes generate different completions when
        # generating with transformers. We could skip it if we use vLLM, but it's safer to set it in all cases.
        set_seed(args.seed, device_specific=True)
"""

SEED_BY_DATA_PARALLEL_RANK = """\
        # Ensure each data-parallel rank receives a unique seed so different ranks generate different completions when
        # generating with transformers. We could skip it if we use vLLM, but it's safer to set it in all cases. The
        # ranks of a model-parallel group (tensor parallelism) hold one model replica and get one batch: they must
        # sample alike, so they count as one data-parallel rank (accelerate's device mesh puts the model-parallel
        # dimensions innermost), here and in the sampler's generation batch.
        parallelism_config = self.accelerator.parallelism_config
        self.model_parallel_size = parallelism_config.non_data_parallel_size if parallelism_config is not None else 1
        if self.model_parallel_size > 1 and args.use_vllm:
            raise ValueError(
                "`use_vllm=True` does not support a model-parallel (tensor-parallel) student: the weight sync to "
                "vLLM gathers parameters only through FSDP or DeepSpeed ZeRO-3. Set `use_vllm=False`."
            )
        self.data_parallel_size = self.accelerator.num_processes // self.model_parallel_size
        dp_rank = self.accelerator.process_index // self.model_parallel_size
        set_seed(args.seed + dp_rank)
"""

GATHER_HELPER = """\
    def _gather_data_parallel(self, tensor: torch.Tensor) -> torch.Tensor:
        # `accelerator.gather`, keeping one copy of each row per model replica: the ranks of a model-parallel group
        # (tensor parallelism) hold copies of the same rows, which would otherwise be counted as other data-parallel
        # ranks' rows.
        gathered = self.accelerator.gather(tensor)
        if self.model_parallel_size == 1:
            return gathered
        return torch.cat(gathered.chunk(self.accelerator.num_processes)[:: self.model_parallel_size])

    def _generate(self, prompts: list):
"""

LENGTHS = """\
        agg_prompt_lengths = self.accelerator.gather(prompt_lengths)
        agg_completion_lengths = self.accelerator.gather(completion_lengths)
"""
SOURCE = "trl/trainer/distillation_trainer.py"


def _blocks(indent: str) -> Edit:
    """The sampler's generation batch (in ``get_train_dataloader`` and ``_get_train_sampler``) by data-parallel
    ranks."""
    old = (f"{indent}self.args.per_device_train_batch_size\n{indent}* self.accelerator.num_processes\n"
           f"{indent}* self.args.gradient_accumulation_steps\n")
    return Edit(SOURCE, old, old.replace("self.accelerator.num_processes", "self.data_parallel_size"))


FIX = Fix(
    id="trl-distillation-data-parallel",
    distribution="trl",
    kind="proposal",
    upstream="huggingface/trl main (not reported upstream yet; still present in 1.16.0)",
    summary="""
        DistillationTrainer (on-policy: the student samples its completions) treats every process as a data-parallel
        rank: __init__ seeds process i with seed + i (set_seed(args.seed, device_specific=True)), the repeat
        sampler's blocks are sized by accelerator.num_processes, and the loss is normalised by a token count
        gathered over every process divided by the process count. The ranks of a tensor-parallel group hold one model
        replica and get the same batch, so on 2 x 2 ranks (fsdp_size=2, tp_size=2) the second group samples with
        seed + 2 where a data-parallel run's second process has seed + 1, and with gradient_accumulation_steps > 1
        a block holds the prompts of several data-parallel windows: the step after the first trains the first
        window's prompts again where a data-parallel run moves on. vLLM's weight sync reads parameters whole only
        through FSDP or DeepSpeed ZeRO-3.

        Count the ranks of a model-parallel group as one data-parallel rank: seed by data-parallel rank, size the
        sampler's blocks by data-parallel ranks, gather the token counts and completion lengths once per model
        replica (the normaliser by data-parallel ranks), and refuse use_vllm on a model-parallel student.
        shardadopt's runtime patch runs the sampler, generation and loss with the accelerator's process index,
        process count and gathers answered by data-parallel rank (the logged completion tables included). The
        test loads a tp_size=2 student on 2 gloo
        ranks and checks both ranks leave __init__ with one random state and sampler blocks of one data-parallel
        rank.
    """,
    edits=(Edit(SOURCE, SEED, SEED_BY_DATA_PARALLEL_RANK), _blocks(" " * 16), _blocks(" " * 12),
           Edit(SOURCE, "    def _generate(self, prompts: list):\n", GATHER_HELPER),
           Edit(SOURCE, LENGTHS, LENGTHS.replace("self.accelerator.gather", "self._gather_data_parallel")),
           Edit(SOURCE, "        agg_is_truncated = self.accelerator.gather(is_truncated)\n",
                "        agg_is_truncated = self._gather_data_parallel(is_truncated)\n"),
           Edit(SOURCE, "        num_items_in_batch = self.accelerator.gather(loss_mask.sum()).sum()\n",
                "        num_items_in_batch = self._gather_data_parallel(loss_mask.sum()).sum()\n"),
           Edit(SOURCE, '            num_items_in_batch = inputs["num_items_in_batch"].clamp(min=1.0) / '
                        'self.accelerator.num_processes\n',
                '            num_items_in_batch = inputs["num_items_in_batch"].clamp(min=1.0) / '
                'self.data_parallel_size\n')),
    new_files=(NewFile("tests/test_distillation_model_parallel.py", TEST),),
)
