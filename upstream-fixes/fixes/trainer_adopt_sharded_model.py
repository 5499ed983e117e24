"""trainer-adopt-sharded-model: Trainer keeps a load-time-sharded model in place and gives the optimizer its shards."""

from upstream_diffs import LICENSE_HEADER, Edit, Fix, NewFile, Variant

TEST = LICENSE_HEADER + '''\
import sys

from transformers.testing_utils import (
    TestCasePlus,
    execute_subprocess_async,
    get_torch_dist_unique_port,
    require_torch,
)


class TestTrainerShardedAtLoadTime(TestCasePlus):
    @require_torch
    def test_optimizer_gets_the_fsdp_shards_after_evaluate(self):
        work_dir = self.get_auto_remove_tmp_dir()
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            f"--master_port={get_torch_dist_unique_port()}",
            self.test_file_path,
            work_dir,
        ]
        execute_subprocess_async(cmd, env=self.get_env())


if __name__ == "__main__":
    # Runs on each of 2 ranks (gloo, CPU): `evaluate()` before `train()` on a model FSDP-sharded at load time. The
    # modules FSDP2 does not reshard after forward (the last ones) then expose their unsharded parameters; the
    # optimizer must still be built from the shards FSDP keeps, or those weights never train.
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
    from transformers.distributed import DistributedConfig

    class OptimizerCreated(Exception):
        pass

    class StopAtOptimizerCreation(Trainer):
        # Only the optimizer handed over at the start of training is under test.
        def create_optimizer(self, model=None):
            super().create_optimizer(model)
            raise OptimizerCreated()

    work_dir = sys.argv[1]
    checkpoint = os.path.join(work_dir, "checkpoint")
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        config = LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
        LlamaForCausalLM(config).save_pretrained(checkpoint)
    dist.barrier()

    model = AutoModelForCausalLM.from_pretrained(checkpoint, distributed_config=DistributedConfig(fsdp_size=2))
    input_ids = torch.arange(32).reshape(4, 8) % 64
    dataset = [{"input_ids": row, "labels": row} for row in input_ids]
    args = TrainingArguments(
        output_dir=os.path.join(work_dir, "output"),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
    )
    trainer = StopAtOptimizerCreation(model=model, args=args, train_dataset=dataset, eval_dataset=dataset)
    trainer.evaluate()
    try:
        trainer.train()
    except OptimizerCreated:
        pass
    optimized = [param for group in trainer.optimizer.param_groups for param in group["params"]]
    unsharded = [name for name, param in model.named_parameters() if not isinstance(param, DTensor)]
    assert not unsharded, f"parameters left unsharded for the optimizer: {unsharded}"
    assert {id(param) for param in optimized} == {id(param) for param in model.parameters()}
    dist.destroy_process_group()
'''

TRAINER = "src/transformers/trainer.py"

# 5.18's condition (huggingface/transformers, released in 5.18.0), for releases that move the sharded model
KEEP_IN_PLACE = Edit(
    TRAINER,
    "            or is_sagemaker_mp_enabled()\n"
    "        ):\n"
    "            self.place_model_on_device = False\n",
    "            or is_sagemaker_mp_enabled()\n"
    "            # Sharded at load time (`DistributedConfig`): the model manages its own placement, and\n"
    "            # `.to()` on FSDP2-managed (possibly CPU-offloaded) parameters raises in `_apply`.\n"
    "            or getattr(model, \"_device_mesh\", None) is not None\n"
    "        ):\n"
    "            self.place_model_on_device = False\n",
)


def reshard_before_optimizer(sharded_at_load_time: str) -> Edit:
    """5.24's change to `_prepare_for_training`, with the way this release tells a load-time-sharded model."""
    return Edit(
        TRAINER,
        "        if not delay_optimizer_creation:\n"
        "            self.create_optimizer()\n",
        "        if not delay_optimizer_creation:\n"
        f"            if self.is_fsdp_enabled or {sharded_at_load_time}:\n"
        "                from torch.distributed.fsdp import FSDPModule\n"
        "\n"
        "                # A forward before training (e.g. `evaluate`) leaves the FSDP2 modules with `reshard_after_forward=False`\n"
        "                # holding their unsharded parameters, and the optimizer must get the sharded ones\n"
        "                for module in self.model.modules():\n"
        "                    if isinstance(module, FSDPModule):\n"
        "                        module.reshard()\n"
        "            self.create_optimizer()\n",
    )


HAS_DEVICE_MESH = 'getattr(self.model, "_device_mesh", None) is not None'
TEST_FILE = NewFile("tests/trainer/test_trainer_sharded_at_load_time.py", TEST)

FIX = Fix(
    id="trainer-adopt-sharded-model",
    distribution="transformers",
    kind="backport",
    upstream=("huggingface/transformers (PRs not identified), released in 5.18.0 (Trainer keeps a model with a "
              "`_device_mesh` in place) and 5.24.0 (FSDP2 modules resharded before create_optimizer in "
              "_prepare_for_training)"),
    summary="""
        Trainer treats a model sharded at load time (from_pretrained(..., distributed_config=...)) like a plain one.
        Before 5.18, __init__ (and train() with model_init) moves it with model.to(args.device), which re-creates
        every FSDP2 shard and moves CPU-offloaded shards to the accelerator. Before 5.24, _prepare_for_training
        builds the optimizer from model.parameters() as they are: after an evaluate() before train(), the FSDP2
        modules built with reshard_after_forward=False (the final norm and the LM head) expose their unsharded
        plain parameters, so the optimizer steps copies FSDP discards and those weights never train.

        Backports both released fixes: 5.18's place_model_on_device condition (on 5.15-5.17) and 5.24's reshard of
        every FSDP2 module before create_optimizer (on 5.15-5.23; before 5.19 the model is told by its
        `_device_mesh`, as 5.18 does, from 5.19 on by is_distributed_loading_by_transformers, as 5.24 does). The
        test builds the optimizer after an evaluate() on 2 gloo ranks and checks it holds exactly the model's
        sharded parameters; the placement change only shows on an accelerator.

        Left out (shardadopt does it at runtime, not upstream): giving non-contiguous row-parallel TP shards (5.15's
        plain-tensor TP) their own storage before the optimizer is built, for torch 2.13's fused CPU AdamW. The
        accelerate side (no DDP wrap of such a model) is accelerate-adopt-sharded-model.
    """,
    variants=(
        Variant("5.15", edits=(KEEP_IN_PLACE, reshard_before_optimizer(HAS_DEVICE_MESH)), new_files=(TEST_FILE,)),
        # 5.18 keeps the model in place itself
        Variant("5.18", edits=(reshard_before_optimizer(HAS_DEVICE_MESH),), new_files=(TEST_FILE,)),
        # 5.19 tells such models by is_distributed_loading_by_transformers
        Variant("5.19", edits=(reshard_before_optimizer("self.is_distributed_loading_by_transformers"),),
                new_files=(TEST_FILE,)),
    ),
)
