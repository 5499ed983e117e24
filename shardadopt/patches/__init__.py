"""The patches, one module each: a thin adapter from an upstream call into shardadopt's core.

Each module is named after its patch id (``-`` -> ``_``), defines ``PATCH`` (a ``shardadopt.patching.registry.Patch``)
and must not import transformers, accelerate or optuna at module level: the registry applies it when those are imported.
"""

from __future__ import annotations

from shardadopt.patches import (
                                accelerate_adopt_sharded_model,
                                accelerate_cpu_parallelism_config,
                                accelerate_sharded_checkpoint,
                                peft_sharded_adapters,
                                torch_cp_cpu_flash_attention,
                                torch_dcp_metadata_restricted,
                                torch_dtensor_redistribute_no_grad,
                                torch_elastic_attempt_store,
                                trainer_adopt_sharded_model,
                                trainer_hpo_optuna,
                                trainer_model_init_parallelism,
                                trainer_sharded_checkpoint,
                                transformers_ep_expert_grad_scale,
                                transformers_ep_grouped_mm_sentinel,
                                transformers_ep_router_grad,
                                transformers_ep_router_grad_post_forward,
                                transformers_fsdp_generate_encoder_unshard,
                                transformers_fsdp_plan_unmatched_units,
                                transformers_fsdp_tp_refused,
                                transformers_fused_weight_sharding,
                                transformers_reuse_device_mesh,
                                transformers_sharded_clean_exit,
                                transformers_sharded_transpose_check,
                                transformers_sharding_sizes,
                                transformers_tp_heads_refused,
                                transformers_tp_legacy_layers,
                                transformers_tp_partial_grad,
                                transformers_tp_replicated_grad_accumulation,
                                transformers_tp_sampling_agreement,
                                transformers_tp_tied_lm_head,
                                trl_distillation_data_parallel,
                                trl_distillation_plain_tp_head,
                                trl_grpo_data_parallel,
                                trl_rloo_data_parallel,
)
from shardadopt.patching.registry import Patch, Registry, make_process_wide, process_wide

ALL_PATCHES: list[Patch] = [
    transformers_sharding_sizes.PATCH,
    transformers_ep_grouped_mm_sentinel.PATCH,
    transformers_ep_router_grad.PATCH,
    accelerate_cpu_parallelism_config.PATCH,
    accelerate_adopt_sharded_model.PATCH,
    accelerate_sharded_checkpoint.PATCH,
    trainer_adopt_sharded_model.PATCH,
    trainer_sharded_checkpoint.PATCH,
    trainer_hpo_optuna.PATCH,
    trainer_model_init_parallelism.PATCH,
    transformers_tp_replicated_grad_accumulation.PATCH,
    transformers_tp_partial_grad.PATCH,
    transformers_tp_legacy_layers.PATCH,
    transformers_fused_weight_sharding.PATCH,
    transformers_sharded_transpose_check.PATCH,
    transformers_ep_router_grad_post_forward.PATCH,
    transformers_ep_expert_grad_scale.PATCH,
    transformers_fsdp_tp_refused.PATCH,
    transformers_reuse_device_mesh.PATCH,
    transformers_sharded_clean_exit.PATCH,
    peft_sharded_adapters.PATCH,
    transformers_tp_sampling_agreement.PATCH,
    torch_elastic_attempt_store.PATCH,
    transformers_fsdp_plan_unmatched_units.PATCH,
    transformers_fsdp_generate_encoder_unshard.PATCH,
    transformers_tp_heads_refused.PATCH,
    torch_dtensor_redistribute_no_grad.PATCH,
    trl_grpo_data_parallel.PATCH,
    trl_rloo_data_parallel.PATCH,
    transformers_tp_tied_lm_head.PATCH,
    trl_distillation_data_parallel.PATCH,
    trl_distillation_plain_tp_head.PATCH,
    torch_dcp_metadata_restricted.PATCH,
    torch_cp_cpu_flash_attention.PATCH,
]


def process_registry() -> Registry:
    """The registry of every patch shardadopt ships, created once per process; ``shardadopt.enable()``,
    ``disable()`` and ``status()`` drive it.

    Returns:
        The process-wide registry.
    """
    return process_wide() or make_process_wide(Registry(ALL_PATCHES))
