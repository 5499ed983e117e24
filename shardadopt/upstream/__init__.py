"""Every private upstream name shardadopt uses, each behind one named accessor.

torch, transformers, accelerate and optuna rename or drop private attributes between releases without notice. Here
each one is reached by a small function (or a constant naming it, for patch targets and probes that read upstream
source), whose docstring names the upstream object and the releases it was checked on; a missing name raises
:class:`UpstreamChanged` naming the accessor and the installed release instead of an ``AttributeError`` deep inside
training. ``tests/upstream/test_upstream_accessors.py`` runs every accessor against the installed upstream (so a rename
fails one test named after its accessor) and fails when code elsewhere in shardadopt spells a private upstream name.

"Checked on" ranges are the releases CI runs (torch 2.13.0/2.15.0, transformers 5.15.0/5.25.0, accelerate
1.13.0/1.16.0, optuna 4.5.0/5.1.0, peft 0.21.2/0.22.0, trl 1.16.0). Upstream modules are imported inside the
accessors, because
``shardadopt.enable()`` (which imports the patch modules, and so the constants here) must not import them.

One module per upstream library (``torch``, ``transformers``, ``accelerate``, ``peft``, ``trl``, ``optuna``,
``numpy``, ``python``; torch's context parallelism has its own, ``torch_context_parallel``), the one place the
private-name guard allows such names, so that a new release of a library is checked in its own files; this package
re-exports them all, so callers write ``upstream.<accessor>``.
"""

from __future__ import annotations

from shardadopt.upstream.accelerate import (
    PARALLELISM_CONFIG_VALIDATE_ACCELERATOR,
    accelerator_custom_objects,
    accelerator_dataloaders,
    accelerator_load_state_pre_hooks,
    accelerator_models,
    accelerator_optimizers,
    accelerator_save_state_pre_hooks,
    accelerator_schedulers,
    attach_context_parallel_hooks,
    is_accelerate_prepared,
    reset_accelerate_state,
    reset_accelerator_state,
    validate_parallelism_config,
)

# The accessors, re-exported: callers write ``upstream.<accessor>`` whichever library it reaches.
from shardadopt.upstream.base import (
    Target,
    UpstreamChanged,
    upstream_method,
)
from shardadopt.upstream.numpy import (
    array_reconstructor,
)
from shardadopt.upstream.optuna import (
    stale_trial_callback_keyword,
    study_storage,
    trial_id,
)
from shardadopt.upstream.peft import (
    PEFT_LORA_IN_OUT_FEATURES,
    PEFT_TP_PLAN_ATTRIBUTE,
    peft_in_out_features,
)
from shardadopt.upstream.python import (
    module_initializing,
    thread_frame,
)
from shardadopt.upstream.torch import (
    AGENT_STORE_CHECKS,
    COLLECTIVE_OP_NAMESPACES,
    DCP_METADATA_GLOBALS,
    DCP_METADATA_MODULE,
    DCP_READ_METADATA,
    LOCAL_SHARD_READERS,
    REDISTRIBUTE_BACKWARD,
    accelerator_type,
    backend_device_types,
    c10d_store_factory,
    clear_sharding_propagation_caches,
    compiled_original,
    compute_local_shape_and_global_offset,
    current_graph_task_id,
    dcp_metadata_path,
    default_group,
    default_store,
    device_has_foreach_support,
    dtensor_local,
    foreach_mul_,
    foreach_norm,
    fsdp_group_syncs_gradients,
    fsdp_lazy_init,
    fsdp_managed_parameters,
    fsdp_param_groups,
    group_tensors_by_device_and_dtype,
    group_timeout,
    has_foreach_support,
    module_backward_hooks,
    module_forward_pre_hooks,
    post_accumulate_grad_hooks,
    process_group_counter,
    pytree_flatten,
    queue_backward_callback,
    registered_process_groups,
    set_process_group_counter,
    strided_shard_type,
    torch_dispatch_mode,
    wait_functional_collective,
)
from shardadopt.upstream.torch_context_parallel import (
    CP_ATTENTION_MODULE,
    CP_DISABLE_DISPATCHER,
    CP_ENABLE_DISPATCHER,
    CP_SHARDING_RULES_MODULE,
    cp_custom_ops,
    cp_load_balanced,
    cp_register_sharding_rules,
    cp_single_dim_strategies,
    cp_strategy_context,
    cp_templated_ring_attention,
    cp_templated_ring_attention_backward,
    dtensor_custom_op_handlers,
    dtensor_op_dispatcher,
    expand_to_full_mesh_op_strategy,
    sdpa_flash_kernels,
    set_dtensor_custom_op_handlers,
    sharding_placeholder,
)
from shardadopt.upstream.transformers import (
    CLASS_TIED_WEIGHTS_ATTRIBUTE,
    CLASS_TP_PLAN_ATTRIBUTE,
    EMBEDDING_PARALLEL_PREPARE_INPUT,
    GENERATION_PREPARE_MULTIMODAL_ENCODER,
    GENERATION_SAMPLE,
    MAYBE_DISTRIBUTE_MODEL,
    MODEL_DEVICE_MESH_ATTRIBUTE,
    MODEL_SHARDING_SIZE_ATTRIBUTES,
    MOE_GROUPED_LINEAR,
    ROUTER_PARALLEL_PREPARE_OUTPUT,
    ROWWISE_PARALLEL_PREPARE_INPUT,
    ROWWISE_PARALLEL_PREPARE_OUTPUT,
    SAVE_MODEL_INTERNAL_CALL,
    TENSOR_PARALLEL_MODULE,
    TRAINER_LOAD_BEST_MODEL,
    TRAINER_LOAD_FROM_CHECKPOINT,
    TRAINER_LOAD_OPTIMIZER_AND_SCHEDULER,
    TRAINER_MODULE,
    TRAINER_MOVE_MODEL_TO_DEVICE,
    TRAINER_PREPARE_FOR_TRAINING,
    TRAINER_REPORT_TO_HP_SEARCH,
    TRAINER_SAVE_CHECKPOINT,
    TRAINER_SAVE_OPTIMIZER_AND_SCHEDULER,
    TRAINER_TARGETS,
    DistributeArguments,
    bind_maybe_distribute_model,
    experts_apply_gate,
    experts_implementation,
    experts_is_expert_parallel,
    from_config_constructor,
    is_mesh_manager,
    leave_out_of_trainer_replicated_sync,
    mesh_manager_meshes,
    model_device_mesh,
    model_mesh_manager,
    model_no_split_modules,
    module_hf_device_mesh,
    moe_can_use_grouped_mm,
    moe_grouped_linear,
    set_experts_expert_parallel,
    set_model_sharding_sizes,
    tp_layer_input_hook,
    tp_layer_output_hook,
    trainer_output_dir,
    trainer_push_from_checkpoint,
    trainer_replicated_sync,
    trainer_save_rng_state,
    trainer_save_scaler,
)
from shardadopt.upstream.trl import (
    DISTILLATION_COMPUTE_LOSS,
    DISTILLATION_PREPARE_INPUTS,
    DISTILLATION_TRAIN_SAMPLER,
    GRPO_PREPARE_INPUTS,
    GRPO_SCORE,
    RLOO_PREPARE_INPUTS,
    RLOO_SCORE,
)
