"""The PostgreSQL server the multi-worker storage tests use (127.0.0.1:5432, database ``test`` in CI).

``needs_postgres`` skips those tests on a machine without the server, but not under CI (``CI`` set): ``.ci/run``
starts the server and stops if it does not come up, so there a missing server fails the tests instead of hiding them.
"""

from __future__ import annotations

import functools
import os

import pytest

POSTGRES_URL = os.environ.get("SHARDADOPT_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")


@functools.cache
def postgres_available() -> bool:
    from shardadopt.hpo.storage import StorageError, resolve_storage

    try:
        resolve_storage(POSTGRES_URL, heartbeat_interval=None)
        return True
    except StorageError:
        return False


needs_postgres = pytest.mark.skipif(not os.environ.get("CI") and not postgres_available(),
                                    reason=f"PostgreSQL at {POSTGRES_URL} not running (under CI this fails instead)")
