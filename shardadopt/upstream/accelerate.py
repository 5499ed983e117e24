"""accelerate's private names: the ``Accelerator``'s registries and state singletons, and the patch targets in
accelerate. Checked on accelerate 1.13-1.16."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardadopt.upstream.base import Target, attribute


def accelerator_models(accelerator: Any) -> list[Any]:
    """``Accelerator._models``: the list ``prepare()`` appends models to (mutable: appending registers a model).
    Checked on accelerate 1.13-1.16."""
    return attribute(accelerator, "_models", "accelerator_models", "accelerate")


def accelerator_optimizers(accelerator: Any) -> list[Any]:
    """``Accelerator._optimizers``: the prepared (wrapped) optimizers. Checked on accelerate 1.13-1.16."""
    return attribute(accelerator, "_optimizers", "accelerator_optimizers", "accelerate")


def accelerator_schedulers(accelerator: Any) -> list[Any]:
    """``Accelerator._schedulers``: the prepared schedulers. Checked on accelerate 1.13-1.16."""
    return attribute(accelerator, "_schedulers", "accelerator_schedulers", "accelerate")


def accelerator_dataloaders(accelerator: Any) -> list[Any]:
    """``Accelerator._dataloaders``: the prepared dataloaders. Checked on accelerate 1.13-1.16."""
    return attribute(accelerator, "_dataloaders", "accelerator_dataloaders", "accelerate")


def accelerator_custom_objects(accelerator: Any) -> list[Any]:
    """``Accelerator._custom_objects``: what ``register_for_checkpointing`` registered. Checked on accelerate
    1.13-1.16."""
    return attribute(accelerator, "_custom_objects", "accelerator_custom_objects", "accelerate")


def accelerator_save_state_pre_hooks(accelerator: Any) -> dict[Any, Callable[..., Any]]:
    """``Accelerator._save_model_state_pre_hook``: handle -> hook, from ``register_save_state_pre_hook``. Checked
    on accelerate 1.13-1.16."""
    return attribute(accelerator, "_save_model_state_pre_hook", "accelerator_save_state_pre_hooks", "accelerate")


def accelerator_load_state_pre_hooks(accelerator: Any) -> dict[Any, Callable[..., Any]]:
    """``Accelerator._load_model_state_pre_hook``: handle -> hook, from ``register_load_state_pre_hook``. Checked
    on accelerate 1.13-1.16."""
    return attribute(accelerator, "_load_model_state_pre_hook", "accelerator_load_state_pre_hooks", "accelerate")


def is_accelerate_prepared(obj: Any) -> bool:
    """``obj._is_accelerate_prepared``: the flag ``Accelerator.prepare`` sets on models and dataloaders it prepared
    (unset, so False, on anything it did not). Checked on accelerate 1.13-1.16."""
    return bool(getattr(obj, "_is_accelerate_prepared", False))


def reset_accelerate_state() -> None:
    """``AcceleratorState._reset_state(reset_partial_state=True)`` and ``GradientState._reset_state()``: forget the
    process-wide accelerate singletons, so the next ``Accelerator()`` reads its configuration afresh. Checked on
    accelerate 1.13-1.16."""
    from accelerate.state import AcceleratorState, GradientState

    attribute(AcceleratorState, "_reset_state", "reset_accelerate_state", "accelerate")(reset_partial_state=True)
    attribute(GradientState, "_reset_state", "reset_accelerate_state", "accelerate")()


def reset_accelerator_state() -> None:
    """``AcceleratorState._reset_state()``: forget accelerate's process-wide accelerator state (its
    ``ParallelismConfig`` and plugins) but keep the process state (``PartialState``: ranks and backend), so the
    next ``Accelerator()`` takes its own ``parallelism_config``. Checked on accelerate 1.13-1.16."""
    from accelerate.state import AcceleratorState

    attribute(AcceleratorState, "_reset_state", "reset_accelerator_state", "accelerate")()


# ``ParallelismConfig._validate_accelerator(accelerator)``, which ``accelerate-cpu-parallelism-config`` wraps.
# Checked on accelerate 1.13-1.16.
PARALLELISM_CONFIG_VALIDATE_ACCELERATOR = Target("accelerate.parallelism_config",
                                                 "ParallelismConfig._validate_accelerator")




def validate_parallelism_config(config: Any, accelerator: Any) -> None:
    """``ParallelismConfig._validate_accelerator(accelerator)``: accelerate's check that ``accelerator`` can run
    ``config`` (raises ``ValueError`` when it cannot). Checked on accelerate 1.13-1.16."""
    attribute(config, "_validate_accelerator", "validate_parallelism_config", "accelerate")(accelerator)


def attach_context_parallel_hooks(model: Any) -> None:
    """``accelerate.big_modeling._attach_context_parallel_hooks(model)``: what ``Accelerator.prepare`` runs on a
    model under context parallelism (refuses a model whose ``supports_context_parallel`` is False; drops each
    ``self_attn``'s attention mask for ``is_causal=True``). Checked on accelerate 1.16."""
    from shardadopt.upstream.base import module_attribute

    module_attribute("accelerate.big_modeling", "_attach_context_parallel_hooks", "attach_context_parallel_hooks",
                      "accelerate")(model)
