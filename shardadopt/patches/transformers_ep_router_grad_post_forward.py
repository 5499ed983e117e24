"""F3 in the transformers 5.16 layout: the expert-parallel router sums its score gradient before the non-local mask.

transformers 5.16 moved the hook into ``transformers/distributed/tensor_parallel.py``: ``RouterParallel`` became an
alias of ``EpRouterParallel``, whose ``transform_output_post_forward`` (called through ``self`` from the module's
installed forward) masks the same way, still without the sum::

    router_logits, router_scores, router_indices, *extra_outputs = output
    non_local_mask = (router_indices // num_local_experts) != ep_rank
    router_scores = router_scores.masked_fill(non_local_mask, 0.0)

The fix is the same (:func:`shardadopt.parallel.moe.sum_router_score_grad` before upstream's mask), with its own
upstream diff;
the 5.15 layout is ``transformers-ep-router-grad``, and each probe says ``not-needed`` on the layout it does not
target. Upstream: transformers#48205 (released in 5.17).
"""

from __future__ import annotations

import importlib
import warnings

from shardadopt.patches.transformers_ep_router_grad import NO_ROUTER, dispatches_tokens, probe_hook
from shardadopt.patching.contract import Patch, Probe, Target
from shardadopt.upstream import TENSOR_PARALLEL_MODULE, tp_layer_output_hook
from shardadopt.upstream.probing import package_file, undecided
from shardadopt.upstream.versions import supported


def _post_forward_module() -> str:
    """Where EpRouterParallel lives, found without importing transformers: 5.16+ define it in
    ``transformers/distributed/tensor_parallel.py``, and loading a model imports only that module (never the
    ``integrations.tensor_parallel`` shim), so the patch must wait for it there. 5.15 has no such file."""
    if package_file("transformers", "distributed", "tensor_parallel.py"):
        return "transformers.distributed.tensor_parallel"
    return TENSOR_PARALLEL_MODULE


POST_FORWARD_MODULE = _post_forward_module()


def _expert_parallel_module() -> tuple[str, ...]:
    """5.22+ define the EP router layer in ``transformers/distributed/expert_parallel.py``, which imports
    ``tensor_parallel`` first: 5.22 re-exports ``EpRouterParallel`` from there lazily, so the probe must wait until
    ``expert_parallel`` has finished importing (half-initialised, it has no router class yet)."""
    if package_file("transformers", "distributed", "expert_parallel.py"):
        return ("transformers.distributed.expert_parallel",)
    return ()


def probe() -> Probe:
    """The 5.16 .. 5.22 layout: run ``EpRouterParallel.transform_output_post_forward`` and read its autograd graph."""
    tensor_parallel = importlib.import_module(POST_FORWARD_MODULE)

    with warnings.catch_warnings():  # 5.22 re-exports it from expert_parallel with a FutureWarning
        warnings.simplefilter("ignore", FutureWarning)
        router = getattr(tensor_parallel, "EpRouterParallel", None)
    if router is not None and hasattr(router, "transform_output_post_forward"):
        return probe_hook(lambda module, outputs, mesh: router().transform_output_post_forward(module, outputs, mesh))
    if router is None and tp_layer_output_hook(getattr(tensor_parallel, "RouterParallel", None)) is not None:
        return Probe(False, "transformers < 5.16 masks in RouterParallel._prepare_output_fn: see "
                            "transformers-ep-router-grad")
    if router is None and dispatches_tokens():
        return Probe(False, NO_ROUTER)
    raise undecided(POST_FORWARD_MODULE, "EpRouterParallel.transform_output_post_forward, "
                    "RouterParallel._prepare_output_fn nor the token-dispatch EPImplementation")


def _transform_output_post_forward(wrapped, instance, args, kwargs):
    from shardadopt.parallel.moe import sum_router_score_grad

    module, output, mesh = args
    router_logits, router_scores, *rest = output
    return wrapped(module, (router_logits, sum_router_score_grad(router_scores, mesh), *rest), mesh, **kwargs)


def _expert_parallel(model, layout) -> bool:
    """A model whose experts are spread over ranks needs this fix to train right."""
    return layout.ep_size > 1



PATCH = Patch(
    id="transformers-ep-router-grad-post-forward",
    summary="expert-parallel router (transformers 5.16 layout): sum the routing-score gradient over the EP group "
            "before the non-local mask",
    upstream="huggingface/transformers#48205",
    requires=supported("transformers"),
    wrappers={Target(POST_FORWARD_MODULE, "EpRouterParallel.transform_output_post_forward"):
              _transform_output_post_forward},
    needed_by=_expert_parallel,
    probe=probe,
    probe_modules=_expert_parallel_module(),
)
