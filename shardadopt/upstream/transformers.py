"""transformers' private names: the Trainer's methods shardadopt replaces or probes, what ``from_pretrained(...,
distributed_config=...)`` sets on a model, the MoE and tensor-parallel internals. Checked on transformers 5.15-5.25."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardadopt.upstream.base import Target, attribute, module_attribute

if TYPE_CHECKING:
    import torch


TRAINER_MODULE = "transformers.trainer"
# Private Trainer methods shardadopt's patches replace or probe. Checked on transformers 5.15-5.25.
TRAINER_MOVE_MODEL_TO_DEVICE = Target(TRAINER_MODULE, "Trainer._move_model_to_device")
TRAINER_PREPARE_FOR_TRAINING = Target(TRAINER_MODULE, "Trainer._prepare_for_training")
TRAINER_SAVE_CHECKPOINT = Target(TRAINER_MODULE, "Trainer._save_checkpoint")
TRAINER_LOAD_FROM_CHECKPOINT = Target(TRAINER_MODULE, "Trainer._load_from_checkpoint")
TRAINER_LOAD_OPTIMIZER_AND_SCHEDULER = Target(TRAINER_MODULE, "Trainer._load_optimizer_and_scheduler")
TRAINER_LOAD_BEST_MODEL = Target(TRAINER_MODULE, "Trainer._load_best_model")
TRAINER_SAVE_OPTIMIZER_AND_SCHEDULER = Target(TRAINER_MODULE, "Trainer._save_optimizer_and_scheduler")
TRAINER_TARGETS = (TRAINER_MOVE_MODEL_TO_DEVICE, TRAINER_PREPARE_FOR_TRAINING, TRAINER_SAVE_CHECKPOINT,
                   TRAINER_LOAD_FROM_CHECKPOINT, TRAINER_LOAD_OPTIMIZER_AND_SCHEDULER, TRAINER_LOAD_BEST_MODEL,
                   TRAINER_SAVE_OPTIMIZER_AND_SCHEDULER)

# ``Trainer.save_model(output_dir, _internal_call=False)``'s private keyword. Checked on transformers 5.15-5.25.
SAVE_MODEL_INTERNAL_CALL = "_internal_call"

# Attributes ``from_pretrained(..., distributed_config=...)`` sets on a model, as probes find them in upstream
# source: the device mesh, and the sharding degrees. Checked on transformers 5.15-5.25.
MODEL_DEVICE_MESH_ATTRIBUTE = "_device_mesh"
MODEL_SHARDING_SIZE_ATTRIBUTES = ("_tp_size", "_fsdp_size")

# Class attributes a model class declares its TP plan and its tied weights with (``LlamaForCausalLM._tp_plan =
# {"lm_head": "colwise_gather_output"}``, ``_tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}``),
# as a probe reads them in a class body of upstream source. Checked on transformers 5.15-5.25.
CLASS_TP_PLAN_ATTRIBUTE = "_tp_plan"
CLASS_TIED_WEIGHTS_ATTRIBUTE = "_tied_weights_keys"

# The name of transformers' grouped GEMM helper that ``grouped_mm_experts_forward`` calls, as a probe finds it in
# upstream source (``transformers.integrations.moe._grouped_linear``). Checked on transformers 5.15-5.25.
MOE_GROUPED_LINEAR = "_grouped_linear"


def trainer_output_dir(trainer: Any, trial: Any) -> str:
    """``Trainer._get_output_dir(trial=trial)``: the run directory checkpoints go to (per trial under HPO).
    Checked on transformers 5.15-5.25."""
    return attribute(trainer, "_get_output_dir", "trainer_output_dir", "transformers")(trial=trial)


def trainer_save_scaler(trainer: Any, output_dir: str) -> None:
    """``Trainer._save_scaler(output_dir)``: the grad scaler's state. Checked on transformers 5.15-5.25."""
    attribute(trainer, "_save_scaler", "trainer_save_scaler", "transformers")(output_dir)


def trainer_save_rng_state(trainer: Any, output_dir: str) -> None:
    """``Trainer._save_rng_state(output_dir)``: this process's RNG states. Checked on transformers 5.15-5.25."""
    attribute(trainer, "_save_rng_state", "trainer_save_rng_state", "transformers")(output_dir)


def trainer_push_from_checkpoint(trainer: Any, checkpoint_dir: str) -> None:
    """``Trainer._push_from_checkpoint(checkpoint_dir)``: the hub upload of a saved checkpoint. Checked on
    transformers 5.15-5.25."""
    attribute(trainer, "_push_from_checkpoint", "trainer_push_from_checkpoint", "transformers")(checkpoint_dir)


def model_device_mesh(model: Any) -> Any:
    """``PreTrainedModel._device_mesh``: the mesh a model was sharded on at load time; None (the class default) for
    a model loaded without ``distributed_config``. Checked on transformers 5.15-5.25."""
    return getattr(model, MODEL_DEVICE_MESH_ATTRIBUTE, None)


def model_mesh_manager(model: Any) -> Any:
    """``PreTrainedModel._mesh_manager``: the ``TransformersDeviceMesh`` (dense and expert meshes) of a model
    sharded at load time; None for other models, and on releases before 5.19 (which have none). Checked on
    transformers 5.15-5.25."""
    return getattr(model, "_mesh_manager", None)


def is_mesh_manager(obj: Any) -> bool:
    """Whether ``obj`` is a ``transformers.distributed.utils.TransformersDeviceMesh`` (False on releases without
    that class). Checked on transformers 5.15-5.25."""
    try:
        from transformers.distributed.utils import TransformersDeviceMesh
    except ImportError:
        return False
    return isinstance(obj, TransformersDeviceMesh)


def mesh_manager_meshes(manager: Any) -> tuple[Any, Any]:
    """``(TransformersDeviceMesh._dense_mesh, TransformersDeviceMesh._expert_mesh)``: the (pp, [dp_replicate,]
    fsdp, tp) and (pp, [dp_replicate,] efsdp, ep) meshes (the class exists from 5.19). Checked on transformers
    5.24-5.25."""
    return (attribute(manager, "_dense_mesh", "mesh_manager_meshes", "transformers"),
            attribute(manager, "_expert_mesh", "mesh_manager_meshes", "transformers"))


def set_model_sharding_sizes(model: Any, tp_size: int, fsdp_size: int) -> None:
    """Set ``PreTrainedModel._tp_size`` / ``_fsdp_size``, the degrees its ``tp_size`` / ``fsdp_size`` properties
    return. Checked on transformers 5.15-5.25 (a plain attribute write: nothing to be missing)."""
    tp_name, fsdp_name = MODEL_SHARDING_SIZE_ATTRIBUTES
    setattr(model, tp_name, tp_size)
    setattr(model, fsdp_name, fsdp_size)


def from_config_constructor(model_class: type) -> Callable[..., Any] | None:
    """``PreTrainedModel._from_config``: builds a model from a config honouring the dtype/attention settings;
    None for a class that is not a transformers model. Checked on transformers 5.15-5.25."""
    return getattr(model_class, "_from_config", None)


def experts_is_expert_parallel(experts: Any) -> bool | None:
    """``experts._is_expert_parallel``: whether transformers sharded an experts module by expert; None when unset
    (releases before 5.18 never set it). Checked on transformers 5.15-5.25."""
    return getattr(experts, "_is_expert_parallel", None)


def set_experts_expert_parallel(experts: Any, flag: bool) -> None:
    """Set ``experts._is_expert_parallel`` (read by transformers >= 5.18; earlier releases ignore it)."""
    experts._is_expert_parallel = flag


def experts_apply_gate(experts: Any, projected: torch.Tensor) -> torch.Tensor:
    """``experts._apply_gate(projected)``: the gated activation of a gate+up projection. Checked on transformers
    5.15-5.25."""
    return attribute(experts, "_apply_gate", "experts_apply_gate", "transformers")(projected)


def moe_grouped_linear() -> Callable[..., torch.Tensor]:
    """``transformers.integrations.moe._grouped_linear``: the grouped GEMM (kernel choice included) that
    ``grouped_mm_experts_forward`` calls. Checked on transformers 5.15-5.25."""
    return module_attribute("transformers.integrations.moe", MOE_GROUPED_LINEAR, "moe_grouped_linear", "transformers")


def moe_can_use_grouped_mm(hidden: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> bool:
    """``transformers.integrations.moe._can_use_grouped_mm``: whether ``_grouped_linear`` runs torch's grouped_mm
    kernel for these operands (else its fallback loop). Checked on transformers 5.15-5.25."""
    return module_attribute("transformers.integrations.moe", "_can_use_grouped_mm", "moe_can_use_grouped_mm",
                             "transformers")(hidden, weight, offsets)


def module_hf_device_mesh(module: torch.nn.Module) -> Any:
    """``module._hf_device_mesh``: the mesh transformers 5.15's tensor parallelism records on the modules it shards;
    None where it is unset (other modules; 5.16 and later never set it). Checked on transformers 5.15-5.25."""
    return getattr(module, "_hf_device_mesh", None)


# ``Trainer._report_to_hp_search(trial, step, metrics)``, which ``trainer-hpo-optuna`` wraps. Checked on transformers
# 5.15-5.25.
TRAINER_REPORT_TO_HP_SEARCH = Target(TRAINER_MODULE, "Trainer._report_to_hp_search")

# ``GenerationMixin._sample``, the decoding loop whose ``torch.multinomial`` draws the sampled tokens, which the
# ``transformers-tp-sampling-agreement`` probe reads. Checked on transformers 5.15-5.25.
GENERATION_SAMPLE = Target("transformers.generation.utils", "GenerationMixin._sample")

# ``GenerationMixin._prepare_multimodal_encoder_kwargs_for_generation(model_kwargs)``: generate's encoding of the
# images / videos (``base_model.get_image_features``) before the prefill, which
# ``transformers-fsdp-generate-encoder-unshard`` wraps; absent in 5.15 (the forward encodes them). Checked on
# transformers 5.15-5.25.
GENERATION_PREPARE_MULTIMODAL_ENCODER = Target("transformers.generation.utils",
                                               "GenerationMixin._prepare_multimodal_encoder_kwargs_for_generation")

# transformers 5.15's local-tensor tensor-parallel layers and their forward hooks, which
# ``transformers-ep-router-grad`` and ``transformers-tp-legacy-layers`` wrap; 5.16 replaced them with DTensor layers
# without these hooks (the targets are missing there). Checked on transformers 5.15-5.25.
TENSOR_PARALLEL_MODULE = "transformers.integrations.tensor_parallel"
ROUTER_PARALLEL_PREPARE_OUTPUT = Target(TENSOR_PARALLEL_MODULE, "RouterParallel._prepare_output_fn")
EMBEDDING_PARALLEL_PREPARE_INPUT = Target(TENSOR_PARALLEL_MODULE, "EmbeddingParallel._prepare_input_fn")
ROWWISE_PARALLEL_PREPARE_INPUT = Target(TENSOR_PARALLEL_MODULE, "RowwiseParallel._prepare_input_fn")
ROWWISE_PARALLEL_PREPARE_OUTPUT = Target(TENSOR_PARALLEL_MODULE, "RowwiseParallel._prepare_output_fn")



def tp_layer_input_hook(layer_class: type | None) -> Any:
    """``layer_class._prepare_input_fn`` as the class defines it (``inspect.getattr_static``: no descriptor runs):
    the input hook of transformers 5.15's local-tensor TP layers; None for a layer without one (the DTensor layers of
    5.16 and later) or no class. Checked on transformers 5.15-5.25."""
    import inspect

    return inspect.getattr_static(layer_class, "_prepare_input_fn", None) if layer_class is not None else None


def tp_layer_output_hook(layer: Any) -> Callable[..., Any] | None:
    """``layer._prepare_output_fn`` (``layer`` a TP layer class or instance): the output hook of transformers 5.15's
    local-tensor TP layers, bound for an instance; None for a layer without one (5.16 and later) or None. Checked on
    transformers 5.15-5.25."""
    return getattr(layer, "_prepare_output_fn", None)


# -- the Trainer's own sync of replicated trainable parameters (transformers 5.25+) ---------------------------------

# ``Trainer._sync_replicated_trainable_parameters`` hooks every trainable plain (non-DTensor) parameter of a model
# sharded at load time once, and marks it with this attribute so that a second ``train()`` does not hook it again.
_TRAINER_REPLICATED_HOOK_FLAG = "_replicated_grad_hook_registered"


def trainer_replicated_sync() -> Callable[..., Any] | None:
    """``Trainer._sync_replicated_trainable_parameters``: the Trainer's broadcast of rank 0's trainable plain
    parameters and all-rank average of their gradients (transformers 5.25); None on releases without it. Checked on
    transformers 5.15-5.25."""
    from transformers import Trainer

    return getattr(Trainer, "_sync_replicated_trainable_parameters", None)


def leave_out_of_trainer_replicated_sync(param: Any) -> None:
    """Mark ``param`` as already hooked for :func:`trainer_replicated_sync`, so that the Trainer adds no gradient
    average of its own (it still broadcasts rank 0's value, which a laid-out adapter already holds). Harmless on
    releases without that sync. Checked on transformers 5.25."""
    setattr(param, _TRAINER_REPLICATED_HOOK_FLAG, True)


def experts_implementation(config: Any) -> str | None:
    """``config._experts_implementation``: the experts kernel a model was loaded with (``experts_implementation=`` of
    ``from_pretrained``: "grouped_mm", "deepgemm_megamoe", ...), None when unset or absent. Checked on transformers
    5.15-5.25."""
    return getattr(config, "_experts_implementation", None)


def model_no_split_modules(model: Any) -> list[str] | None:
    """``PreTrainedModel._no_split_modules``: the class names of a model's blocks that must stay whole (what
    accelerate's FSDP auto-wrap and ``device_map`` keep together); None for a module that is not a transformers
    model or declares none. Checked on transformers 5.15-5.25."""
    return getattr(model, "_no_split_modules", None)


# The classmethod ``from_pretrained(..., distributed_config=...)`` shards a freshly built model with (before any
# weight is read): ``DistributedMixin.maybe_distribute_model(model, distributed_config, <mesh>)``, wrapped by six
# patches. Its third parameter is ``device_mesh`` (a ``DeviceMesh``) in 5.15 .. 5.17 and ``mesh_manager`` (a
# ``TransformersDeviceMesh``) from 5.18 on; None for a load that shards nothing. Checked on transformers 5.15-5.25.
MAYBE_DISTRIBUTE_MODEL = Target("transformers.distributed.mixin", "DistributedMixin.maybe_distribute_model")


@dataclass(frozen=True)
class DistributeArguments:
    """One call of :data:`MAYBE_DISTRIBUTE_MODEL`, by meaning: whatever upstream names the mesh parameter."""

    model: Any
    distributed_config: Any
    mesh: Any  # 5.15 .. 5.17: device_mesh; 5.18+: mesh_manager; None: nothing is sharded

    @property
    def shards(self) -> bool:
        """Whether this call shards the model (upstream returns it untouched without a mesh)."""
        return self.mesh is not None


def bind_maybe_distribute_model(wrapped: Callable[..., Any], args: tuple, kwargs: dict) -> DistributeArguments:
    """The arguments of a ``maybe_distribute_model`` call as a wrapt wrapper receives them, bound by the wrapped
    function's own signature (positional or keyword, any release's parameter names).

    Args:
        wrapped: the (bound) ``maybe_distribute_model`` a wrapper was given, possibly wrapped by other patches.
        args: the call's positional arguments.
        kwargs: its keyword arguments.

    Returns:
        The model, the distributed config and the mesh (upstream's third parameter).

    Raises:
        TypeError: the arguments do not fit the signature (as the call itself would raise).
    """
    signature = inspect.signature(wrapped)
    named = [p.name for p in signature.parameters.values()
             if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)][:3]
    if len(named) < 3:  # a stand-in that takes (*args, **kwargs): upstream's order and the releases' names
        values = dict(zip(_DISTRIBUTE_PARAMETERS, args)) | kwargs
        mesh = next((values[name] for name in _MESH_PARAMETERS if name in values), None)
        return DistributeArguments(values.get("model"), values.get("distributed_config"), mesh)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    model, config, mesh = (bound.arguments.get(name) for name in named)
    return DistributeArguments(model, config, mesh)


# maybe_distribute_model's parameters, the mesh under each release's name (5.15 .. 5.17, 5.18+)
_MESH_PARAMETERS = ("device_mesh", "mesh_manager")
_DISTRIBUTE_PARAMETERS = ("model", "distributed_config", "device_mesh")
