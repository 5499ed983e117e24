"""What transformers' sharded loading gets wrong or forgets, fixed around ``from_pretrained``: one mechanism per module.

- :mod:`~shardadopt.loadtime.sizes`: the sharding degrees a loaded model records (transformers 5.15 .. 5.17 forget
  them) and the refusal of ``fsdp_size x tp_size`` where a release applies TP alone (5.16, 5.17).
- :mod:`~shardadopt.loadtime.heads`: the refusal of a ``tp_size`` that does not divide the attention heads a TP plan
  splits (a multi-query model on ``tp_size=2``), before any weight is read.
- :mod:`~shardadopt.loadtime.meshes`: one device mesh per layout and process group, reused by later loads (5.18+ build
  new meshes and process groups on every load).
- :mod:`~shardadopt.loadtime.shapes`: how a checkpoint tensor read for a sharded parameter relates to its shard
  (fused sources converted whole; slices already in the shard's layout left untransposed).
"""

from __future__ import annotations

from shardadopt.loadtime.heads import indivisible_heads, refuse_indivisible_heads
from shardadopt.loadtime.meshes import forget_device_meshes, reuse_device_mesh
from shardadopt.loadtime.shapes import in_shard_layout, is_fused_source, shard_shape
from shardadopt.loadtime.sizes import UnsupportedShardingError, record_sharding_degrees, refuse_fsdp_with_tp

__all__ = ["UnsupportedShardingError", "forget_device_meshes", "in_shard_layout", "indivisible_heads",
           "is_fused_source", "record_sharding_degrees", "refuse_fsdp_with_tp", "refuse_indivisible_heads",
           "reuse_device_mesh", "shard_shape"]
