"""trl-distillation-plain-tp-head: DistillationTrainer refuses a student or teacher whose LM head is a plain local
tensor-parallel shard, which its loss would read as if it held the whole vocabulary."""

from upstream_diffs import LICENSE_HEADER, Edit, Fix, NewFile

ANCHOR = """\
        if args.disable_dropout:
            disable_dropout_in_model(self.model)
"""

CHECK = """\
        # The divergence loss reads each model's `lm_head.weight` itself and gathers it only when it is a DTensor. A
        # tensor-parallel head kept as a plain local shard (transformers 5.15 and 5.16) holds part of the vocabulary:
        # every rank would compare the student and the teacher over its own slice, without an error.
        for role, lm_model in (("student", self.model), ("teacher", teacher_model)):
            head = lm_model.get_output_embeddings() if lm_model is not None else None
            if head is None or isinstance(head.weight, torch.distributed.tensor.DTensor):
                continue
            vocab_size = lm_model.config.get_text_config().vocab_size
            if head.weight.shape[0] < vocab_size:
                raise ValueError(
                    f"The {role} model's `lm_head.weight` holds {head.weight.shape[0]} of its {vocab_size} vocabulary "
                    "rows as a plain tensor (a tensor-parallel shard): the distillation loss reads it directly and "
                    "would score each rank's slice of the vocabulary. Upgrade transformers to 5.17 or newer (tensor-"
                    "parallel weights are DTensors there), or load the model without `tp_size`."
                )

""" + ANCHOR

TEST = LICENSE_HEADER + '''\
import sys

from transformers.testing_utils import execute_subprocess_async, get_torch_dist_unique_port

from .testing_utils import TrlTestCase


class TestDistillationTensorParallelHead(TrlTestCase):
    def test_plain_tensor_parallel_head_is_refused(self):
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
    # Runs on each of 2 ranks (gloo, CPU): a tp_size=2 student and teacher. Where transformers keeps the LM head as a
    # plain local shard (5.15, 5.16) the trainer must refuse it; where the head is a DTensor it must build.
    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.distributed import DistributedConfig

    from trl import DistillationConfig, DistillationTrainer

    dist.init_process_group("gloo")
    model_id = "trl-internal-testing/tiny-Qwen3ForCausalLM"

    def load():
        return AutoModelForCausalLM.from_pretrained(
            model_id, dtype=torch.float32, distributed_config=DistributedConfig(tp_size=2)
        )

    student = load()
    plain_shard = not isinstance(student.get_output_embeddings().weight, DTensor)
    tokenizer = AutoTokenizer.from_pretrained(model_id, padding_side="left")
    kwargs = dict(
        model=student,
        teacher_model=load(),
        args=DistillationConfig(output_dir=sys.argv[1], use_cpu=True, bf16=False, report_to="none"),
        train_dataset=Dataset.from_dict({"prompt": ["The sky is", "The sea is", "A cat is", "A dog is"]}),
        processing_class=tokenizer,
    )
    if plain_shard:
        try:
            DistillationTrainer(**kwargs)
        except ValueError as error:
            assert "plain tensor" in str(error), error
        else:
            raise AssertionError("a plain tensor-parallel LM head shard was accepted")
    else:
        DistillationTrainer(**kwargs)
    dist.destroy_process_group()
'''

FIX = Fix(
    id="trl-distillation-plain-tp-head",
    distribution="trl",
    kind="proposal",
    upstream="huggingface/trl main (not reported upstream yet; still present in 1.16.0)",
    summary="""
        DistillationTrainer's chunked divergence loss projects the student's and the teacher's hidden states through
        their get_output_embeddings().weight itself and gathers a weight only when it is a DTensor. transformers
        5.15 and 5.16 keep tensor-parallel shards as plain tensors, so on a tp_size load every rank compares student
        and teacher over its own slice of the vocabulary: wrong loss and gradients, no error.

        Refuse, when the trainer is built, a student or teacher whose LM head weight is a plain tensor with fewer
        rows than the vocabulary, naming the fix (transformers 5.17+, or a load without tp_size). The test loads a
        tp_size=2 student and teacher on 2 gloo ranks and checks that the trainer refuses them where the head is a
        plain shard and builds where it is a DTensor.
    """,
    edits=(Edit("trl/trainer/distillation_trainer.py", ANCHOR, CHECK),),
    new_files=(NewFile("tests/test_distillation_tensor_parallel.py", TEST),),
)
