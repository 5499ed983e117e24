"""``Trainer(model_init=...)`` with a tensor-parallel model: the accelerator takes the model's parallelism.

Upstream (``Trainer.__init__``, transformers 5.15 .. 5.25)::

    self.model = model
    self.create_accelerator_and_postprocess()
    ...
    if model is None:
        if model_init is not None:
            self.model_init = model_init
            model = self.call_model_init()

and ``Trainer.train`` calls ``self.call_model_init(trial)`` again without rebuilding the accelerator (only
``_hp_search_setup`` does, and only in a hyperparameter search). ``create_accelerator_and_postprocess`` derives
``ParallelismConfig(tp_size, dp_shard_size)`` from ``self.model``, which is ``None`` when it runs, and accelerate
keeps its first process-wide state for every later ``Accelerator``: a ``model_init`` that loads with
``DistributedConfig(tp_size=2)`` then trains with each TP rank fed a different batch (transformers 5.24, 2 ranks:
grad norms 5275 / 1239 / 22093 where ``model=`` gives 2.26 / 2.17 / 2.09), silently.

The wrapper runs upstream's ``call_model_init`` and hands its model to
:func:`shardadopt.parallel.trainer_parallelism.align_accelerator_with_model`, which resets accelerate's state and
rebuilds
the accelerator from the model when its TP size differs from the accelerator's. The probe parses ``Trainer.__init__``,
``Trainer.train`` and ``Trainer.call_model_init``: ``not-needed`` where ``call_model_init`` calls
``create_accelerator_and_postprocess`` or ``__init__``/``train`` call it after ``call_model_init`` (upstream
rebuilds the accelerator for the new model), ``needed`` where ``__init__`` builds it before ``call_model_init`` and
nothing rebuilds it after. On 5.15 such a run trains right without the rebuild as well (measured: the same grad
norms with and without this patch, equal to ``model=``'s); the rebuild gives the accelerator the config ``model=``
gets there too.
"""

from __future__ import annotations

from shardadopt.patching.contract import Patch, Probe, Target
from shardadopt.upstream.versions import supported

BUILD = "create_accelerator_and_postprocess"
INIT = "call_model_init"


def _call_model_init(wrapped, instance, args, kwargs):
    from shardadopt.parallel.trainer_parallelism import align_accelerator_with_model

    model = wrapped(*args, **kwargs)
    align_accelerator_with_model(instance, model)
    return model


def _call_lines(tree, name: str) -> list[int]:
    from shardadopt.upstream.probing import calls

    return sorted(call.lineno for call in calls(tree, name))


def probe() -> Probe:
    from transformers.trainer import Trainer

    from shardadopt.upstream.probing import source_tree, undecided, upstream_function

    where = "Trainer.__init__ / Trainer.train / Trainer.call_model_init"
    trees = {name: source_tree(upstream_function(Trainer, name, f"{PATCH.id} probe"))
             for name in ("__init__", "train", INIT)}
    if _call_lines(trees[INIT], BUILD):
        return Probe(False, "Trainer.call_model_init rebuilds the accelerator for the model it built")
    for name in ("__init__", "train"):
        inits, builds = _call_lines(trees[name], INIT), _call_lines(trees[name], BUILD)
        if inits and any(line > inits[0] for line in builds):
            return Probe(False, f"Trainer.{name} rebuilds the accelerator after model_init ran")
    init_calls, init_builds = _call_lines(trees["__init__"], INIT), _call_lines(trees["__init__"], BUILD)
    if init_calls and init_builds and init_builds[0] < init_calls[0] and _call_lines(trees["train"], INIT):
        return Probe(True, "Trainer builds its accelerator before model_init ran (no model: no ParallelismConfig) "
                           "and rebuilds it only in hyperparameter_search: a tensor-parallel model_init trains "
                           "without the model's ParallelismConfig")
    raise undecided(where, f"{BUILD} before {INIT} in __init__ with no rebuild after it (the gap) nor a {BUILD} "
                           f"call after {INIT} or inside it (the fix)")


PATCH = Patch(
    id="trainer-model-init-parallelism",
    summary="Trainer(model_init=...) with a tensor-parallel load: the accelerator is rebuilt with the model's "
            "ParallelismConfig (it was built before model_init ran, without one)",
    upstream="proposal for transformers main (not reported yet)",
    requires=supported("transformers", "accelerate"),
    wrappers={Target("transformers.trainer", "Trainer.call_model_init"): _call_model_init},
    probe=probe,
    # the accelerator rebuilt here runs upstream's save_only_model checks on the flag as a Trainer(model=...) has it
    # (lifted for a sharded model by trainer-sharded-checkpoint, which must have seen the model first)
    wraps_around=("trainer-sharded-checkpoint",),
)
