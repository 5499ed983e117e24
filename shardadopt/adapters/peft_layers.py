"""Where peft keeps adapters on a model: the transformers model under its wrappers, its LoRA layers, an adapter's
trainable modules, and whether shardadopt laid an adapter out yet.

The laid-out mark sits on an adapter's ``lora_A`` module, not on its name: ``delete_adapter`` then ``add_adapter``
under the same name brings new factors, which must be laid out again.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

from torch import nn

from shardadopt.parallel.topology import topology

_LAID_OUT = "_shardadopt_laid_out"


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model under peft's ``PeftModel`` / tuner wrappers (``model`` itself when unwrapped)."""
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTuner

    while isinstance(model, (PeftModel, BaseTuner)):
        model = model.base_model if isinstance(model, PeftModel) else model.model
    return model


def is_sharded_base(model: nn.Module) -> bool:
    """Whether the transformers model under ``model``'s peft wrappers is sharded.

    Args:
        model: a transformers model, or peft's tuner or ``PeftModel`` around one.

    Returns:
        True when its topology is sharded (FSDP2, TP or EP meshes).
    """
    return topology(unwrap_peft(model)).is_sharded


def lora_layers(model: nn.Module) -> Iterator[tuple[str, Any]]:
    """``(name, layer)`` for every peft ``LoraLayer`` in ``model``."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


def adapter_modules(layer: Any, adapter: str) -> list[nn.Module]:
    """The trainable modules of ``adapter`` on ``layer``: its LoRA factors and, with DoRA, its magnitude vector
    (one entry per output feature)."""
    modules = [layer.lora_A[adapter], layer.lora_B[adapter]]
    if adapter in layer.lora_magnitude_vector:
        modules.append(layer.lora_magnitude_vector[adapter])
    return modules


def is_laid_out(layer: Any, adapter: str) -> bool:
    """Whether shardadopt laid out ``adapter`` on ``layer`` (:func:`mark_laid_out`)."""
    return bool(layer.lora_A[adapter].__dict__.get(_LAID_OUT))


def mark_laid_out(layer: Any, adapter: str) -> None:
    """Record on ``adapter``'s ``lora_A`` module that its factors are laid out."""
    layer.lora_A[adapter].__dict__[_LAID_OUT] = True


def peft_configs(model: nn.Module) -> dict[str, Any]:
    """adapter name -> ``LoraConfig``, from whichever peft wrapper holds them (empty for a bare transformers
    model)."""
    return dict(getattr(model, "peft_config", None) or {})


def adapter_parameters(model: nn.Module) -> set[int]:
    """The parameters peft holds per adapter in ``model``, active or not: what an adapter run trains, at one time or
    another, as opposed to the frozen base (what an adapter checkpoint keeps).

    Args:
        model: any module; peft's tuner layers and auxiliary wrappers inside it are searched.

    Returns:
        The ``id`` of every LoRA factor, DoRA magnitude, ``modules_to_save`` copy and trainable-token parameter;
        empty when peft is not imported.
    """
    if "peft" not in sys.modules:
        return set()
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    found: set[int] = set()
    for module in model.modules():
        if isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper)):
            for name in module.adapter_layer_names:  # dotted for trainable tokens: "token_adapter.<dict>"
                holder: Any = module
                for part in name.split("."):
                    holder = getattr(holder, part, None)
                if isinstance(holder, nn.Module):
                    found.update(id(p) for p in holder.parameters())
    return found
