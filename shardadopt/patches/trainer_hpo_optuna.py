"""Optuna ``hyperparameter_search`` under torch.distributed without hangs: every rank runs, prunes and stops together.

Upstream (byte-identical in every transformers 5.x read so far; ``integrations/integration_utils.py``,
``run_hp_search_optuna``)::

    fixed_trial = optuna.trial.FixedTrial(trial.params, trial.number)
    trial_main_rank_list = [fixed_trial]
    torch.distributed.broadcast_object_list(trial_main_rank_list, src=0)
    ...
    else:
        for i in range(n_trials):
            ...
            torch.distributed.broadcast_object_list(trial_main_rank_list, src=0)
            trainer.train(resume_from_checkpoint=None, trial=trial_main_rank_list[0])

and ``Trainer._report_to_hp_search``::

    if hasattr(trial, "study") and not trial.study._is_multi_objective():
        trial.report(self.objective, step)
        if trial.should_prune():

Ranks other than 0 hold a ``FixedTrial`` (no ``study``, ``should_prune()`` always False): at the first pruned
trial rank 0 leaves ``train()`` and the others block in the next collective; ``timeout=``, ``study.stop()`` and an
exception on one rank desynchronise the ranks the same way; and ``world_size > 1`` outside
``ParallelMode.DISTRIBUTED`` is refused outright.

The patch routes ``run_hp_search_optuna`` (the definition and the global that ``OptunaBackend.run`` calls in
``transformers.hyperparameter_search``) to ``shardadopt.hpo.trainer_backend.run_hp_search_optuna`` (every rank
runs every trial through ``shardadopt.hpo.optimize`` with a ``DistributedTrial``), and the Optuna branch of
``_report_to_hp_search`` for a ``DistributedTrial`` to ``trainer_backend.report_to_hp_search`` (one collective
per report; every rank raises ``TrialPruned`` at the same report). Any other trial takes upstream's exact path.
The probe parses upstream's ``run_hp_search_optuna`` for the ``FixedTrial`` broadcast.
"""

from __future__ import annotations

import inspect

from shardadopt.patching.contract import Patch, Probe, Target
from shardadopt.upstream import TRAINER_REPORT_TO_HP_SEARCH
from shardadopt.upstream.versions import supported


def _run_hp_search_optuna(wrapped, instance, args, kwargs):
    from shardadopt.hpo.trainer_backend import run_hp_search_optuna

    return run_hp_search_optuna(*args, **kwargs)


def _report_to_hp_search(wrapped, instance, args, kwargs):
    from transformers.trainer_utils import HPSearchBackend

    from shardadopt.hpo.trainer_backend import report_to_hp_search
    from shardadopt.hpo.trial import DistributedTrial

    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    trial = bound.arguments["trial"]
    if isinstance(trial, DistributedTrial) and instance.hp_search_backend == HPSearchBackend.OPTUNA:
        return report_to_hp_search(instance, trial, bound.arguments["step"], bound.arguments["metrics"])
    return wrapped(*args, **kwargs)


def probe() -> Probe:
    """Parse ``run_hp_search_optuna``: the broken shape builds a ``FixedTrial`` for the other ranks and broadcasts
    it."""
    from transformers.integrations import integration_utils

    from shardadopt.upstream.probing import calls, source_tree, undecided, upstream_function

    tree = source_tree(upstream_function(integration_utils, "run_hp_search_optuna", "trainer-hpo-optuna probe"))
    if calls(tree, "FixedTrial") and calls(tree, "broadcast_object_list"):
        return Probe(True, "run_hp_search_optuna gives ranks > 0 a FixedTrial: they never prune and loop a fixed "
                           "n_trials, so pruning, timeout and errors hang the job")
    raise undecided("run_hp_search_optuna", "the FixedTrial broadcast to ranks > 0 (this patch's broken shape) nor a "
                    "known collective trial")


PATCH = Patch(
    id="trainer-hpo-optuna",
    summary="Trainer Optuna HPO under torch.distributed: collective trials, pruning, stop and errors on every rank",
    upstream="transformers: run_hp_search_optuna / _report_to_hp_search (FixedTrial on ranks > 0, all 5.x)",
    requires=supported("transformers", "optuna"),
    wrappers={
        Target("transformers.integrations.integration_utils", "run_hp_search_optuna"): _run_hp_search_optuna,
        Target("transformers.hyperparameter_search", "run_hp_search_optuna"): _run_hp_search_optuna,
        TRAINER_REPORT_TO_HP_SEARCH: _report_to_hp_search,
    },
    probe=probe,
)
