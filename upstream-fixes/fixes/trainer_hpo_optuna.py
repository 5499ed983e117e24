"""trainer-hpo-optuna: Optuna hyperparameter_search under torch.distributed without hangs."""

from upstream_diffs import LICENSE_HEADER, Edit, Fix, NewFile

TEST = LICENSE_HEADER + '''\
import json
import os
import sys

from transformers.testing_utils import (
    TestCasePlus,
    execute_subprocess_async,
    get_torch_dist_unique_port,
    require_optuna,
    require_torch,
)


N_TRIALS = 3
MAX_STEPS = 3


def prune_odd_trials_at_step_2():
    import optuna

    class PruneOddTrials(optuna.pruners.BasePruner):
        # Decides from the trial number and step only, so the expected states do not depend on the losses.
        def prune(self, study, trial):
            return trial.number % 2 == 1 and trial.last_step is not None and trial.last_step >= 2

    return PruneOddTrials()


def journal(path):
    import optuna

    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(path))


class TestTrainerDistributedOptuna(TestCasePlus):
    @require_torch
    @require_optuna
    def test_pruned_trial_ends_on_every_rank(self):
        import optuna

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
        # A rank left behind waits in a collective until the process group's timeout (120 s) fails it.
        execute_subprocess_async(cmd, env=self.get_env(), timeout=600)

        # The same search with plain Optuna in one process: one report per evaluation step.
        def objective(trial):
            for step in range(1, MAX_STEPS + 1):
                trial.report(0.0, step)
                if trial.should_prune():
                    raise optuna.TrialPruned()
            return 0.0

        expected = optuna.create_study(pruner=prune_odd_trials_at_step_2())
        expected.optimize(objective, n_trials=N_TRIALS)
        study = optuna.load_study(study_name="hpo", storage=journal(os.path.join(work_dir, "study.log")))
        self.assertEqual([t.state for t in study.trials], [t.state for t in expected.trials])

        ranks = []
        for rank in range(2):
            with open(os.path.join(work_dir, f"rank{rank}.json")) as trials:
                ranks.append(json.load(trials))
        # Every rank ran every trial with rank 0's hyperparameters and left it at the same step.
        self.assertEqual(ranks[0], ranks[1])
        self.assertEqual([end["step"] for end in ranks[0]], [t.last_step for t in expected.trials])
        self.assertEqual([end["learning_rate"] for end in ranks[0]], [t.params["learning_rate"] for t in study.trials])


if __name__ == "__main__":
    # Runs on each of 2 ranks (gloo, CPU): a data-parallel Optuna search whose pruner stops trial 1 at step 2.
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    work_dir = sys.argv[1]
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    ends = []

    class RecordTrialEnd(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):
            ends.append({"step": state.global_step, "learning_rate": args.learning_rate})

    def model_init(trial=None):
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
        return LlamaForCausalLM(config)

    input_ids = torch.arange(32).reshape(4, 8) % 64
    dataset = [{"input_ids": row, "labels": row} for row in input_ids]
    args = TrainingArguments(
        output_dir=os.path.join(work_dir, "output"),
        per_device_train_batch_size=1,
        per_device_eval_batch_size=2,
        max_steps=MAX_STEPS,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
    )
    trainer = Trainer(
        model_init=model_init, args=args, train_dataset=dataset, eval_dataset=dataset, callbacks=[RecordTrialEnd()]
    )
    trainer.hyperparameter_search(
        hp_space=lambda trial: {"learning_rate": trial.suggest_float("learning_rate", 1e-4, 1e-2, log=True)},
        backend="optuna",
        n_trials=N_TRIALS,
        direction="minimize",
        study_name="hpo",
        storage=journal(os.path.join(work_dir, "study.log")) if dist.get_rank() == 0 else None,
        pruner=prune_odd_trials_at_step_2(),
    )
    with open(os.path.join(work_dir, f"rank{dist.get_rank()}.json"), "w") as out:
        json.dump(ends, out)
    dist.destroy_process_group()
'''

INTEGRATION = "src/transformers/integrations/integration_utils.py"

FIX = Fix(
    id="trainer-hpo-optuna",
    distribution="transformers",
    kind="proposal",
    upstream="transformers main (not reported yet; run_hp_search_optuna is unchanged since 5.0)",
    summary="""
        Under torch.distributed, run_hp_search_optuna gives ranks > 0 an optuna FixedTrial and has them loop a fixed
        n_trials, while only rank 0 holds the study. FixedTrial has no study, so Trainer._report_to_hp_search never
        prunes on those ranks: at the first pruned trial rank 0 leaves train() and starts the next trial while the
        other ranks keep training, and the ranks block in different collectives until the job hangs or times out.
        timeout=, study.stop() and a trial that fails on rank 0 (outside training) desynchronize the ranks the same
        way, because the other ranks always wait for n_trials trials.

        Every rank now follows rank 0's decisions: _report_to_hp_search broadcasts rank 0's should_prune() at each
        evaluation so every rank raises TrialPruned at the same step; ranks > 0 run trials until rank 0 broadcasts
        that its study loop ended (n_trials, timeout, study.stop(), an error), and treat the exceptions rank 0's
        study catches (TrialPruned, catch=) as rank 0 does. The test runs a 3-trial search on 2 gloo ranks whose
        pruner stops trial 1 at step 2, and compares trial states and the steps each rank trained with plain Optuna
        in one process.

        Left out (shardadopt's runtime patch has them): carrying an exception raised on one rank only, or a rank that
        died, to the others (a dedicated gloo group with a timeout: here they wait in a collective until the process
        group's timeout); reporting steps as training examples, so that pruning compares trials that tune the batch
        size; multi-objective pruning; and lifting the ParallelMode.DISTRIBUTED requirement.
    """,
    edits=(
        # Rank 0: tell the other ranks when the study loop ends, however it ends.
        Edit(
            INTEGRATION,
            "        study = optuna.create_study(direction=direction, directions=directions, **kwargs)\n"
            "        study.optimize(\n"
            "            _objective, n_trials=n_trials, timeout=timeout, n_jobs=n_jobs, gc_after_trial=gc_after_trial, catch=catch\n"
            "        )\n",
            "        study = optuna.create_study(direction=direction, directions=directions, **kwargs)\n"
            "        try:\n"
            "            study.optimize(\n"
            "                _objective,\n"
            "                n_trials=n_trials,\n"
            "                timeout=timeout,\n"
            "                n_jobs=n_jobs,\n"
            "                gc_after_trial=gc_after_trial,\n"
            "                catch=catch,\n"
            "            )\n"
            "        finally:\n"
            "            if trainer.args.world_size > 1:\n"
            "                # `n_trials`, `timeout`, `study.stop()` or an error ended the study: no more trials\n"
            "                torch.distributed.broadcast_object_list([None], src=0)\n",
        ),
        # Ranks > 0: run rank 0's trials until it says stop.
        Edit(
            INTEGRATION,
            "    else:\n"
            "        for i in range(n_trials):\n"
            "            trainer.objective = None\n"
            "            trial_main_rank_list = [None]\n"
            "            if trainer.args.parallel_mode != ParallelMode.DISTRIBUTED:\n"
            "                raise RuntimeError(\"only support DDP optuna HPO for ParallelMode.DISTRIBUTED currently.\")\n"
            "            torch.distributed.broadcast_object_list(trial_main_rank_list, src=0)\n"
            "            trainer.train(resume_from_checkpoint=None, trial=trial_main_rank_list[0])\n"
            "            # If there hasn't been any evaluation during the training loop.\n"
            "            if getattr(trainer, \"objective\", None) is None:\n"
            "                metrics = trainer.evaluate()\n"
            "                trainer.objective = trainer.compute_objective(metrics)\n"
            "        return None\n",
            "    else:\n"
            "        if trainer.args.parallel_mode != ParallelMode.DISTRIBUTED:\n"
            "            raise RuntimeError(\"only support DDP optuna HPO for ParallelMode.DISTRIBUTED currently.\")\n"
            "        # Rank 0's study catches these and goes on with its next trial; so do the other ranks.\n"
            "        catch = kwargs.get(\"catch\", ())\n"
            "        caught = (optuna.TrialPruned, *((catch,) if isinstance(catch, type) else catch))\n"
            "        while True:\n"
            "            trainer.objective = None\n"
            "            trial_main_rank_list = [None]\n"
            "            torch.distributed.broadcast_object_list(trial_main_rank_list, src=0)\n"
            "            if trial_main_rank_list[0] is None:\n"
            "                return None\n"
            "            try:\n"
            "                trainer.train(resume_from_checkpoint=None, trial=trial_main_rank_list[0])\n"
            "                # If there hasn't been any evaluation during the training loop.\n"
            "                if getattr(trainer, \"objective\", None) is None:\n"
            "                    metrics = trainer.evaluate()\n"
            "                    trainer.objective = trainer.compute_objective(metrics)\n"
            "            except caught:\n"
            "                pass\n",
        ),
        # Every rank reports at each evaluation: rank 0's pruning decision holds for all of them.
        Edit(
            "src/transformers/trainer.py",
            "            if hasattr(trial, \"study\") and not trial.study._is_multi_objective():\n"
            "                trial.report(self.objective, step)\n"
            "                if trial.should_prune():\n"
            "                    self.callback_handler.on_train_end(self.args, self.state, self.control)\n"
            "                    raise optuna.TrialPruned()\n",
            "            should_prune = False\n"
            "            if hasattr(trial, \"study\") and not trial.study._is_multi_objective():\n"
            "                trial.report(self.objective, step)\n"
            "                should_prune = trial.should_prune()\n"
            "            if self.args.world_size > 1:\n"
            "                # Only rank 0 holds the study (the other ranks run a `FixedTrial`): all ranks must stop together.\n"
            "                decision = [should_prune]\n"
            "                dist.broadcast_object_list(decision, src=0)\n"
            "                should_prune = decision[0]\n"
            "            if should_prune:\n"
            "                self.callback_handler.on_train_end(self.args, self.state, self.control)\n"
            "                raise optuna.TrialPruned()\n",
        ),
    ),
    new_files=(NewFile("tests/trainer/test_trainer_distributed_optuna.py", TEST),),
)
