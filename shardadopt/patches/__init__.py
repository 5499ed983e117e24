"""The patches, one module each: a thin adapter from an upstream call into shardadopt's core.

Each module defines ``PATCH`` (a ``shardadopt.registry.Patch``) and must not import transformers, accelerate or
optuna at module level: the registry applies it when those are imported.
"""

from __future__ import annotations

from shardadopt.patches import accelerate_adopt, accelerate_cpu_parallelism
from shardadopt.patches import accelerate_checkpoint, trainer_adopt, trainer_checkpoint
from shardadopt.patches import transformers_ep_grouped_mm, transformers_ep_router_grad, transformers_sharding_sizes
from shardadopt.patches import trainer_hpo_optuna
from shardadopt.patches import transformers_tp_grad_accumulation
from shardadopt.patches import transformers_ep_expert_grad_scale
from shardadopt.registry import Patch

ALL_PATCHES: list[Patch] = [
    transformers_sharding_sizes.PATCH,
    transformers_ep_grouped_mm.PATCH,
    transformers_ep_router_grad.PATCH,
    accelerate_cpu_parallelism.PATCH,
    accelerate_adopt.PATCH,
    accelerate_checkpoint.PATCH,
    trainer_adopt.PATCH,
    trainer_checkpoint.PATCH,
    trainer_hpo_optuna.PATCH,
    transformers_tp_grad_accumulation.PATCH,
    transformers_ep_router_grad.PATCH_POST_FORWARD,
    transformers_ep_expert_grad_scale.PATCH,
]
