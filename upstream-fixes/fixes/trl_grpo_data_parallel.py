"""trl-grpo-data-parallel: GRPOTrainer seeds and sizes its generation batch by data-parallel rank where the ranks of
a model-parallel group (tensor parallelism) share one batch, and refuses what cannot train right there."""

from upstream_diffs import LICENSE_HEADER, Edit, Fix, NewFile

TRAINER = "GRPOTrainer"
CONFIG = "GRPOConfig"
MODULE = "grpo"

TEST = LICENSE_HEADER + '''\
import sys

from transformers.testing_utils import execute_subprocess_async, get_torch_dist_unique_port

from .testing_utils import TrlTestCase


class TestModelParallelSeeding(TrlTestCase):
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
    # Runs on each of 2 ranks (gloo, CPU): a tp_size=2 model is one replica, one data-parallel rank. Both ranks must
    # leave __init__ with the same random state (they sample one batch's completions) and a generation batch of one
    # data-parallel rank; the rewards must be gathered once per data-parallel rank (a batch-wide standard deviation
    # over 4 rows, not over the two ranks' copies: 8); half a group per generation batch must be refused.
    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.distributed import DistributedConfig

    from trl import __TRAINER_CONFIG__, __TRAINER__

    dist.init_process_group("gloo")
    model_id = "trl-internal-testing/tiny-Qwen3ForCausalLM"
    model = AutoModelForCausalLM.from_pretrained(
        model_id, dtype=torch.float32, distributed_config=DistributedConfig(tp_size=2)
    )
    dataset = Dataset.from_dict({"prompt": ["The sky is", "The sea is", "A cat is", "A dog is"]})
    common = dict(
        output_dir=sys.argv[1], num_generations=4, max_completion_length=8, use_cpu=True, bf16=False, report_to="none"
    )
    trainer = __TRAINER__(
        model=model,
        reward_funcs=lambda completions, **kwargs: [float(i) for i in range(len(completions))],
        args=__TRAINER_CONFIG__(per_device_train_batch_size=4, max_steps=1, __BATCH_STATISTICS__, **common),
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model_id),
    )
    states = [None, None]
    dist.all_gather_object(states, torch.get_rng_state())
    assert torch.equal(states[0], states[1]), "the tensor-parallel ranks were seeded differently"
    assert trainer.args.generation_batch_size == 4, trainer.args.generation_batch_size
    trainer.train()
    rewards = torch.arange(4.0)  # one group of the 4 completions of one data-parallel rank
    advantages = torch.tensor(list(trainer._logs["advantages"]))
    expected = __EXPECTED_ADVANTAGES__
    torch.testing.assert_close(advantages, expected)
    try:
        __TRAINER__(
            model=model,
            reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
            args=__TRAINER_CONFIG__(per_device_train_batch_size=2, **common),
            train_dataset=dataset,
            processing_class=AutoTokenizer.from_pretrained(model_id),
        )
    except ValueError as error:
        assert "whole groups" in str(error), error
    else:
        raise AssertionError("a generation batch of half a group was accepted on a tensor-parallel model")
    dist.destroy_process_group()
'''

SEED = """\
        # Ensure each process receives a unique seed to prevent duplicate completions when generating with
        # transformers if num_generations exceeds per_device_train_batch_size. We could skip it if we use vLLM, but
        # it's safer to set it in all cases.
        set_seed(args.seed, device_specific=True)
"""

SEED_BY_DATA_PARALLEL_RANK = """\
        # Ensure each data-parallel rank receives a unique seed to prevent duplicate completions when generating with
        # transformers if num_generations exceeds per_device_train_batch_size. We could skip it if we use vLLM, but
        # it's safer to set it in all cases. The ranks of a model-parallel group (tensor parallelism) hold one model
        # replica and get one batch: they must sample alike, so they count as one data-parallel rank (accelerate's
        # device mesh puts the model-parallel dimensions innermost), here, in the generation batch and wherever rows
        # are gathered, sliced or counted (see `_gather_data_parallel`).
        parallelism_config = self.accelerator.parallelism_config
        self.model_parallel_size = parallelism_config.non_data_parallel_size if parallelism_config is not None else 1
        self.data_parallel_size = self.accelerator.num_processes // self.model_parallel_size
        self.data_parallel_rank = self.accelerator.process_index // self.model_parallel_size
        if self.model_parallel_size > 1:
            if self.use_vllm:
                raise ValueError(
                    "`use_vllm=True` does not support a model-parallel (tensor-parallel) model: the weight sync to "
                    "vLLM gathers parameters only through FSDP or DeepSpeed ZeRO-3. Set `use_vllm=False`."
                )
            args.generation_batch_size //= self.model_parallel_size
            if args.generation_batch_size % self.num_generations != 0:
                raise ValueError(
                    f"The generation batch over the data-parallel ranks ({args.generation_batch_size} rows) does not "
                    f"hold whole groups of num_generations={self.num_generations} completions (the ranks of a "
                    "model-parallel group share their batch). Increase steps_per_generation or "
                    "per_device_train_batch_size."
                )
        set_seed(args.seed + self.data_parallel_rank)
"""

GATHER_HELPER = """\
    def _gather_data_parallel(self, tensor: torch.Tensor) -> torch.Tensor:
        # `gather` over every process, keeping one copy of each row per model replica: the ranks of a model-parallel
        # group (tensor parallelism) hold copies of the same rows, which would otherwise be grouped, counted and
        # sliced as other data-parallel ranks' rows.
        gathered = gather(tensor)
        if self.model_parallel_size == 1:
            return gathered
        return torch.cat(gathered.chunk(self.accelerator.num_processes)[:: self.model_parallel_size])

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
"""

PROCESS_SLICE = """\
        process_slice = slice(
            self.accelerator.process_index * len(prompts),
            (self.accelerator.process_index + 1) * len(prompts),
        )
"""

LENGTHS = """\
        agg_prompt_lengths = self.accelerator.gather(prompt_lengths)
        agg_completion_lengths = self.accelerator.gather(completion_lengths)
"""

# GRPO's loss types cispo/dapo/vespo normalise by the token count over the generation batch per process
GRPO_ONLY = (
    ("        num_items_in_batch = self.accelerator.gather(loss_mask.sum()).sum()\n",
     "        num_items_in_batch = self._gather_data_parallel(loss_mask.sum()).sum()\n"),
    ('            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes\n',
     '            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.data_parallel_size\n'),
)
# RLOO's KL penalty is gathered with the rewards
RLOO_ONLY = (
    ("            kl = gather(kl)  # rewards are gathered, so kl must be too\n",
     "            kl = self._gather_data_parallel(kl)  # rewards are gathered, so kl must be too\n"),
)
# The advantages the test expects of one group of rewards 0, 1, 2, 3 with the trainer's batch-wide statistics
BATCH_STATISTICS = {"grpo": ('scale_rewards="batch"', "(rewards - rewards.mean()) / (rewards.std() + 1e-4)"),
                    "rloo": ("normalize_advantages=True, beta=0.0",
                             "(lambda a: (a - a.mean()) / (a.std() + 1e-4))(rewards - (rewards.sum() - rewards) / 3)")}


def fix(trainer: str, config: str, module: str, summary_extra: str) -> Fix:
    source = f"trl/trainer/{module}_trainer.py"
    only = GRPO_ONLY if module == "grpo" else RLOO_ONLY
    statistics, expected = BATCH_STATISTICS[module]
    return Fix(
        id=f"trl-{module}-data-parallel",
        distribution="trl",
        kind="proposal",
        upstream="huggingface/trl main (not reported upstream yet; still present in 1.16.0)",
        summary=f"""
            {trainer} treats every process as a data-parallel rank: __init__ seeds process i with seed + i
            (set_seed(args.seed, device_specific=True)), {config} sizes the generation batch by world_size, and
            scoring gathers the rewards of every process and slices the advantages by process_index. The ranks of
            a tensor-parallel group hold one model replica and get the same batch, so on 2 x 2 ranks (fsdp_size=2,
            tp_size=2) the second group samples with seed + 2 where a data-parallel run's second process has
            seed + 1, with num_iterations > 1 or steps_per_generation > 1 the repeat sampler's blocks hold twice
            the prompts a data-parallel run's do, a group of num_generations that spans processes
            (per_device_train_batch_size=2, num_generations=4 on 2 x 2 ranks) is built from the tensor-parallel
            ranks' copies of the same 2 completions, and a standard deviation over the whole gathered batch
            ({statistics}) counts every row twice. vLLM's weight sync reads parameters whole only through FSDP or
            DeepSpeed ZeRO-3.

            Count the ranks of a model-parallel group as one data-parallel rank: seed by data-parallel rank, divide
            the generation batch by the model-parallel size (refusing one of partial groups, as the config check
            does under data parallelism), gather the rewards, token counts and completion lengths once per model
            replica and slice the advantages by data-parallel rank, and refuse use_vllm. {summary_extra}The test
            loads a tp_size=2 model on 2 gloo ranks and checks both ranks leave __init__ with one random state and a
            one-rank generation batch, that one step with {statistics} logs the advantages of one group of 4
            rewards (not of the two ranks' copies), and that half a group is refused.
        """,
        edits=(Edit(source, SEED, SEED_BY_DATA_PARALLEL_RANK),
               Edit(source, "    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):\n",
                    GATHER_HELPER),
               Edit(source, "        rewards_per_func = gather(rewards_per_func)\n",
                    "        rewards_per_func = self._gather_data_parallel(rewards_per_func)\n"),
               Edit(source, PROCESS_SLICE, PROCESS_SLICE.replace("self.accelerator.process_index",
                                                                 "self.data_parallel_rank")),
               Edit(source, LENGTHS, LENGTHS.replace("self.accelerator.gather", "self._gather_data_parallel")),
               Edit(source, "        agg_is_truncated = self.accelerator.gather(is_truncated)\n",
                    "        agg_is_truncated = self._gather_data_parallel(is_truncated)\n"),
               *(Edit(source, old, new) for old, new in only)),
        new_files=(NewFile(f"tests/test_{module}_model_parallel.py",
                           TEST.replace("__TRAINER_CONFIG__", config).replace("__TRAINER__", trainer)
                           .replace("__BATCH_STATISTICS__", statistics)
                           .replace("__EXPECTED_ADVANTAGES__", expected)),),
    )


# What shardadopt's runtime patch does beyond this change (shardadopt/online/trainers.py).
BEYOND = ("shardadopt's runtime patch also gathers the logged clip ratios, entropies and completion tables once per "
          "model replica, checks the evaluation batch over the data-parallel ranks, and keeps a generation_batch_size "
          "the user gave (steps_per_generation derived from it). ")

FIX = fix(TRAINER, CONFIG, MODULE, BEYOND)
