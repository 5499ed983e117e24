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
    """Each test starts on upstream as it is: a test that leaves shardadopt enabled in this process fails (after
    shardadopt is disabled again, so the next test still starts clean). A patch left applied once made a later
    module's probe test see shardadopt's wrapper instead of upstream's function; helpers that enable shardadopt as
    users do and also run here as one-process references restore the state they found
    (``shardadopt.testing.patching.keeps_patch_state``)."""
    yield
    from shardadopt.testing.patching import enabled_patches

    left_on = enabled_patches()
    if left_on:
        import shardadopt

        shardadopt.disable()
        pytest.fail(
            f"this test left shardadopt enabled in the test process ({len(left_on)} patches not off, e.g. "
            f"{sorted(left_on)[0]}): disable it in a finally, or decorate the helper that enables it with "
            f"shardadopt.testing.patching.keeps_patch_state"
        )
