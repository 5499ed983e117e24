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

The patch routes ``ExpertsInterface.get_interface("grouped_mm")`` to :func:`shardadopt.moe.grouped_mm_experts_forward`
for experts sharded by expert; every other experts module runs upstream's function unchanged.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

from shardadopt.registry import Patch, Probe, Target

MODULE = "transformers.integrations.moe"


def _unmasked_gemm_outputs(function: Any) -> list[str]:
    """Names assigned from a ``_grouped_linear(...)`` call whose next use is not a ``masked_fill`` of that name."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    statements = [node for node in ast.walk(tree) if isinstance(node, ast.stmt)]
    statements.sort(key=lambda node: (node.lineno, node.col_offset))
    unmasked = []
    for index, statement in enumerate(statements):
        if not (isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Call)
                and getattr(statement.value.func, "id", None) == "_grouped_linear"):
            continue
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
    return unmasked


def probe() -> Probe:
    from transformers.integrations import moe

    forward = getattr(moe, "grouped_mm_experts_forward", None)
    if forward is None or not hasattr(moe, "ExpertsInterface"):
        return Probe(False, "transformers has no grouped_mm experts forward to fix")
    unmasked = _unmasked_gemm_outputs(forward)
    if not unmasked:
        return Probe(False, "grouped_mm_experts_forward masks the sentinel-tail rows after each grouped GEMM")
    return Probe(True, "grouped_mm_experts_forward leaves the sentinel-tail rows of its grouped GEMM outputs unmasked "
                       f"({len(unmasked)} of them), so expert-parallel training can get NaN gradients")


def _expert_parallel_forward(self, hidden_states, top_k_index, top_k_weights):
    from transformers.integrations import moe

    from shardadopt.moe import grouped_mm_experts_forward, is_expert_parallel

    if is_expert_parallel(self):
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    return moe.grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)


def _get_interface(wrapped, instance, args, kwargs):
    from transformers.integrations import moe

    forward = wrapped(*args, **kwargs)
    return _expert_parallel_forward if forward is moe.grouped_mm_experts_forward else forward


PATCH = Patch(
    id="transformers-ep-grouped-mm-sentinel",
    summary="expert-parallel grouped_mm: zero the undefined sentinel-tail rows after each grouped GEMM (no NaN grads)",
    upstream="huggingface/transformers#48205",
    requires={"transformers": ">=5.15,<5.25"},
    wrappers={Target(MODULE, "ExpertsInterface.get_interface"): _get_interface},
    probe=probe,
)
