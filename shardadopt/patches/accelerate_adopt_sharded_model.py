"""``Accelerator.prepare`` adopts a model that is already sharded (at load time or by hand) instead of wrapping it.

Upstream (every supported accelerate, ``accelerate/accelerator.py``, ``Accelerator.prepare_model``) has no path for a
model that arrives sharded; on CPU it ends in::

    elif self.distributed_type == DistributedType.MULTI_CPU:
        kwargs = self.ddp_handler.to_kwargs() if self.ddp_handler else {}
        model = torch.nn.parallel.DistributedDataParallel(model, **kwargs)

("aten.cat.default got mixed torch.Tensor and DTensor"; on GPUs: "Your model contains `DTensor` parameters, which
is incompatible with DDP"). Past that, everything around the model assumes one batch per process and one mesh:
``prepare_data_loader`` splits by ``process_index`` (TP ranks get different batches; a loader that dispatches from
rank 0, accelerate's default for iterable datasets, either slices over every process or, with a ``tp`` dimension in
the Accelerator's device mesh as Trainer builds it, sends every process, data-parallel ranks included, the same
batch), ``gather_for_metrics``
returns TP duplicates, ``no_sync`` is a no-op for FSDP2 modules outside accelerate's FSDP plugin, foreach/fused
optimizers fail on mixed DTensor/plain parameters, and ``clip_grad_norm_`` cannot reduce over several meshes.

For a model that ``shardadopt.parallel.topology`` finds sharded (and only when accelerate's own FSDP/DeepSpeed/Megatron
plugins are not in charge) each call is routed to ``shardadopt.adopt``; plain models take upstream's exact path.
A model prepared for evaluation only (``prepare_model(model, evaluation_mode=True)``: ``Trainer.evaluate``, and
Trainer 5.19+ for training) keeps upstream's path, but ``gather_for_metrics`` still keeps each sample once when its
TP ranks share a batch.
A sharded model that needs a patch which could not apply (``shardadopt.patching.refusal``) is refused here, in either
mode. What adoption cannot train (``shardadopt.adopt.refuse_unsupported_distributed_features``) is refused when an
optimizer over a prepared model's parameters is prepared (Trainer 5.19+ prepares its model in evaluation mode, then
its optimizer), so an evaluation-only ``Trainer.evaluate()`` of such a load keeps upstream's path.
``Accelerator.free_memory``/``clear`` also forget the adopted models (shardadopt's own record would keep a search's
earlier trials' models alive). ``Accelerator(kwargs_handlers=[shardadopt.AdoptionKwargs(...)])`` is accepted
(upstream raises ``KeyError`` on a handler class it does not know).
"""

from __future__ import annotations

import ast
import inspect
from typing import Any

from shardadopt import upstream
from shardadopt.patching.contract import Patch, Probe, Target
from shardadopt.upstream.versions import supported

_MODULE = "accelerate.accelerator"


def _plugin_managed(accelerator: Any) -> bool:
    """accelerate's own FSDP / DeepSpeed / Megatron plugins shard models themselves: leave those runs alone."""
    from accelerate.utils.dataclasses import DistributedType

    return accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED,
                                            DistributedType.MEGATRON_LM)


def _init(wrapped, instance, args, kwargs):
    from shardadopt.adopt.record import KWARGS_ATTR, AdoptionKwargs

    handlers = kwargs.get("kwargs_handlers")
    ours = [h for h in handlers or () if isinstance(h, AdoptionKwargs)]
    if len(ours) > 1:
        raise ValueError("You can only pass one shardadopt.AdoptionKwargs in `kwargs_handlers`.")
    if ours:
        kwargs = {**kwargs, "kwargs_handlers": [h for h in handlers if not isinstance(h, AdoptionKwargs)]}
    result = wrapped(*args, **kwargs)
    setattr(instance, KWARGS_ATTR, ours[0] if ours else None)
    return result


def _prepare_model(wrapped, instance, args, kwargs):
    from shardadopt.adopt import adopt_model, adoption_kwargs, is_sharded_model
    from shardadopt.parallel.topology import topology
    from shardadopt.patching.refusal import refuse_unfixed, unfixed_possible

    model = args[0] if args else kwargs.get("model")
    evaluation_mode = kwargs.get("evaluation_mode", args[2] if len(args) > 2 else False)
    if upstream.is_accelerate_prepared(model) or _plugin_managed(instance):
        return wrapped(*args, **kwargs)
    override = adoption_kwargs(instance).topology
    if evaluation_mode:
        # Trainer.evaluate, and Trainer 5.19+ for training: a patch the model needs must have applied either way;
        # what adoption cannot train is refused with the optimizer (_prepare_optimizer), which only training prepares
        if is_sharded_model(model, override) and unfixed_possible():
            refuse_unfixed(model, topology(model, override))
        if is_sharded_model(model, override):
            from shardadopt.adopt.context import prepare_without_adoption

            prepare_without_adoption(instance, model, topology(model, override))
        return wrapped(*args, **kwargs)
    if not is_sharded_model(model, override):
        return wrapped(*args, **kwargs)
    refuse_unfixed(model, topology(model, override))
    return adopt_model(instance, model, prepare=wrapped)


def _prepare_data_loader(wrapped, instance, args, kwargs):
    from shardadopt.adopt import adopted, dispatch_per_mesh_dp_group, shard_dataloader

    loader = wrapped(*args, **kwargs)
    state = adopted(instance)
    if state is not None:
        from shardadopt.adopt.context import shares_batches

        # the ranks of one CP group take the same batches
        return loader if shares_batches(instance, state.layout) else shard_dataloader(loader, state.layout,
                                                                                     state.dp_ranks)
    # Trainer (transformers 5.19+) prepares a load-time-sharded model itself and gives accelerate a
    # ParallelismConfig: a dispatching loader must still split by the mesh's data-parallel ranks.
    return dispatch_per_mesh_dp_group(loader, instance.torch_device_mesh) if not _plugin_managed(instance) else loader


def _prepare_optimizer(wrapped, instance, args, kwargs):
    from torch.distributed.tensor import DTensor

    from shardadopt.adopt import adoption_kwargs, refuse_unsupported_distributed_features
    from shardadopt.parallel.optim import split_param_groups_by_mesh

    if not _plugin_managed(instance):
        # An optimizer over a prepared model's parameters means training it (Trainer 5.19+ prepared the model in
        # evaluation mode, which evaluation alone also does): refuse what adoption cannot train, by name.
        raw = args[0] if args else kwargs.get("optimizer")
        stepped = {id(p) for group in getattr(raw, "param_groups", ()) for p in group["params"]}
        for model in upstream.accelerator_models(instance):
            if any(id(p) in stepped for p in model.parameters()):
                refuse_unsupported_distributed_features(model)
    optimizer = wrapped(*args, **kwargs)
    inner = getattr(optimizer, "optimizer", optimizer)
    if adoption_kwargs(instance).split_optimizer and not _plugin_managed(instance) and any(
            isinstance(p, DTensor) for group in inner.param_groups for p in group["params"]):
        split_param_groups_by_mesh(inner)
    return optimizer


def _clip_grad_norm_(wrapped, instance, args, kwargs):
    from shardadopt.adopt import adopted, clip_grad_norm_

    if adopted(instance) is None or _plugin_managed(instance):
        return wrapped(*args, **kwargs)
    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    bound.apply_defaults()
    return clip_grad_norm_(instance, bound.arguments["parameters"], bound.arguments["max_norm"],
                           bound.arguments["norm_type"])


def _no_sync(wrapped, instance, args, kwargs):
    from shardadopt.adopt import adopted, no_sync

    state = adopted(instance)
    model = args[0] if args else kwargs.get("model")
    if state is None or id(model) not in state.topologies or instance.is_fsdp2:
        return wrapped(*args, **kwargs)
    return no_sync(model)


def _gather_for_metrics(wrapped, instance, args, kwargs):
    from shardadopt.adopt.metrics import gather_for_metrics, metric_owners

    owners = None if _plugin_managed(instance) else metric_owners(instance)
    if owners is None:
        return wrapped(*args, **kwargs)
    return gather_for_metrics(instance, *args, **kwargs, owners=owners)


def _maybe_context_parallel(wrapped, instance, args, kwargs):
    from shardadopt.adopt.context import token_weighted_context

    return token_weighted_context(instance, wrapped(*args, **kwargs))


def _free_memory(wrapped, instance, args, kwargs):
    from shardadopt.adopt.record import forget_adopted

    forget_adopted(instance)  # free_memory releases the accelerator's models: the adoption record's references too
    return wrapped(*args, **kwargs)


def probe() -> Probe:
    """Read ``Accelerator.prepare_model``: the CPU branch of its distribution chain must be the plain DDP wrap."""
    from accelerate.accelerator import Accelerator

    from shardadopt.upstream.probing import body_calls, if_chains, names, source_tree, undecided, upstream_function

    tree = source_tree(upstream_function(Accelerator, "prepare_model", "accelerate-adopt probe"))
    for chain in if_chains(tree):
        for test, body in chain:
            # A test of already-sharded models that does not refuse them (1.13-1.15 only raise for DTensor models on
            # GPU processes) may be upstream's own adoption path: this probe does not know it.
            if (test is not None and names(test) & _SHARDED_MODEL_MARKERS
                    and not any(isinstance(s, ast.Raise) for s in body)):
                raise undecided("Accelerator.prepare_model", "only refusals among its tests of already-sharded models "
                                f"(this patch's broken shape; it tests {sorted(names(test) & _SHARDED_MODEL_MARKERS)} "
                                "and goes on) nor a known adoption path")
    for chain in if_chains(tree):
        for test, body in chain:
            # Known broken shape (every supported release): `elif self.distributed_type ==
            # DistributedType.MULTI_CPU:` and nothing else decides, then
            # `model = torch.nn.parallel.DistributedDataParallel(model, **kwargs)`.
            if (test is not None and "MULTI_CPU" in names(test) and names(test) <= _CPU_TEST
                    and body_calls(body, "DistributedDataParallel")):
                return Probe(True, "Accelerator.prepare_model DDP-wraps every model on CPU processes (MULTI_CPU), "
                                   "already-sharded ones included: no adoption path")
    raise undecided("Accelerator.prepare_model", "the DDP wrap of its MULTI_CPU branch (this patch's broken shape) "
                    "nor a known adoption path for already-sharded models")


_CPU_TEST = {"self", "distributed_type", "DistributedType", "MULTI_CPU"}
# Names a test of an already-sharded model would read: accelerate's DTensor check, the mesh and config transformers
# leaves on a model sharded while loading, FSDP2's module type.
_SHARDED_MODEL_MARKERS = {"model_has_dtensor", "DTensor", "device_mesh", upstream.MODEL_DEVICE_MESH_ATTRIBUTE,
                          "distributed_config", "is_distributed_loading_by_transformers", "FSDPModule"}


def _target(name: str) -> Target:
    return Target(_MODULE, f"Accelerator.{name}")


PATCH = Patch(
    id="accelerate-adopt-sharded-model",
    summary="Accelerator.prepare adopts sharded models: dp-rank data split, metrics, no_sync, clipping, optimizers",
    upstream="anticipates huggingface/accelerate (adopt models sharded by transformers DistributedConfig); "
             "huggingface/transformers#45662 (EP experts overwritten)",
    requires=supported("accelerate", "transformers"),
    wrappers={_target("__init__"): _init, _target("prepare_model"): _prepare_model,
              _target("prepare_data_loader"): _prepare_data_loader,
              _target("prepare_optimizer"): _prepare_optimizer, _target("clip_grad_norm_"): _clip_grad_norm_,
              _target("no_sync"): _no_sync, _target("gather_for_metrics"): _gather_for_metrics,
              _target("free_memory"): _free_memory, _target("maybe_context_parallel"): _maybe_context_parallel},
    probe=probe,
)
