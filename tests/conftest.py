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
def shardadopt_left_disabled(request):
    """A test that enables shardadopt in this process disables it again: the modules after it test upstream as it
    is (a patch left applied once made a probe test of another module see shardadopt's wrapper, not upstream)."""
    yield
    from shardadopt.patchstate import OFF
    from shardadopt.registry import process_wide

    registry = process_wide()
    left = [s.id for s in registry.status() if s.state != OFF] if registry is not None else []
    if left:
        registry.disable()
        pytest.fail(f"{request.node.nodeid} left shardadopt enabled in the test process ({left}): call "
                    f"shardadopt.disable() in a finally block")
