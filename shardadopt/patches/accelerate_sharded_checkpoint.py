"""``Accelerator.save_state`` / ``load_state`` / ``get_state_dict`` / ``save_model`` for sharded models.

Upstream (every supported accelerate, ``accelerate/accelerator.py``): outside accelerate's own FSDP/DeepSpeed/Megatron
plugins, ``save_state`` saves each model as one local state dict::

    else:
        weights.append(self.get_state_dict(model, unwrap=False))

and ``get_state_dict`` returns ``model.state_dict()``. For a model sharded at load time (``from_pretrained(...,
distributed_config=...)``) or by hand (``fully_shard`` / ``parallelize_module``) those are DTensor shards: writing
them fails ("Attempted to access the data pointer on an invalid python storage"), the optimizer state is saved
per rank as if replicated, and ``save_model`` / ``get_state_dict`` give shards, not full tensors.

The fix (``shardadopt.checkpoint.accelerator``), only when a prepared model is sharded and accelerate's own plugins
do not manage it (plain models, and FSDP/DeepSpeed plugin runs, keep upstream's exact path):

- ``save_state``: models and optimizers through ``torch.distributed.checkpoint`` (``shardadopt.checkpoint``), the
  rest (schedulers, dataloader/sampler state, RNG per process, scaler, custom objects, ``step``) with
  accelerate's own writers, all into a staging directory published atomically with a completion marker.
  ``automatic_checkpoint_naming`` and ``total_limit`` behave as upstream, counting complete checkpoints only.
- ``load_state``: refuses a partial checkpoint, states whether the layout matches (resharding through DCP when
  the world size or ``DistributedConfig`` differs), and restores everything ``save_state`` wrote.
- ``get_state_dict``: full CPU tensors on the main process (``{}`` elsewhere), gathered one parameter at a time,
  as accelerate's FSDP2 path does.
- ``save_model``: safetensors streamed one parameter at a time by ``shardadopt.checkpoint.save_full``.
"""

from __future__ import annotations

from shardadopt.patching.contract import Patch, Probe, Target
from shardadopt.upstream.versions import supported

_MODULE = "accelerate.accelerator"


def save_state(wrapped, instance, args, kwargs):
    from shardadopt.checkpoint import accelerator as core

    if not core.manages(instance):
        return wrapped(*args, **kwargs)
    return core.save_state(instance, *args, **kwargs)


def load_state(wrapped, instance, args, kwargs):
    from shardadopt.checkpoint import accelerator as core

    if not core.manages(instance):
        return wrapped(*args, **kwargs)
    return core.load_state(instance, *args, **kwargs)


def get_state_dict(wrapped, instance, args, kwargs):
    from shardadopt.checkpoint import accelerator as core

    model = args[0] if args else kwargs["model"]
    if not core.manages_model(instance, model):
        return wrapped(*args, **kwargs)
    return core.get_state_dict(model)


def save_model(wrapped, instance, args, kwargs):
    from shardadopt.checkpoint import accelerator as core

    model = args[0] if args else kwargs["model"]
    safe = kwargs.get("safe_serialization", args[3] if len(args) > 3 else True)
    if not core.manages_model(instance, model) or not safe:
        # pickle format: upstream's writer over the (patched) full get_state_dict
        return wrapped(*args, **kwargs)
    directory = args[1] if len(args) > 1 else kwargs["save_directory"]
    max_shard_size = kwargs.get("max_shard_size", args[2] if len(args) > 2 else "10GB")
    core.save_model(model, directory, max_shard_size)


# The tests of the if-chains that pick accelerate's own FSDP/DeepSpeed/Megatron/XLA savers: the known broken shape
# (every supported release) is such a chain whose final `else` saves the model as a local state dict.
_PLUGIN_TEST = {"self", "distributed_type", "DistributedType", "DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA", "is_fsdp2"}


def _local_fallback(function, call: str, where: str) -> bool:
    """Whether ``function`` has an if-chain over accelerate's plugins only, whose ``else`` calls ``call``."""
    from accelerate.accelerator import Accelerator

    from shardadopt.upstream.probing import body_calls, if_chains, names, source_tree, upstream_function

    tree = source_tree(upstream_function(Accelerator, function, where))
    return any(chain[-1][0] is None and body_calls(chain[-1][1], call)
               and all(names(test) <= _PLUGIN_TEST for test, _ in chain[:-1]) for chain in if_chains(tree))


def probe() -> Probe:
    """Read ``Accelerator.get_state_dict`` and ``save_state``: outside the plugins, both take the local state dict."""
    from shardadopt.upstream.probing import undecided

    where = "accelerate-sharded-checkpoint probe"
    if _local_fallback("get_state_dict", "state_dict", where) and _local_fallback("save_state", "get_state_dict",
                                                                                   where):
        return Probe(True, "accelerate's save_state/get_state_dict treat a sharded model's DTensor shards as a local "
                           "state dict outside its FSDP plugin")
    raise undecided("Accelerator.get_state_dict / save_state", "the plain model.state_dict() fallback after the "
                    "FSDP/DeepSpeed/Megatron branches (this patch's broken shape) nor a known save path for models "
                    "sharded outside those plugins")


PATCH = Patch(
    id="accelerate-sharded-checkpoint",
    summary="save_state/load_state (atomic, resumable DCP), get_state_dict/save_model (full tensors) for "
            "sharded models",
    upstream="anticipates huggingface/accelerate: DCP checkpoints for models sharded outside accelerate's plugins",
    requires=supported("accelerate", "transformers"),
    wrappers={
        Target(_MODULE, "Accelerator.save_state"): save_state,
        Target(_MODULE, "Accelerator.load_state"): load_state,
        Target(_MODULE, "Accelerator.get_state_dict"): get_state_dict,
        Target(_MODULE, "Accelerator.save_model"): save_model,
    },
    probe=probe,
    # A sharded model reaches save_state only adopted (prepare DDP-wraps it otherwise), and load_state reads the
    # AdoptionKwargs that only the adoption patch records.
    depends_on=("accelerate-adopt-sharded-model",),
)
