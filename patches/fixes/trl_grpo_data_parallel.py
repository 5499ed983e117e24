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
    # data-parallel rank; a batch of half a group must be refused.
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
        reward_funcs=lambda completions, **kwargs: [float(len(c)) for c in completions],
        args=__TRAINER_CONFIG__(per_device_train_batch_size=4, **common),
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model_id),
    )
    states = [None, None]
    dist.all_gather_object(states, torch.get_rng_state())
    assert torch.equal(states[0], states[1]), "the tensor-parallel ranks were seeded differently"
    assert trainer.args.generation_batch_size == 4, trainer.args.generation_batch_size
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
        raise AssertionError("a per-device batch of half a group was accepted on a tensor-parallel model")
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
        # device mesh puts the model-parallel dimensions innermost), here and in the generation batch.
        parallelism_config = self.accelerator.parallelism_config
        model_parallel_size = parallelism_config.non_data_parallel_size if parallelism_config is not None else 1
        if model_parallel_size > 1:
            if self.use_vllm:
                raise ValueError(
                    "`use_vllm=True` does not support a model-parallel (tensor-parallel) model: the weight sync to "
                    "vLLM gathers parameters only through FSDP or DeepSpeed ZeRO-3. Set `use_vllm=False`."
                )
            rows = args.per_device_train_batch_size * args.steps_per_generation
            if rows % self.num_generations != 0:
                raise ValueError(
                    f"Each process's generation batch ({rows} rows) does not hold whole groups of "
                    f"num_generations={self.num_generations} completions, and the ranks of a model-parallel group "
                    "share their batch: rewards would be grouped across copies of the same rows. Make "
                    "per_device_train_batch_size * steps_per_generation a multiple of num_generations."
                )
            args.generation_batch_size //= model_parallel_size
        dp_rank = self.accelerator.process_index // model_parallel_size
        set_seed(args.seed + dp_rank)
"""


def fix(trainer: str, config: str, module: str, summary_extra: str) -> Fix:
    return Fix(
        id=f"trl-{module}-data-parallel",
        distribution="trl",
        kind="proposal",
        upstream="huggingface/trl main (not reported upstream yet; still present in 1.16.0)",
        summary=f"""
            {trainer} treats every process as a data-parallel rank: __init__ seeds process i with seed + i
            (set_seed(args.seed, device_specific=True)) and {config} sizes the generation batch by world_size. The
            ranks of a tensor-parallel group hold one model replica and get the same batch, so on 2 x 2 ranks
            (fsdp_size=2, tp_size=2) the second group samples with seed + 2 where a data-parallel run's second
            process has seed + 1, and with num_iterations > 1 or steps_per_generation > 1 the repeat sampler's
            blocks hold twice the prompts a data-parallel run's do (a prompt trained again where the data-parallel
            run moves on). Rewards are gathered over every process and grouped by num_generations consecutive rows:
            with a per-device batch of half a group (per_device_train_batch_size=2, num_generations=4 on tp_size=2)
            a group is built from the tensor-parallel ranks' copies of the same 2 completions. vLLM's weight sync
            reads parameters whole only through FSDP or DeepSpeed ZeRO-3.

            Count the ranks of a model-parallel group as one data-parallel rank: seed by data-parallel rank, divide
            the generation batch by the model-parallel size, and refuse use_vllm and generation batches that split
            groups. {summary_extra}The test loads a tp_size=2 model on 2 gloo ranks and checks both ranks leave
            __init__ with one random state and a one-rank generation batch, and that half a group is refused.
        """,
        edits=(Edit(f"trl/trainer/{module}_trainer.py", SEED, SEED_BY_DATA_PARALLEL_RANK),),
        new_files=(NewFile(f"tests/test_{module}_model_parallel.py",
                           TEST.replace("__TRAINER_CONFIG__", config).replace("__TRAINER__", trainer)),),
    )


# What shardadopt's runtime patch does beyond this change (shardadopt/online.py).
BEYOND = ("shardadopt's runtime patch also refuses advantages scaled over the whole gathered batch on such models (a "
          "standard deviation that counts the tensor-parallel copies) and keeps a generation_batch_size the user "
          "gave (steps_per_generation derived from it). ")

FIX = fix(TRAINER, CONFIG, MODULE, BEYOND)
