"""The patches, one module each: a thin adapter from an upstream call into shardadopt's core.

Each module defines ``PATCH`` (a ``shardadopt.registry.Patch``) and must not import transformers, accelerate or
optuna at module level: the registry applies it when those are imported.
"""

from __future__ import annotations

from shardadopt.patches import (accelerate_adopt, accelerate_checkpoint, accelerate_cpu_parallelism, trainer_adopt,
                                trainer_checkpoint, trainer_hpo_optuna, transformers_ep_expert_grad_scale,
                                transformers_ep_grouped_mm, transformers_ep_router_grad, transformers_fsdp_tp_refused,
                                transformers_reuse_device_mesh, transformers_sharded_clean_exit,
                                transformers_sharding_sizes, transformers_tp_grad_accumulation)
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
    transformers_fsdp_tp_refused.PATCH,
    transformers_reuse_device_mesh.PATCH,
    transformers_sharded_clean_exit.PATCH,
]
