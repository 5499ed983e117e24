"""trainer-model-init-parallelism: the accelerator is rebuilt for a tensor-parallel model that model_init built."""

from upstream_diffs import LICENSE_HEADER, Edit, Fix, NewFile

TEST = LICENSE_HEADER + '''\
import json
import os
import sys

from transformers.testing_utils import (
    TestCasePlus,
    execute_subprocess_async,
    get_torch_dist_unique_port,
    require_torch_multi_accelerator,
)


class TestTrainerModelInitTensorParallel(TestCasePlus):
    @require_torch_multi_accelerator
    def test_model_init_trains_like_model(self):
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
        with open(os.path.join(work_dir, "logs.json")) as logs:
            logs = json.load(logs)
        # The same tensor-parallel model passed as model= and built by model_init trains the same steps.
        self.assertEqual(len(logs["model_init"]), 3)
        for got, want in zip(logs["model_init"], logs["model"]):
            self.assertAlmostEqual(got["loss"], want["loss"], places=5)
            self.assertAlmostEqual(got["grad_norm"], want["grad_norm"], places=4)


if __name__ == "__main__":
    # Runs on each of 2 ranks (one accelerator each): a tiny Qwen3 loaded with tp_size=2, trained once passed as model= and once
    # built by model_init, on the same data; both ranks of the TP group must see the same batches either way.
    import torch
    import torch.distributed as dist

    from accelerate.state import AcceleratorState
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM, Trainer, TrainingArguments
    from transformers.distributed import DistributedConfig

    work_dir = sys.argv[1]
    dist.init_process_group()
    checkpoint = os.path.join(work_dir, "checkpoint")
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        config = Qwen3Config(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8,
        )
        Qwen3ForCausalLM(config).save_pretrained(checkpoint)
    dist.barrier()

    def load():
        return AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=torch.float32, distributed_config=DistributedConfig(tp_size=2)
        )

    input_ids = torch.randint(0, 64, (24, 16), generator=torch.Generator().manual_seed(0))
    dataset = [{"input_ids": row, "labels": row} for row in input_ids]
    logs = {}
    for name in ("model", "model_init"):
        # Each Trainer starts from a fresh accelerate state, as a new job would.
        AcceleratorState._reset_state()
        args = TrainingArguments(
            output_dir=os.path.join(work_dir, name),
            per_device_train_batch_size=4,
            max_steps=3,
            learning_rate=1e-2,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            seed=0,
        )
        model_kwargs = {"model": load()} if name == "model" else {"model_init": load}
        trainer = Trainer(args=args, train_dataset=dataset, **model_kwargs)
        trainer.train()
        logs[name] = [
            {"loss": row["loss"], "grad_norm": float(row["grad_norm"])}
            for row in trainer.state.log_history
            if "grad_norm" in row
        ]
    if dist.get_rank() == 0:
        with open(os.path.join(work_dir, "logs.json"), "w") as out:
            json.dump(logs, out)
    dist.destroy_process_group()
'''

CALL_MODEL_INIT_OLD = '''\
        if model is None:
            raise RuntimeError("model_init should not return None.")

        return model
'''
CALL_MODEL_INIT_NEW = '''\
        if model is None:
            raise RuntimeError("model_init should not return None.")

        # The accelerator was built before model_init produced a model (no ParallelismConfig), and accelerate keeps its
        # first state for every later Accelerator: rebuild both for a tensor-parallel model, or each TP rank trains on
        # a batch of its own.
        model_tp_size = getattr(model, "tp_size", None) or 1
        parallelism_config = self.accelerator.parallelism_config
        if model_tp_size > 1 and (parallelism_config is None or parallelism_config.tp_size != model_tp_size):
            AcceleratorState._reset_state()
            self.model = model
            self.create_accelerator_and_postprocess()

        return model
'''

FIX = Fix(
    id="trainer-model-init-parallelism",
    distribution="transformers",
    kind="proposal",
    upstream="huggingface/transformers main (not reported upstream yet; still present in 5.24.0)",
    summary="""
        Trainer.__init__ builds its accelerator before model_init has produced a model, and
        create_accelerator_and_postprocess derives ParallelismConfig(tp_size, dp_shard_size) from self.model, which is
        None then. train() calls model_init again without rebuilding the accelerator (only _hp_search_setup does, in
        a hyperparameter search), and accelerate keeps its first process-wide state anyway. A model_init that loads
        with DistributedConfig(tp_size=2) therefore trains with each TP rank fed a different batch: on 2 ranks the
        grad norms are 5275 / 1239 / 22093 where model= gives 2.26 / 2.17 / 2.09 (5.24, CPU with shardadopt's other
        patches), silently.

        call_model_init now resets the accelerator state and rebuilds the accelerator from the model when the model
        is tensor parallel and the accelerator's ParallelismConfig is missing or has another tp_size. The test trains
        the same tensor-parallel Qwen3 (2 ranks) once passed as model= and once built by model_init and compares the
        logged losses and grad norms. It needs two accelerators: accelerate refuses a ParallelismConfig for CPU
        processes (shardadopt's accelerate-cpu-parallelism-config lifts that, which is how its own test of this fix
        runs on CPU), so upstream cannot train with tensor parallelism on CPU at all.
    """,
    edits=(Edit("src/transformers/trainer.py", CALL_MODEL_INIT_OLD, CALL_MODEL_INIT_NEW),),
    new_files=(NewFile("tests/trainer/test_trainer_model_init_tensor_parallel.py", TEST),),
)
