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
:func:`shardadopt.parallel.moe.fix_single_rank_expert_grad_divide` on the sharded model, which turns the forced sum off
for modules sharded over a one-rank mesh. The function is only called for models sharded at load time.
"""

from __future__ import annotations

import ast

from shardadopt.patching.contract import Patch, Probe, Target
from shardadopt.upstream.probing import Undecided, callee, calls, names, source_tree, undecided, upstream_function
from shardadopt.upstream.versions import supported

MODULE = "transformers.distributed.mixin"
FUNCTION = "apply_fully_sharded_data_parallelism"


def _forced_sums(tree: ast.AST) -> tuple[int, int]:
    """(unguarded, guarded): ``set_force_sum_reduction_for_comms(True)`` calls outside / inside an ``if`` that tests
    ``efsdp_size``."""
    counts = [0, 0]

    def visit(node: ast.AST, guarded: bool) -> None:
        if isinstance(node, ast.If) and "efsdp_size" in names(node.test):
            guarded = True
        if (isinstance(node, ast.Call) and callee(node) == "set_force_sum_reduction_for_comms"
                and any(isinstance(a, ast.Constant) and a.value is True for a in node.args)):
            counts[guarded] += 1
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(tree, False)
    return counts[0], counts[1]


def _one_mesh_for_all(tree: ast.FunctionDef) -> bool:
    """The 5.15 .. 5.18 shape: one mesh parameter, and every ``fully_shard`` call uses it (no expert mesh)."""
    meshes = [a.arg for a in tree.args.args if "mesh" in a.arg]
    shards = calls(tree, "fully_shard")
    return len(meshes) == 1 and bool(shards) and all(
        any(k.arg == "mesh" and isinstance(k.value, ast.Name) and k.value.id == meshes[0] for k in c.keywords)
        for c in shards)


def probe() -> Probe:
    """Parse ``apply_fully_sharded_data_parallelism`` as the mixin calls it."""
    from transformers.distributed import fsdp, mixin

    where = "transformers-ep-expert-grad-scale probe"
    function = upstream_function(fsdp, FUNCTION, where)
    if getattr(mixin, FUNCTION, None) is not function:
        raise Undecided(f"{where}: transformers.distributed.mixin no longer calls fsdp.{FUNCTION}")
    tree = source_tree(function)
    unguarded, guarded = _forced_sums(tree)
    if unguarded and calls(tree, "set_gradient_divide_factor"):
        return Probe(True, f"{FUNCTION} forces sum reduction for the experts even on a one-rank efsdp mesh, where "
                           "FSDP2 then divides their gradients by fsdp_size twice")
    if guarded and not unguarded:
        return Probe(False, f"{FUNCTION} forces sum reduction for the experts only when efsdp_size > 1")
    if not unguarded and not guarded and _one_mesh_for_all(tree):
        return Probe(False, f"{FUNCTION} shards every module on one mesh (no expert FSDP mesh, no divide factor)")
    raise undecided(FUNCTION, "the experts' forced sum reduction (guarded or not by efsdp_size) nor one mesh for "
                    "every module")


def _apply_fully_sharded_data_parallelism(wrapped, instance, args, kwargs):
    from shardadopt.parallel.moe import fix_single_rank_expert_grad_divide

    model = wrapped(*args, **kwargs)
    fix_single_rank_expert_grad_divide(model)
    return model


def _expert_parallel(model, layout) -> bool:
    """A model whose experts are spread over ranks needs this fix to train right."""
    return layout.ep_size > 1



PATCH = Patch(
    id="transformers-ep-expert-grad-scale",
    summary="EP + FSDP with efsdp_size == 1: expert gradients are not divided by fsdp_size twice",
    upstream="fixed in huggingface/transformers v5.23.0 (fsdp.py: forced sum only when efsdp_size > 1)",
    requires=supported("transformers"),
    wrappers={Target(MODULE, "apply_fully_sharded_data_parallelism"): _apply_fully_sharded_data_parallelism},
    needed_by=_expert_parallel,
    probe=probe,
)
