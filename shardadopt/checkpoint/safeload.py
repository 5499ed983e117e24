"""Reading checkpoint files without running code from them.

Checkpoints travel (a colleague's run, shared storage, a hub), and a pickle can run any command while it is loaded.
Every file shardadopt reads from a checkpoint goes through here: RNG, scheduler and ``extra`` states with
``torch.load(weights_only=True)`` and numpy's RNG types allow-listed (as ``transformers.trainer_pt_utils.safe_globals``
does), and DCP's ``.metadata`` (which torch's ``FileSystemReader`` reads with ``pickle.load``) through an unpickler
that builds DCP's metadata classes only. A file torch cannot read is ``DamagedCheckpointError``; a file naming a
type outside the allow-list is ``UntrustedCheckpointError`` (``extra`` only loads such types with ``trust_extra``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import pickle
import re
from collections.abc import Iterator
from typing import IO, Any

from shardadopt import upstream
from shardadopt.checkpoint.errors import DamagedCheckpointError, UntrustedCheckpointError
from shardadopt.fence.errors import summary

# how torch's weights_only unpickler names a refused type ("Unsupported global: GLOBAL fractions.Fraction was not
# an allowed global", "unsupported GLOBAL posix.system whose module posix is blocked"; torch 2.13-2.15)
_REFUSED = re.compile(r"unsupported (?:global: )?GLOBAL ([\w.]+)", re.IGNORECASE)
_UNSUPPORTED = "Unsupported global"
_RESUME_ELSEWHERE = ("Resume from another checkpoint: an earlier step's directory, or shardadopt.checkpoint.latest("
                     "root) once this one is moved out of the root (latest picks the newest complete checkpoint, "
                     "this one included)")
_ALTERED = f"shardadopt never writes such types there: the file was altered. {_RESUME_ELSEWHERE}."


def damaged(directory: str, name: str, detail: str) -> DamagedCheckpointError:
    """The error every rank raises for a damaged file ``name`` of checkpoint ``directory``.

    Args:
        directory: the checkpoint directory.
        name: the damaged file, relative to ``directory``.
        detail: what is wrong with it.

    Returns:
        The error, naming the directory, the file and what to do.
    """
    return DamagedCheckpointError(f"checkpoint {directory}: {name} is damaged ({detail}); nothing was loaded from "
                                  f"it. {_RESUME_ELSEWHERE}.", directory, name)


@contextlib.contextmanager
def rng_safe_globals() -> Iterator[None]:
    """numpy's RNG state types allow-listed for ``torch.load(weights_only=True)``, as transformers'
    ``trainer_pt_utils.safe_globals`` allows them (numpy 1 and 2)."""
    import numpy as np
    import torch

    allowed = [upstream.array_reconstructor(), np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    with torch.serialization.safe_globals(allowed):
        yield


def load_file(directory: str, name: str, what: str, *, trusted: bool = False, hint: str | None = None) -> Any:
    """``directory/name`` read with ``torch.load(weights_only=True)`` (RNG types allowed), on the CPU.

    Args:
        directory: the checkpoint directory.
        name: the file, relative to ``directory``.
        what: what the file holds, as error messages name it (``"the schedulers' states"``).
        trusted: full pickle (``weights_only=False``): only for ``extra`` with ``trust_extra=True``.
        hint: what to do about a refused type (default: the file was altered, resume from another checkpoint).

    Returns:
        What the file holds. Raises ``UntrustedCheckpointError`` when it names a type outside the allow-list,
        ``DamagedCheckpointError`` when torch cannot read it.
    """
    import torch

    try:
        with rng_safe_globals():
            return torch.load(os.path.join(directory, name), map_location="cpu", weights_only=not trusted)
    except pickle.UnpicklingError as exc:
        refused = _REFUSED.search(str(exc))
        if refused is None:
            raise damaged(directory, name, summary(exc).splitlines()[0]) from exc
        raise UntrustedCheckpointError(
            f"checkpoint {directory}: {name} ({what}) holds {refused.group(1)}, which torch.load(weights_only=True) "
            f"does not build (loading it could run code); "
            f"shardadopt does not load it. {hint or _ALTERED}", directory, name) from exc
    except Exception as exc:  # noqa: BLE001  (torch's zip reader, EOF, a file gone: the file is damaged)
        raise damaged(directory, name, summary(exc).splitlines()[0]) from exc


EXTRA_HINT = ("If you trust whoever wrote this checkpoint (the file can run any command), pass trust_extra=True to "
              "shardadopt.checkpoint.load; else keep extra to tensors, numbers, strings, None and lists, tuples and "
              "dicts of them, or allow your own types with torch.serialization.add_safe_globals.")


# -- DCP's .metadata -----------------------------------------------------------------------------------------------

def _allowed(module: str, name: str) -> bool:
    """Whether ``module.name`` is a type DCP's metadata holds: a class of ``torch.distributed.checkpoint.metadata``,
    one of :data:`shardadopt.upstream.DCP_METADATA_GLOBALS`, or a torch dtype."""
    import torch

    if (module, name) in upstream.DCP_METADATA_GLOBALS:
        return True
    if module == "torch":
        return isinstance(getattr(torch, name, None), torch.dtype)
    if module == upstream.DCP_METADATA_MODULE:
        found = getattr(importlib.import_module(module), name, None)
        return isinstance(found, type) and found.__module__ == module
    return False


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not _allowed(module, name):
            raise pickle.UnpicklingError(f"{_UNSUPPORTED}: {module}.{name} is not a type of "
                                         f"torch.distributed.checkpoint's metadata; it was not unpickled")
        return super().find_class(module, name)


def load_metadata(stream: IO[bytes]) -> Any:
    """DCP's ``Metadata`` from ``stream`` (a ``.metadata`` file), building DCP's metadata classes only.

    Args:
        stream: the open ``.metadata`` file.

    Returns:
        The ``Metadata``. Raises ``pickle.UnpicklingError`` for any other type (before building it).
    """
    from torch.distributed.checkpoint.metadata import Metadata

    metadata = _MetadataUnpickler(stream).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"a DCP .metadata file holds a Metadata, this one a {type(metadata).__name__}")
    return metadata


def read_metadata(reader: Any, rank: int | None = None) -> Any:
    """``FileSystemReader.read_metadata`` with :func:`load_metadata` in place of ``pickle.load``.

    Args:
        reader: a ``torch.distributed.checkpoint.FileSystemReader``.
        rank: the rank whose metadata file to read (torch's ``rank`` keyword); None for the global one.

    Returns:
        The checkpoint's ``Metadata``, its ``storage_meta.load_id`` set to the reader's, as upstream does.
    """
    from torch.distributed.checkpoint.metadata import StorageMeta

    with reader.fs.create_stream(upstream.dcp_metadata_path(reader, rank), "rb") as stream:
        metadata = load_metadata(stream)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = reader.load_id
    return metadata


@functools.cache
def safe_reader() -> type:
    """DCP's ``FileSystemReader`` reading ``.metadata`` with :func:`read_metadata` (shardadopt's own loads use it
    whether or not the ``torch-dcp-metadata-restricted`` patch is applied)."""
    from torch.distributed.checkpoint import FileSystemReader

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return read_metadata(self, kwargs.get("rank"))

    return SafeFileSystemReader


def saved_metadata(directory: str, state_dir: str) -> Any:
    """The ``Metadata`` of the DCP state under ``directory/state_dir``, read safely.

    Args:
        directory: the checkpoint directory.
        state_dir: the DCP directory inside it.

    Returns:
        The ``Metadata``; ``UntrustedCheckpointError`` / ``DamagedCheckpointError`` name ``state_dir/.metadata``.
    """
    name = f"{state_dir}/.metadata"
    try:
        return safe_reader()(os.path.join(directory, state_dir)).read_metadata()
    except pickle.UnpicklingError as exc:
        if _UNSUPPORTED in str(exc):
            raise UntrustedCheckpointError(
                f"checkpoint {directory}: {name} names a type outside torch.distributed.checkpoint's metadata "
                f"({exc}); loading it would run code. {_ALTERED}", directory, name) from exc
        raise damaged(directory, name, summary(exc)) from exc
    except Exception as exc:  # noqa: BLE001  (truncated, unreadable, gone)
        raise damaged(directory, name, summary(exc)) from exc
