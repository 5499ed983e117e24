"""Where a study lives: a storage URL or object, resolved once, checked before any training starts.

- no storage given: a journal file under ``output_dir`` (survives the process, needs no server);
- ``postgresql://``, ``mysql://``, ``sqlite://`` URLs: Optuna's ``RDBStorage`` with heartbeats on and a small
  connection pool per worker (each torchrun job opens one from rank 0 only);
- ``journal:///path/to/file.log`` (or a path ending in ``.log``/``.journal``): a journal file;
- an Optuna storage object: used as it is.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any
from urllib.parse import urlsplit

import optuna
from optuna.storages import BaseStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend, JournalStorage

from shardadopt import upstream

DEFAULT_JOURNAL_NAME = "optuna-journal.log"
DEFAULT_HEARTBEAT_INTERVAL = 60
_RDB_SCHEMES = ("postgresql", "postgres", "mysql", "sqlite", "mariadb")


class StorageError(ValueError):
    """The storage URL is malformed, its driver is missing, or the database cannot be reached."""


def resolve_storage(storage: str | os.PathLike | BaseStorage | None = None, *, output_dir: str | None = None,
                    heartbeat_interval: int | None = DEFAULT_HEARTBEAT_INTERVAL,
                    grace_period: int | None = None) -> BaseStorage:
    """An Optuna storage for ``storage`` (see the module docstring), connected and checked.

    Raises ``StorageError`` naming the problem and the fix, so a bad URL fails before any training.

    Args:
        storage: a URL, a path, an Optuna storage, or None for a journal file under ``output_dir``.
        output_dir: where the default journal file goes.
        heartbeat_interval: seconds between trial heartbeats for database storages (None: no heartbeats).
        grace_period: seconds without a heartbeat before a trial counts as stale (database storages).

    Returns:
        The Optuna storage.
    """
    if isinstance(storage, BaseStorage):
        return storage
    if storage is None:
        if output_dir is None:
            raise StorageError("no storage given and no output_dir to put the default journal file in; pass "
                               "storage='postgresql://...' or storage='journal:///path/study.log', or an output_dir")
        os.makedirs(output_dir, exist_ok=True)
        return journal_storage(os.path.join(output_dir, DEFAULT_JOURNAL_NAME))
    text = os.fspath(storage)
    scheme = urlsplit(text).scheme.split("+", 1)[0].lower()
    if scheme == "journal" or (not scheme and text.endswith((".log", ".journal"))):
        path = text[len("journal://"):] if scheme == "journal" else text
        if not path:
            raise StorageError(f"journal storage URL {text!r} has no file path; use journal:///abs/path/study.log")
        return journal_storage(path)
    if scheme in _RDB_SCHEMES:
        return rdb_storage(text, heartbeat_interval=heartbeat_interval, grace_period=grace_period)
    raise StorageError(f"unsupported storage {text!r}: use a database URL (postgresql://user@host:5432/db, "
                       f"mysql://..., sqlite:///path.db), journal:///path/study.log, or an Optuna storage object")


def journal_storage(path: str) -> JournalStorage:
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise StorageError(f"journal storage directory {directory!r} does not exist; create it or pick another path")
    return JournalStorage(JournalFileBackend(path))


def rdb_storage(url: str, *, heartbeat_interval: int | None = DEFAULT_HEARTBEAT_INTERVAL,
                grace_period: int | None = None) -> RDBStorage:
    url = _with_available_driver(url)
    engine_kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if not url.startswith("sqlite"):
        # One rank per job talks to the database: a tiny pool per job keeps many jobs under max_connections.
        engine_kwargs.update(pool_size=2, max_overflow=2, pool_recycle=1800)
    try:
        return RDBStorage(url, engine_kwargs=engine_kwargs, heartbeat_interval=heartbeat_interval,
                          grace_period=grace_period, **{upstream.stale_trial_callback_keyword(): mark_preempted})
    except Exception as exc:  # SQLAlchemy/driver errors: say which database and what to check
        raise StorageError(f"cannot open the study database {_redacted(url)}: {type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}; check the host, port, database name "
                           f"and credentials, and that the server is running") from exc


def mark_preempted(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
    """Optuna's stale-heartbeat callback: whichever worker notices a dead trial first records it as preempted
    (Optuna fails it without a reason, and ``requeue`` only retries failures whose kind it knows)."""
    from shardadopt.hpo.failures import ATTR_KIND, ATTR_MESSAGE, PREEMPTED

    if ATTR_KIND not in trial.user_attrs:
        storage, trial_id = upstream.study_storage(study), upstream.trial_id(trial)
        storage.set_trial_user_attr(trial_id, ATTR_KIND, PREEMPTED)
        storage.set_trial_user_attr(trial_id, ATTR_MESSAGE, "Optuna heartbeat went stale")


def _with_available_driver(url: str) -> str:
    """``postgresql://`` means psycopg2 to SQLAlchemy; use psycopg 3 when that is what is installed."""
    scheme, sep, rest = url.partition("://")
    if scheme in ("postgresql", "postgres"):
        if importlib.util.find_spec("psycopg2") is None:
            if importlib.util.find_spec("psycopg") is None:
                raise StorageError("PostgreSQL storage needs a driver: pip install 'psycopg[binary]'")
            return f"postgresql+psycopg{sep}{rest}"
        return f"postgresql{sep}{rest}"
    return url


def _redacted(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        return url.replace(f":{parts.password}@", ":***@", 1)
    return url


def default_sampler(seed: int | None = None) -> optuna.samplers.BaseSampler:
    """TPE with the parallel-friendly settings written out: optuna 4.x and 5.0 differ in their defaults.

    Args:
        seed: the sampler's seed.

    Returns:
        A ``TPESampler`` (multivariate, constant liar).
    """
    return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True)


def load_study(storage: str, study_name: str) -> optuna.Study:
    """The existing study ``study_name`` in ``storage`` (a URL), or ``ValueError`` naming the studies there.

    Args:
        storage: a storage URL (as ``shardadopt hpo --storage`` takes it).
        study_name: the study to open.

    Returns:
        The loaded study.
    """
    resolved = resolve_storage(storage, heartbeat_interval=None)
    try:
        return optuna.load_study(study_name=study_name, storage=resolved)
    except KeyError:
        # names only: summaries read every study's trials, and fail when another client deletes a study meanwhile
        names = optuna.get_all_study_names(resolved)
        if study_name in names:  # created meanwhile, or the KeyError was another record's
            raise
    raise ValueError(f"no study named {study_name!r} in {storage}; studies there: {names}")
