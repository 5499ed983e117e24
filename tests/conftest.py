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
