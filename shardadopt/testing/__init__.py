"""Test support shared by the test suite, ``shardadopt selftest`` and the benchmarks."""

from shardadopt.testing.models import MOE_MODELS, VOCAB_SIZE, full, tiny_checkpoints, token_batch
from shardadopt.testing.pool import RankError, RankPool, RankTimeout, free_port

__all__ = ["RankPool", "RankError", "RankTimeout", "free_port", "tiny_checkpoints", "MOE_MODELS", "VOCAB_SIZE",
           "token_batch", "full"]
