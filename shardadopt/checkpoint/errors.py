"""The errors a checkpoint raises: ``CheckpointError`` and its kinds (incomplete, mismatched, damaged, untrusted).

``DamagedCheckpointError`` and ``UntrustedCheckpointError`` are raised alike on every rank (the ranks agree on them
first, ``shardadopt.checkpoint.integrity``); both name the checkpoint ``directory`` and the ``file``.
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used as asked."""


class IncompleteCheckpointError(CheckpointError):
    """The directory is not a completely written checkpoint (a save was interrupted, or it is not one)."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint was saved with a layout that cannot be loaded into the target as asked."""


class DamagedCheckpointError(CheckpointError):
    """A file of the checkpoint is damaged, missing, or comes from another save; every rank raises it alike.

    ``directory`` is the checkpoint and ``file`` the damaged file (relative to it).
    """

    def __init__(self, message: str, directory: str = "", file: str = ""):
        super().__init__(message)
        self.directory, self.file = directory, file

    def __reduce__(self):
        return (type(self), (self.args[0], self.directory, self.file))


class UntrustedCheckpointError(CheckpointError):
    """A checkpoint file holds pickled objects that loading would have to run code for (``torch.load`` with
    ``weights_only=True`` refuses them); ``file`` names it. Only ``extra`` may hold such objects, with an opt-in."""

    def __init__(self, message: str, directory: str = "", file: str = ""):
        super().__init__(message)
        self.directory, self.file = directory, file

    def __reduce__(self):
        return (type(self), (self.args[0], self.directory, self.file))
