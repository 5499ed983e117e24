"""The patches, one module each: a thin adapter from an upstream call into shardadopt's core.

Each module defines ``PATCH`` (a ``shardadopt.registry.Patch``) and must not import transformers, accelerate or
optuna at module level: the registry applies it when those are imported.
"""

from __future__ import annotations

from shardadopt.patches import accelerate_cpu_parallelism
from shardadopt.registry import Patch

ALL_PATCHES: list[Patch] = [
    accelerate_cpu_parallelism.PATCH,
]
