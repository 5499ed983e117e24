"""F2: the expert-parallel ``grouped_mm`` experts forward masks the sentinel-tail rows after each grouped GEMM.

Upstream: transformers#48205 (released in 5.17). transformers 5.15 / 5.16 mask only the GEMM input and the weighted
output (``transformers/integrations/moe.py``, ``grouped_mm_experts_forward``)::

    # Pre-mask (bwd path).
    selected_hidden_states_g.masked_fill_(sentinel_mask, 0.0)
    proj_out = _grouped_linear(selected_hidden_states_g, selected_weights, offsets, ...)
    ...
    proj_out = _grouped_linear(proj_out, selected_weights, offsets, ...)
    weighted_out = proj_out * sample_weights_g.unsqueeze(-1)
    # Post-mask (fwd path).
    weighted_out.masked_fill_(sentinel_mask, 0.0)

``torch._grouped_mm`` leaves the rows beyond ``offsets[-1]`` (the slots routed to another rank's experts) undefined
in its output and in its backward ``d_input``; they hold uninitialised memory (NaN/Inf on CUDA, and on CPU in about
one of 40 two-rank backward passes of a tiny Qwen3-MoE with torch 2.13), and the routing-weight gradient
``0 * NaN`` is NaN. The fix masks each GEMM's output (``proj_out = proj_out.masked_fill(sentinel_mask,
0.0)`` after both ``_grouped_linear`` calls) and drops the post-mask it supersedes.

The patch routes ``ExpertsInterface.get_interface("grouped_mm")`` to
:func:`shardadopt.parallel.moe.grouped_mm_experts_forward`
for experts sharded by expert; every other experts module runs upstream's function unchanged.
"""

from __future__ import annotations

import ast
from typing import Any

from shardadopt import upstream
from shardadopt.patching.contract import Patch, Probe, Target
from shardadopt.upstream.probing import callee, source_tree, undecided, upstream_function
from shardadopt.upstream.versions import supported

MODULE = "transformers.integrations.moe"


def _gemm_outputs(function: Any) -> tuple[int, list[str]]:
    """How many names are assigned from a ``_grouped_linear(...)`` call, and those whose next use is not a
    ``masked_fill`` of that name."""
    statements = [node for node in ast.walk(source_tree(function)) if isinstance(node, ast.stmt)]
    statements.sort(key=lambda node: (node.lineno, node.col_offset))
    gemms, unmasked = 0, []
    for index, statement in enumerate(statements):
        if not (isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Call)
                and callee(statement.value) == upstream.MOE_GROUPED_LINEAR):
            continue
        gemms += 1
        name = statement.targets[0].id if isinstance(statement.targets[0], ast.Name) else None
        masked = False
        for later in statements[index + 1:]:
            if isinstance(later, (ast.If, ast.For, ast.While, ast.With)):
                continue  # look inside compound statements (their bodies come next in the list)
            uses = [n for n in ast.walk(later) if isinstance(n, ast.Name) and n.id == name]
            if not uses:
                continue
            masked = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                         and n.func.attr in ("masked_fill", "masked_fill_")
                         and getattr(n.func.value, "id", None) == name for n in ast.walk(later))
            break
        if not masked:
            unmasked.append(name or "<expression>")
    return gemms, unmasked


def probe() -> Probe:
    """Parse ``grouped_mm_experts_forward``: each ``_grouped_linear`` output must be masked before its next use."""
    from transformers.integrations import moe

    where = "transformers-ep-grouped-mm-sentinel probe"
    upstream_function(moe, "ExpertsInterface", where)
    gemms, unmasked = _gemm_outputs(upstream_function(moe, "grouped_mm_experts_forward", where))
    if not gemms:
        raise undecided("grouped_mm_experts_forward", "its _grouped_linear GEMM calls")
    if not unmasked:
        return Probe(False, "grouped_mm_experts_forward masks the sentinel-tail rows after each grouped GEMM")
    return Probe(True, "grouped_mm_experts_forward leaves the sentinel-tail rows of its grouped GEMM outputs unmasked "
                       f"({len(unmasked)} of {gemms}), so expert-parallel training can get NaN gradients")


def _expert_parallel_forward(self, hidden_states, top_k_index, top_k_weights):
    from transformers.integrations import moe

    from shardadopt.parallel.moe import grouped_mm_experts_forward, is_expert_parallel

    if is_expert_parallel(self):
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    return moe.grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)


def _get_interface(wrapped, instance, args, kwargs):
    from transformers.integrations import moe

    forward = wrapped(*args, **kwargs)
    return _expert_parallel_forward if forward is moe.grouped_mm_experts_forward else forward


def _expert_parallel(model, layout) -> bool:
    """A model whose experts are spread over ranks needs this fix to train right."""
    return layout.ep_size > 1



PATCH = Patch(
    id="transformers-ep-grouped-mm-sentinel",
    summary="expert-parallel grouped_mm: zero the undefined sentinel-tail rows after each grouped GEMM (no NaN grads)",
    upstream="huggingface/transformers#48205",
    requires=supported("transformers"),
    wrappers={Target(MODULE, "ExpertsInterface.get_interface"): _get_interface},
    needed_by=_expert_parallel,
    probe=probe,
)
