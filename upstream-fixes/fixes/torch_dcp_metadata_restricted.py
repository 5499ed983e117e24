"""torch-dcp-metadata-restricted: FileSystemReader reads .metadata building DCP's metadata classes only."""

from upstream_diffs import Edit, Fix, NewFile

TEST = '''import os
import pickle
import tempfile
import unittest

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save

CALLED = []


def _record():
    CALLED.append(True)
    return Metadata(state_dict_metadata={})


class _Callback:
    def __reduce__(self):
        return (_record, ())


class ReadMetadataRestrictedTest(unittest.TestCase):
    def test_metadata_naming_a_function_is_refused(self):
        # a .metadata whose pickle calls a function (a tampered checkpoint) must not call it
        CALLED.clear()
        with tempfile.TemporaryDirectory() as directory:
            with open(os.path.join(directory, ".metadata"), "wb") as f:
                pickle.dump(_Callback(), f)
            with self.assertRaises(pickle.UnpicklingError):
                FileSystemReader(directory).read_metadata()
        self.assertEqual(CALLED, [])

    def test_checkpoint_still_round_trips(self):
        state = {"w": torch.randn(4, 3), "b": torch.ones(2, dtype=torch.bfloat16), "step": 3, "name": "x"}
        with tempfile.TemporaryDirectory() as directory:
            save(state, storage_writer=FileSystemWriter(directory), no_dist=True)
            loaded = {"w": torch.zeros(4, 3), "b": torch.zeros(2, dtype=torch.bfloat16), "step": 0, "name": ""}
            load(loaded, storage_reader=FileSystemReader(directory), no_dist=True)
        torch.testing.assert_close(loaded["w"], state["w"])
        torch.testing.assert_close(loaded["b"], state["b"])
        self.assertEqual((loaded["step"], loaded["name"]), (3, "x"))


if __name__ == "__main__":
    unittest.main()
'''

OLD_CLASS = '''class FileSystemReader(StorageReader):
'''

NEW_CLASS = '''class _MetadataUnpickler(pickle.Unpickler):
    """Builds the types a checkpoint's metadata holds, and nothing else: a .metadata file of a checkpoint from
    elsewhere must not run code (the tensors are read with weights_only=True already)."""

    _ALLOWED = {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch.distributed.checkpoint.metadata":
            found = getattr(importlib.import_module(module), name, None)
            if isinstance(found, type) and found.__module__ == module:
                return found
        raise pickle.UnpicklingError(
            f"Unsupported global: {module}.{name} is not a type of torch.distributed.checkpoint's metadata"
        )


class FileSystemReader(StorageReader):
'''

OLD_LOAD = '''            metadata = pickle.load(metadata_file)
'''

NEW_LOAD = '''            metadata = _MetadataUnpickler(metadata_file).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(
                f"{path} holds a {type(metadata).__name__}, not a checkpoint's Metadata"
            )
'''

OLD_IMPORT = '''import pickle
'''

NEW_IMPORT = '''import importlib
import pickle
'''

FIX = Fix(
    id="torch-dcp-metadata-restricted",
    distribution="torch",
    kind="proposal",
    upstream="pytorch main",
    summary="""
        FileSystemReader.read_metadata reads a checkpoint's .metadata with pickle.load, so a checkpoint from
        elsewhere (a colleague's run, shared storage, a hub) whose .metadata was replaced by a pickle that calls
        os.system runs that command on every rank that loads it, although every tensor is read with
        torch.load(weights_only=True).

        Read it with an unpickler that builds the types DCP writes there and nothing else: the classes of
        torch.distributed.checkpoint.metadata, the filesystem storage's _StorageInfo, torch.Size, dtypes, layouts
        (torch.serialization._get_layout) and the checkpoint's path. Anything else is an UnpicklingError before it
        is built.
    """,
    edits=(Edit("torch/distributed/checkpoint/filesystem.py", OLD_IMPORT, NEW_IMPORT),
           Edit("torch/distributed/checkpoint/filesystem.py", OLD_CLASS, NEW_CLASS),
           Edit("torch/distributed/checkpoint/filesystem.py", OLD_LOAD, NEW_LOAD)),
    new_files=(NewFile("test/distributed/checkpoint/test_read_metadata_restricted.py", TEST),),
)
