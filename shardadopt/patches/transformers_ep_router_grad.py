"""F3: the expert-parallel router sums its score gradient over the EP group before masking non-local experts.

Upstream: transformers#48205 (released in 5.17). transformers 5.15 / 5.16 (``transformers/integrations/
tensor_parallel.py``, ``RouterParallel._prepare_output_fn``) mask the scores of the experts this rank does not own::

    non_local_mask = (router_indices // num_local_experts) != ep_rank
    router_scores = router_scores.masked_fill(non_local_mask, 0.0)

so in backward each rank's score gradient covers its own experts' slots only, and nothing adds the other ranks'
slots: the router gate and every parameter upstream of an MoE block get partial gradients that differ between
ranks (on the tiny Qwen3-MoE, 19 replicated parameters). The fix, as upstream made it, sums the score gradient over
the EP group before that mask (each slot has exactly one owning rank, so the sum is exact), only while autograd
records::

    router_scores = all_reduce_backward(router_scores, device_mesh)   # new, before the mask
    router_scores = router_scores.masked_fill(non_local_mask, 0.0)

The wrapper applies :func:`shardadopt.parallel.moe.sum_router_score_grad` to the scores before upstream's hook masks
them. Routers are hooked when the model is loaded, so enable shardadopt before ``from_pretrained``.

transformers 5.16 moved the hook (``transformers-ep-router-grad-post-forward``); each probe says ``not-needed`` on the
layout it does not target.
"""

from __future__ import annotations

import ast
from types import SimpleNamespace

from shardadopt.patching.contract import Patch, Probe
from shardadopt.upstream import ROUTER_PARALLEL_PREPARE_OUTPUT, tp_layer_output_hook
from shardadopt.upstream.probing import package_file, undecided
from shardadopt.upstream.versions import supported


class _ProbeMesh:
    """Rank 0 of a 2-rank EP mesh, enough for the router hook's forward (which communicates nothing)."""

    ndim = 1  # 5.17's hook picks its group by the mesh's dimensionality

    def get_local_rank(self) -> int:
        return 0

    def size(self) -> int:
        return 2

    def get_group(self):
        return None  # the forward records the group at most; the probe never runs backward


def probe() -> Probe:
    """The 5.15 layout: run ``RouterParallel._prepare_output_fn`` on a 2-rank layout and read its autograd graph."""
    from transformers.integrations import tensor_parallel

    router = getattr(tensor_parallel, "RouterParallel", None)
    if tp_layer_output_hook(router) is not None:
        return probe_hook(lambda module, outputs, mesh: tp_layer_output_hook(router())(module, outputs, mesh))
    if router is not None and hasattr(router, "transform_output_post_forward"):
        return Probe(False, "RouterParallel is EpRouterParallel (transformers >= 5.16), which masks in "
                            "transform_output_post_forward: see transformers-ep-router-grad-post-forward")
    if router is None and dispatches_tokens():
        return Probe(False, NO_ROUTER)
    raise undecided("transformers.integrations.tensor_parallel", "RouterParallel._prepare_output_fn, "
                    "EpRouterParallel.transform_output_post_forward nor the token-dispatch EPImplementation")


NO_ROUTER = ("upstream no longer masks router scores per rank: expert parallelism dispatches tokens "
              "(transformers.distributed.expert_parallel.EPImplementation: all-to-all, or an all-reduce that sums the "
              "routing-weight gradient)")


def dispatches_tokens() -> bool:
    """Whether ``transformers/distributed/expert_parallel.py`` defines ``EPImplementation`` and no router class (the
    5.23+ design), read from its syntax tree: importing it from a post-import hook could catch it half-initialised."""
    path = package_file("transformers", "distributed", "expert_parallel.py")
    if path is None:
        return False
    with open(path, encoding="utf-8") as handle:
        classes = {n.name for n in ast.walk(ast.parse(handle.read())) if isinstance(n, ast.ClassDef)}
    return "EPImplementation" in classes and not {"EpRouterParallel", "RouterParallel"} & classes


def probe_hook(hook) -> Probe:
    import torch

    # Run the hook's forward on a 2-rank layout and read the autograd graph it records from the masked scores back
    # to the scores: upstream's fix puts its gradient all-reduce (a custom autograd Function) there.
    scores = torch.rand(3, 2, requires_grad=True)
    indices = torch.tensor([[0, 3], [1, 2], [3, 0]])
    with torch.enable_grad():
        outputs = hook(SimpleNamespace(num_experts=4), (scores, scores, indices), _ProbeMesh())
    nodes, frontier = [], [outputs[1].grad_fn]
    while frontier:
        node = frontier.pop()
        if node is not None:
            nodes.append(node)
            frontier.extend(next_node for next_node, _ in node.next_functions)
    reaches_scores = any(getattr(n, "variable", None) is scores for n in nodes)
    masks = any(type(n).__name__.startswith("MaskedFill") for n in nodes)
    custom = [type(n).__name__ for n in nodes if isinstance(n, torch.autograd.function.BackwardCFunction)]
    if reaches_scores and masks and custom and all("AllReduce" in c or "SumOverGroup" in c for c in custom):
        return Probe(False, "the EP router hook sums the score gradient over the EP group before its mask")
    if reaches_scores and masks and not custom:
        return Probe(True, "the EP router hook masks non-local scores without summing their gradient over the EP "
                           "group (router and upstream gradients are partial and differ between ranks)")
    raise undecided("the EP router hook", "a plain mask of the scores (this patch's broken shape) nor a mask behind "
                    f"a gradient all-reduce (its autograd graph: {[type(n).__name__ for n in nodes]})")


def _prepare_output_fn(wrapped, instance, args, kwargs):
    from shardadopt.parallel.moe import sum_router_score_grad

    mod, outputs, device_mesh = args
    router_logits, router_scores, *rest = outputs
    outputs = (router_logits, sum_router_score_grad(router_scores, device_mesh), *rest)
    return wrapped(mod, outputs, device_mesh, **kwargs)


def _expert_parallel(model, layout) -> bool:
    """A model whose experts are spread over ranks needs this fix to train right."""
    return layout.ep_size > 1



PATCH = Patch(
    id="transformers-ep-router-grad",
    summary="expert-parallel router: sum the routing-score gradient over the EP group before the non-local mask",
    upstream="huggingface/transformers#48205",
    requires=supported("transformers"),
    wrappers={ROUTER_PARALLEL_PREPARE_OUTPUT: _prepare_output_fn},
    needed_by=_expert_parallel,
    probe=probe,
)
