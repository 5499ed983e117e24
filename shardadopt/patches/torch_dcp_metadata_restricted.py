"""A DCP checkpoint's ``.metadata`` builds torch's metadata classes only: a checkpoint from elsewhere runs no code.

torch 2.13 .. 2.15, ``torch/distributed/checkpoint/filesystem.py``::

    class FileSystemReader(StorageReader):
        def read_metadata(self, *args, **kwargs) -> Metadata:
            ...
            with self.fs.create_stream(path, "rb") as metadata_file:
                metadata = pickle.load(metadata_file)

``pickle.load`` builds whatever the file names: a ``.metadata`` replaced by a pickle whose ``__reduce__`` runs a
shell command runs it on every rank that loads the checkpoint (the tensors themselves are read with
``weights_only=True``). The replacement reads it with an unpickler that allows DCP's metadata classes, torch dtypes
and the few other globals DCP writes (:func:`shardadopt.checkpoint.safeload.read_metadata`). The probe runs
upstream's ``read_metadata`` on a ``.metadata`` naming a function of this module: reached is the gap, refused the
fix.
"""

from __future__ import annotations

import inspect
import os
import pickle
import tempfile
from typing import Any

from shardadopt import upstream
from shardadopt.patching.contract import Patch, Probe
from shardadopt.upstream.versions import supported

_REACHED: list[bool] = []


def _reached() -> Any:
    """What the probe's ``.metadata`` calls while it is unpickled: records that it ran, returns an empty Metadata."""
    from torch.distributed.checkpoint.metadata import Metadata

    _REACHED.append(True)
    return Metadata(state_dict_metadata={})


class _Callback:
    def __reduce__(self) -> tuple:
        return (_reached, ())


def probe() -> Probe:
    """Run upstream's ``FileSystemReader.read_metadata`` on a ``.metadata`` that calls :func:`_reached`."""
    # the filesystem module itself: the probe runs when it is imported, inside torch.distributed.checkpoint's own
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    from shardadopt.upstream.probing import undecided

    read = inspect.unwrap(upstream.upstream_method(upstream.DCP_READ_METADATA, "torch-dcp-metadata-restricted"))
    _REACHED.clear()
    refused = None
    with tempfile.TemporaryDirectory() as directory:
        with open(os.path.join(directory, ".metadata"), "wb") as f:
            pickle.dump(_Callback(), f)
        try:
            read(FileSystemReader(directory))
        except Exception as exc:  # noqa: BLE001  (a restricted reader refuses the call, with its own error)
            refused = exc
    if _REACHED:
        return Probe(True, "FileSystemReader.read_metadata unpickles whatever .metadata names (pickle.load): a "
                           "checkpoint from elsewhere runs code while it loads")
    if refused is not None:
        return Probe(False, f"FileSystemReader.read_metadata refuses a .metadata naming other than DCP's metadata "
                            f"classes ({type(refused).__name__})")
    raise undecided("torch's FileSystemReader.read_metadata", "a call of the function .metadata names (the unfixed "
                                                             "shape) nor a refusal of it (the fix)")


def _read_metadata(wrapped, instance, args, kwargs):
    from shardadopt.checkpoint.safeload import read_metadata

    return read_metadata(instance, kwargs.get("rank"))


PATCH = Patch(
    id="torch-dcp-metadata-restricted",
    summary="torch.distributed.checkpoint's FileSystemReader reads .metadata building DCP's metadata classes only, "
            "so a checkpoint from elsewhere cannot run code when it is loaded",
    upstream="proposal for pytorch main",
    requires=supported("torch"),
    wrappers={upstream.DCP_READ_METADATA: _read_metadata},
    probe=probe,
)
