"""Tensor parallelism: parameters the TP plan leaves out but that see only this rank's shard get summed gradients.

Upstream: not reported yet (proposal, ``upstream-fixes/transformers-tp-partial-grad.diff``). A TP plan shards the
projections of a block (``up_proj`` colwise, ``down_proj`` rowwise) and leaves every other module replicated. A
module between the two that owns parameters then computes on this rank's slice of the activations, and its
parameters' gradients are partial sums that nothing adds up: Apertus' xIELU activation
(``ApertusMLP.act_fn``, scalars ``alpha_p``/``alpha_n``) in every release 5.15 .. 5.25, found by
``tools/arch_sweep.py``: with ``tp_size=2`` their first-step gradients are off by up to 10^4 times the sweep's
tolerance and training diverges from one process (silently). Upstream's own fix would list the module as
``replicated_with_grad_allreduce`` in the model's plan (the diff); shardadopt cannot know every model's plan
gaps, so it detects them: :func:`shardadopt.parallel.tp.install_partial_gradient_sums` compares each whole parameter's
gradient copies across the TP group at its first backward with a non-zero gradient (an all-zero one is no
evidence) and sums those that differ, each backward once.

The wrapper installs it on every model ``DistributedMixin.maybe_distribute_model`` shards with a tensor-parallel
mesh (the model's first forward computes its layout). The probe reads Apertus' plan (upstream's data): no entry
for ``layers.*.mlp.act_fn`` while ``up_proj`` is colwise and ``down_proj`` rowwise means ``needed``; an entry for
it means upstream fixed the instance the sweep found (``not-needed``; a new instance elsewhere would show in the
sweep again).
"""

from __future__ import annotations

import logging

from shardadopt import upstream
from shardadopt.patching.contract import Patch, Probe
from shardadopt.upstream.versions import supported

PLAN_MODULE = "transformers.models.apertus.configuration_apertus"
_LOG = logging.getLogger("shardadopt")


def probe() -> Probe:
    import importlib

    from shardadopt.upstream.probing import undecided, upstream_function

    where = f"{PLAN_MODULE}.ApertusConfig.base_model_tp_plan"
    # imported here, not waited for: the fix is generic and must apply when a model of any type loads
    config = upstream_function(importlib.import_module(PLAN_MODULE), "ApertusConfig", where)
    plan = getattr(config, "base_model_tp_plan", None) or {}
    if "layers.*.mlp.act_fn" in plan:
        return Probe(False, f"Apertus' TP plan covers the xIELU activation ({plan['layers.*.mlp.act_fn']})")
    if plan.get("layers.*.mlp.up_proj") == "colwise" and plan.get("layers.*.mlp.down_proj") == "rowwise":
        return Probe(True, "parameters inside a colwise -> rowwise region that the TP plan leaves out get partial "
                           "gradients nothing sums (Apertus xIELU mlp.act_fn.alpha_p/alpha_n)")
    raise undecided(where, "a plan entry for layers.*.mlp.act_fn (the fix) nor up_proj colwise / down_proj rowwise "
                           "without one (the gap)")


def _report(name: str) -> None:
    _LOG.info("shardadopt: %s receives a partial gradient on each tensor-parallel rank (not in the TP plan); "
              "summing it over the TP group", name)


def _maybe_distribute_model(wrapped, instance, args, kwargs):
    from shardadopt.parallel.tp import install_partial_gradient_sums

    config = upstream.bind_maybe_distribute_model(wrapped, args, kwargs).distributed_config
    model = wrapped(*args, **kwargs)
    if (getattr(config, "tp_size", None) or 1) > 1 and model is not None:
        install_partial_gradient_sums(model, on_partial=_report)
    return model


def _tensor_parallel(model, layout) -> bool:
    """A model sharded with tensor parallelism needs this fix to train right."""
    return layout.tp_size > 1



PATCH = Patch(
    id="transformers-tp-partial-grad",
    summary="TP: parameters the plan leaves out inside a sharded region (Apertus xIELU alpha_p/alpha_n) get their "
            "partial gradients summed over the TP group (found by comparing the ranks' copies)",
    upstream="proposal for transformers main (not reported yet)",
    requires=supported("transformers"),
    wrappers={upstream.MAYBE_DISTRIBUTE_MODEL: _maybe_distribute_model},
    needed_by=_tensor_parallel,
    probe=probe,
)
