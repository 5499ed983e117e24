"""accelerate adopts a model that is already sharded (at load time by transformers, or by hand).

``Accelerator.prepare`` knows how to shard a plain model; a model that arrives sharded needs the opposite: leave it
exactly as it is and make everything around it follow its topology. :func:`adopt_model` does that and is what
``shardadopt.enable()`` routes ``prepare_model`` to; the other functions here are the pieces, usable without any
patching:

- the model (``model``): no DDP wrap, no re-sharding, no ``.to()``; refused when it cannot train like one process
  (``refusals``);
- data (``data``): loaders prepared by the same accelerator are split by data-parallel rank only
  (:func:`shard_dataloader`), dispatching loaders dispatch per data-parallel group (:class:`DataParallelSource`);
- metrics (``metrics``): :func:`gather_for_metrics` keeps one copy of each sample;
- accumulation and clipping (``training``): :func:`no_sync`, :func:`clip_grad_norm_` over any mix of meshes;
- optimizers: :func:`shardadopt.parallel.optim.split_param_groups_by_mesh`;
- frozen FSDP2 units (``frozen_units``): :func:`keep_frozen_units_gathered`, one all-gather per unit per step.

Configuration: :class:`AdoptionKwargs` in ``Accelerator(kwargs_handlers=[...])`` (``record``); defaults need none.
"""

from shardadopt.adopt.data import DataParallelSource, dispatch_per_mesh_dp_group, shard_dataloader
from shardadopt.adopt.frozen_units import frozen_units, keep_frozen_units_gathered
from shardadopt.adopt.metrics import gather_for_metrics
from shardadopt.adopt.model import adopt_model, is_sharded_model
from shardadopt.adopt.record import AdoptionError, AdoptionKwargs, adopted, adoption_kwargs
from shardadopt.adopt.refusals import (
    plain_head_shard,
    refuse_distillation_heads_on_plain_shards,
    refuse_fused_lm_head_on_plain_shards,
    refuse_unsupported_distributed_features,
    refuse_whole_model_for_dp_shard,
)
from shardadopt.adopt.training import clip_grad_norm_, no_sync

__all__ = ["AdoptionKwargs", "AdoptionError", "DataParallelSource", "adopt_model", "adopted", "adoption_kwargs",
           "dispatch_per_mesh_dp_group", "is_sharded_model", "plain_head_shard",
           "refuse_distillation_heads_on_plain_shards", "refuse_fused_lm_head_on_plain_shards",
           "refuse_unsupported_distributed_features", "refuse_whole_model_for_dp_shard",
           "shard_dataloader", "gather_for_metrics", "no_sync", "clip_grad_norm_", "frozen_units",
           "keep_frozen_units_gathered"]
