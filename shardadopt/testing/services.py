"""The PostgreSQL server the multi-worker storage tests use (127.0.0.1:5432, database ``test`` in CI)."""

from __future__ import annotations

import functools
import os

POSTGRES_URL = os.environ.get("SHARDADOPT_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")


@functools.cache
def postgres_available() -> bool:
    from shardadopt.hpo.storage import StorageError, resolve_storage

    try:
        resolve_storage(POSTGRES_URL, heartbeat_interval=None)
        return True
    except StorageError:
        return False
