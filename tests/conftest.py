"""Fixtures: tiny checkpoints generated once per run, and gloo rank pools started once per test module."""

from __future__ import annotations

import os

import pytest

from shardadopt.testing import RankPool, tiny_checkpoints


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = os.environ.get("SHARDADOPT_TINY_MODELS") or tmp_path_factory.mktemp("tiny-models")
    return tiny_checkpoints(root)


@pytest.fixture(scope="module")
def pool2():
    with RankPool(2) as pool:
        yield pool


@pytest.fixture(scope="module")
def pool4():
    with RankPool(4) as pool:
        yield pool


@pytest.fixture(scope="session")
def trl_tokenizer(tiny_models) -> str:
    """A word-level tokenizer for the tiny models (TRL's trainers need a ``processing_class``)."""
    from shardadopt.testing.text import tiny_tokenizer

    return tiny_tokenizer(os.path.dirname(tiny_models["qwen3"]))


@pytest.fixture(scope="module")
def trl_ddp(pool2, tiny_models, trl_tokenizer):
    """``get(kind, model, bf16=False, lora=None)``: the TRL run on the plain checkpoint under DDP on this module's
    2-rank pool (``shardadopt.testing.trl.ddp_reference``)."""
    from shardadopt.testing.trl import ddp_reference

    return ddp_reference(pool2, tiny_models, trl_tokenizer)


@pytest.fixture(autouse=True)
def upstream_as_found():
    """Each test starts on upstream as it is: shardadopt is disabled after a test that left it enabled in this
    process (one-process references run the rank functions here, and those enable shardadopt as users do; a patch
    left applied once made a later module's probe test see shardadopt's wrapper instead of upstream's function)."""
    yield
    from shardadopt.patchstate import OFF
    from shardadopt.registry import process_wide

    registry = process_wide()
    if registry is not None and any(s.state != OFF for s in registry.status()):
        registry.disable()
