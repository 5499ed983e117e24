"""F4: FSDP over the experts divides their gradients twice when ``efsdp_size == 1`` (``ep_size == fsdp_size``).

Upstream: fixed in transformers 5.23.0 (no PR referenced in its source). transformers 5.19 .. 5.22 shard the dispatched
experts in ``apply_fully_sharded_data_parallelism`` (``transformers/distributed/fsdp.py``) with::

    module.set_gradient_divide_factor(float(distributed_config.fsdp_size))
    ...
    module.set_force_sum_reduction_for_comms(True)

(5.19.0 .. 5.20.1 set the forced sum only when the ``efsdp`` group's backend is not NCCL, i.e. on gloo/CPU.) On an
``efsdp`` mesh of one rank FSDP2 does no reduce-scatter: its single-rank copy divides by the factor, and the forced
sum's post-divide divides by it again, so every expert gradient is ``1 / fsdp_size`` of the single-process value
(0.5x for ``ep_size=2, fsdp_size=2``). 5.23 guards the forced sum with ``if distributed_config.efsdp_size > 1:``.

The patch wraps the function as ``transformers.distributed.mixin`` calls it and then runs
:func:`shardadopt.moe.fix_single_rank_expert_grad_divide` on the sharded model, which turns the forced sum off for
modules sharded over a one-rank mesh. The function is only called for models sharded at load time.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

from shardadopt.registry import Patch, Probe, Target

MODULE = "transformers.distributed.mixin"


def _unguarded_forced_sums(function) -> int:
    """How many ``set_force_sum_reduction_for_comms(True)`` calls are not under an ``if`` that tests ``efsdp_size``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))

    def visit(node: ast.AST, guarded: bool) -> int:
        if isinstance(node, ast.If) and any(isinstance(n, ast.Attribute) and n.attr == "efsdp_size"
                                            for n in ast.walk(node.test)):
            guarded = True
        count = int(not guarded and isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "set_force_sum_reduction_for_comms"
                    and any(isinstance(a, ast.Constant) and a.value is True for a in node.args))
        return count + sum(visit(child, guarded) for child in ast.iter_child_nodes(node))

    return visit(tree, False)


def probe() -> Probe:
    from transformers.distributed import fsdp, mixin

    function = getattr(fsdp, "apply_fully_sharded_data_parallelism", None)
    if function is None or getattr(mixin, "apply_fully_sharded_data_parallelism", None) is not function:
        return Probe(False, "transformers.distributed.mixin does not call fsdp.apply_fully_sharded_data_parallelism")
    if "set_force_sum_reduction_for_comms" not in inspect.getsource(function):
        return Probe(False, "apply_fully_sharded_data_parallelism never forces sum reduction (no expert FSDP divide "
                            "factor)")
    if not _unguarded_forced_sums(function):
        return Probe(False, "apply_fully_sharded_data_parallelism forces sum reduction for the experts only when "
                            "efsdp_size > 1")
    return Probe(True, "apply_fully_sharded_data_parallelism forces sum reduction for the experts even on a one-rank "
                       "efsdp mesh, where FSDP2 then divides their gradients by fsdp_size twice")


def _apply_fully_sharded_data_parallelism(wrapped, instance, args, kwargs):
    from shardadopt.moe import fix_single_rank_expert_grad_divide

    model = wrapped(*args, **kwargs)
    fix_single_rank_expert_grad_divide(model)
    return model


PATCH = Patch(
    id="transformers-ep-expert-grad-scale",
    summary="EP + FSDP with efsdp_size == 1: expert gradients are not divided by fsdp_size twice",
    upstream="fixed in huggingface/transformers v5.23.0 (fsdp.py: forced sum only when efsdp_size > 1)",
    requires={"transformers": ">=5.15,<5.25"},
    wrappers={Target(MODULE, "apply_fully_sharded_data_parallelism"): _apply_fully_sharded_data_parallelism},
    probe=probe,
)
