"""trainer-sharded-checkpoint: resumable, atomically published Trainer checkpoints for models sharded at load time."""

from upstream_diffs import LICENSE_HEADER, Edit, Fix, NewFile, Variant

TEST = LICENSE_HEADER + '''\
import sys

from transformers.testing_utils import (
    TestCasePlus,
    execute_subprocess_async,
    get_torch_dist_unique_port,
    require_torch,
)


class TestTrainerShardedCheckpoint(TestCasePlus):
    @require_torch
    def test_resume_model_sharded_at_load_time(self):
        output_dir = self.get_auto_remove_tmp_dir()
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            f"--master_port={get_torch_dist_unique_port()}",
            self.test_file_path,
            output_dir,
        ]
        execute_subprocess_async(cmd, env=self.get_env())


if __name__ == "__main__":
    # Runs on each of 2 ranks (gloo, CPU): a model sharded by `DistributedConfig(fsdp_size=2)` is checkpointed at
    # step 2 and resumed in a fresh model and Trainer, which must then train exactly as the uninterrupted run.
    import os

    import torch
    import torch.distributed as dist

    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
    from transformers.distributed import DistributedConfig
    from transformers.trainer_utils import get_last_checkpoint

    output_dir = sys.argv[1]
    model_dir = os.path.join(output_dir, "model")
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
        LlamaForCausalLM(config).save_pretrained(model_dir)
    dist.barrier()

    generator = torch.Generator().manual_seed(0)
    dataset = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (32, 8), generator=generator)]

    def train(run_dir, resume_from_checkpoint=None):
        model = AutoModelForCausalLM.from_pretrained(model_dir, distributed_config=DistributedConfig(fsdp_size=2))
        args = TrainingArguments(
            output_dir=run_dir,
            per_device_train_batch_size=2,
            max_steps=4,
            learning_rate=1e-2,
            logging_steps=1,
            save_strategy="steps",
            save_steps=2,
            use_cpu=True,
            report_to=[],
            seed=7,
            disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=args, train_dataset=dataset)
        trainer.train(resume_from_checkpoint=resume_from_checkpoint)
        losses = {log["step"]: log["loss"] for log in trainer.state.log_history if "loss" in log}
        return losses, {name: tensor.to_local() for name, tensor in trainer.model.state_dict().items()}

    run_dir = os.path.join(output_dir, "run")
    losses, weights = train(run_dir)
    assert sorted(os.listdir(run_dir)) == ["checkpoint-2", "checkpoint-4"], os.listdir(run_dir)
    assert get_last_checkpoint(run_dir) == os.path.join(run_dir, "checkpoint-4")

    resumed_losses, resumed_weights = train(
        os.path.join(output_dir, "resumed"), resume_from_checkpoint=os.path.join(run_dir, "checkpoint-2")
    )
    assert resumed_losses == losses, f"resumed {resumed_losses}, uninterrupted {losses}"
    assert resumed_weights.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(resumed_weights[name], tensor), f"{name} differs from the uninterrupted run"
    dist.destroy_process_group()
'''

TRAINER = "src/transformers/trainer.py"


def edits(sharded: str) -> tuple[Edit, ...]:
    """The change, for a release where the expression ``sharded`` says whether the Trainer's model was sharded at
    load time."""
    return (
        Edit(TRAINER,
             "SCHEDULER_NAME = \"scheduler.pt\"\n",
             "SCHEDULER_NAME = \"scheduler.pt\"\n"
             "# Models sharded at load time: every process writes its own shards with torch.distributed.checkpoint\n"
             "SHARDED_MODEL_NAME = \"pytorch_model_dcp\"\n"
             "SHARDED_OPTIMIZER_NAME = \"optimizer_dcp\"\n"),
        Edit(TRAINER,
             "        output_dir = os.path.join(run_dir, checkpoint_folder)\n"
             "        self.save_model(output_dir, _internal_call=True)\n",
             "        output_dir = checkpoint_dir = os.path.join(run_dir, checkpoint_folder)\n"
             f"        if {sharded}:\n"
             "            from torch.distributed.checkpoint import save as dcp_save\n"
             "            from torch.distributed.checkpoint.state_dict import get_model_state_dict\n"
             "\n"
             "            # Every process writes its shards into a staging folder that becomes `checkpoint_dir` once all have\n"
             "            # finished, so that an interrupted save never looks like a checkpoint to `get_last_checkpoint`.\n"
             "            output_dir = os.path.join(run_dir, f\".{checkpoint_folder}.partial\")\n"
             "            if self.args.should_save:\n"
             "                shutil.rmtree(output_dir, ignore_errors=True)  # left by an interrupted save\n"
             "                self.model.config.save_pretrained(output_dir)\n"
             "            self.accelerator.wait_for_everyone()\n"
             "            model_state = {\"model\": get_model_state_dict(self.model)}\n"
             "            dcp_save(model_state, checkpoint_id=os.path.join(output_dir, SHARDED_MODEL_NAME))\n"
             "        else:\n"
             "            self.save_model(output_dir, _internal_call=True)\n"),
        Edit(TRAINER,
             "            if os.path.exists(best_checkpoint_dir):\n"
             "                self.state.best_model_checkpoint = best_checkpoint_dir\n",
             "            # a sharded checkpoint of this step is still in its staging folder\n"
             "            staged = output_dir != checkpoint_dir and best_checkpoint_dir == checkpoint_dir\n"
             "            if os.path.exists(best_checkpoint_dir) or staged:\n"
             "                self.state.best_model_checkpoint = best_checkpoint_dir\n"),
        Edit(TRAINER,
             "            self.state.save_to_json(os.path.join(output_dir, TRAINER_STATE_NAME))\n"
             "\n"
             "        if self.args.push_to_hub:\n"
             "            self._push_from_checkpoint(output_dir)\n",
             "            self.state.save_to_json(os.path.join(output_dir, TRAINER_STATE_NAME))\n"
             "\n"
             "        if output_dir != checkpoint_dir:\n"
             "            self.accelerator.wait_for_everyone()  # every process has written its shards\n"
             "            if self.args.should_save:\n"
             "                if os.path.isdir(checkpoint_dir):  # saved before at the same step\n"
             "                    shutil.rmtree(checkpoint_dir)\n"
             "                os.rename(output_dir, checkpoint_dir)\n"
             "            self.accelerator.wait_for_everyone()\n"
             "            output_dir = checkpoint_dir\n"
             "\n"
             "        if self.args.push_to_hub:\n"
             "            self._push_from_checkpoint(output_dir)\n"),
        Edit(TRAINER,
             "        elif self.args.should_save:\n"
             "            # deepspeed.save_checkpoint above saves model/optim/sched\n",
             f"        elif {sharded}:\n"
             "            from torch.distributed.checkpoint import save as dcp_save\n"
             "            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict\n"
             "\n"
             "            optimizer_state = {\"optimizer\": get_optimizer_state_dict(self.model, self.optimizer)}\n"
             "            dcp_save(optimizer_state, checkpoint_id=os.path.join(output_dir, SHARDED_OPTIMIZER_NAME))\n"
             "        elif self.args.should_save:\n"
             "            # deepspeed.save_checkpoint above saves model/optim/sched\n"),
        Edit(TRAINER,
             "        if model is None:\n"
             "            model = self.model\n"
             "\n"
             "        config_file = os.path.join(resume_from_checkpoint, CONFIG_NAME)\n",
             "        if model is None:\n"
             "            model = self.model\n"
             "\n"
             f"        if {sharded}:\n"
             "            from torch.distributed.checkpoint import load as dcp_load\n"
             "            from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict\n"
             "\n"
             "            model_state = {\"model\": get_model_state_dict(model)}\n"
             "            dcp_load(model_state, checkpoint_id=os.path.join(resume_from_checkpoint, SHARDED_MODEL_NAME))\n"
             "            set_model_state_dict(model, model_state[\"model\"])\n"
             "            return\n"
             "\n"
             "        config_file = os.path.join(resume_from_checkpoint, CONFIG_NAME)\n"),
        Edit(TRAINER,
             "        model = self.model_wrapped if is_sagemaker_mp_enabled() else self.model\n"
             "        if self.is_deepspeed_enabled:\n",
             "        model = self.model_wrapped if is_sagemaker_mp_enabled() else self.model\n"
             f"        if {sharded}:\n"
             "            self._load_from_checkpoint(self.state.best_model_checkpoint, model)\n"
             "        elif self.is_deepspeed_enabled:\n"),
        Edit(TRAINER,
             "                    if self.is_fsdp_enabled:\n"
             "                        load_fsdp_optimizer(\n",
             f"                    if {sharded}:\n"
             "                        from torch.distributed.checkpoint import load as dcp_load\n"
             "                        from torch.distributed.checkpoint.state_dict import (\n"
             "                            get_optimizer_state_dict,\n"
             "                            set_optimizer_state_dict,\n"
             "                        )\n"
             "\n"
             "                        optimizer_state = {\"optimizer\": get_optimizer_state_dict(self.model, self.optimizer)}\n"
             "                        dcp_load(optimizer_state, checkpoint_id=os.path.join(checkpoint, SHARDED_OPTIMIZER_NAME))\n"
             "                        set_optimizer_state_dict(self.model, self.optimizer, optimizer_state[\"optimizer\"])\n"
             "                    elif self.is_fsdp_enabled:\n"
             "                        load_fsdp_optimizer(\n"),
    )


# 5.15 .. 5.18 record only the device mesh on the model
MESH_RECORDED = "getattr(self.model, \"_device_mesh\", None) is not None"
# 5.19 .. record `is_distributed_loading_by_transformers`
RECORDED = "self.is_distributed_loading_by_transformers"

REFUSAL_MESSAGE = (
    "        ):\n"
    "            raise ValueError(\n"
    "                \"Resuming is not supported for models sharded at load time (`DistributedConfig`), so their \"\n"
    "                \"optimizer state cannot be checkpointed. Pass `save_only_model=True` or `save_strategy='no'`.\"\n"
    "            )\n"
)
LIFT_MESH_REFUSAL = Edit(  # 5.18
    TRAINER,
    "        if (\n"
    "            getattr(model, \"_device_mesh\", None) is not None\n"
    "            and args.save_strategy != SaveStrategy.NO\n"
    "            and not args.save_only_model\n" + REFUSAL_MESSAGE,
    "")
LIFT_REFUSAL = Edit(  # 5.19 ..
    TRAINER,
    "        if (\n"
    "            self.is_distributed_loading_by_transformers\n"
    "            and args.save_strategy != SaveStrategy.NO\n"
    "            and not args.save_only_model\n" + REFUSAL_MESSAGE,
    "")

TEST_FILE = NewFile("tests/trainer/test_trainer_sharded_checkpoint.py", TEST)

FIX = Fix(
    id="trainer-sharded-checkpoint",
    distribution="transformers",
    kind="proposal",
    upstream="huggingface/transformers main (not reported upstream yet)",
    summary="""
        Trainer cannot checkpoint a model sharded at load time (from_pretrained(..., distributed_config=...)):
        _save_optimizer_and_scheduler saves optimizer.state_dict() on the main process only, which for DTensor
        parameters is that process's shards, so 5.18 on refuse save_strategy != "no" without save_only_model
        ("Resuming is not supported for models sharded at load time").

        For such models the checkpoint's model and optimizer state are written with torch.distributed.checkpoint
        (every process its own shards, any layout reloads through DCP resharding) and read back by
        _load_from_checkpoint, _load_optimizer_and_scheduler and _load_best_model; the refusal goes. The checkpoint
        (DCP shards, config, scheduler, scaler, RNG, trainer state) is written into a hidden staging folder that is
        renamed to checkpoint-N once every process has finished, so get_last_checkpoint and rotation never see a
        checkpoint an interrupted save left half-written.

        The test loads a tiny Llama with DistributedConfig(fsdp_size=2) on 2 gloo processes, trains 4 steps saving
        every 2, resumes a fresh model and Trainer from checkpoint-2 and checks that the losses and the final weights
        equal the uninterrupted run's exactly.

        Not in this diff (shardadopt's runtime patch does it): a completion marker with the saved layout, and a
        warning when a checkpoint is resharded on load; streaming the final save_model one parameter at a time
        (5.15 .. 5.23 gather a sharded model on the main process only); per-rank checkpoints of 5.15's
        tensor-parallel shards, which are plain tensors, not DTensors (DCP would keep one rank's copy of each); for
        an adapter run (a PeftModel), the adapter files in each checkpoint and as the final model, written on every
        process (peft gathers the sharded factors), and the frozen base weights left out of the DCP state.

        Before 5.19 the Trainer cannot train a model sharded at load time at all (accelerate DDP-wraps it:
        "aten.cat.default got mixed torch.Tensor and DTensor"), so there the test passes only together with the adoption fixes
        (shardadopt's trainer-adopt-sharded-model and accelerate-adopt-sharded-model).
    """,
    variants=(
        Variant("5.15", edits=edits(MESH_RECORDED), new_files=(TEST_FILE,)),
        # 5.18 refuses such checkpoints in __init__
        Variant("5.18", edits=(LIFT_MESH_REFUSAL, *edits(MESH_RECORDED)), new_files=(TEST_FILE,)),
        # 5.19 records is_distributed_loading_by_transformers and refuses on it
        Variant("5.19", edits=(LIFT_REFUSAL, *edits(RECORDED)), new_files=(TEST_FILE,)),
    ),
)
