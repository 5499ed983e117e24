"""Per-rank RNG state (python, numpy, torch CPU and CUDA) saved beside a checkpoint and restored on resume.

Read with ``torch.load(weights_only=True)``, numpy's RNG types allow-listed (``shardadopt.checkpoint.safeload``).
"""

from __future__ import annotations

import os
import random
import warnings
from typing import Any

import torch

from shardadopt.checkpoint.safeload import damaged, load_file
from shardadopt.parallel.topology import rank_and_world_size


def _rng_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rng_state_{rank}.pt")


def save_rng_state(directory: str) -> None:
    """This rank's python, numpy and torch (CPU and current accelerator) RNG states.

    Args:
        directory: the checkpoint directory; this rank's states go into a file of its own there.
    """
    import numpy as np

    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    torch.save(state, _rng_file(directory, rank_and_world_size()[1]))


def read_rng_state(directory: str) -> dict[str, Any] | None:
    """This rank's RNG states as saved (nothing restored yet); None when the checkpoint has no file for this rank.

    Args:
        directory: a checkpoint directory written with :func:`save_rng_state`.

    Returns:
        The states. ``DamagedCheckpointError`` / ``UntrustedCheckpointError`` name a file that is not one.
    """
    name = os.path.basename(_rng_file(directory, rank_and_world_size()[1]))
    if not os.path.isfile(os.path.join(directory, name)):
        return None
    state = load_file(directory, name, "this rank's RNG states")
    if not isinstance(state, dict) or not {"python", "numpy", "cpu"} <= set(state):
        raise damaged(directory, name, "it holds no python, numpy and torch RNG states")
    return state


def restore_rng_state(state: dict[str, Any], directory: str) -> None:
    """Set this rank's RNG states to ``state`` (from :func:`read_rng_state` of ``directory``)."""
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["cpu"])
    if "cuda" in state:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])  # the current device's, as saved
        else:
            warnings.warn(f"{_rng_file(directory, rank_and_world_size()[1])} holds a CUDA RNG state, but CUDA is not "
                          "available here: the CPU, python and numpy RNG states are restored, CUDA random streams "
                          "are not",
                          stacklevel=3)


def load_rng_state(directory: str) -> bool:
    """Restore this rank's RNG states; False when the checkpoint has no file for this rank.

    Args:
        directory: a checkpoint directory written with :func:`save_rng_state`.

    Returns:
        True when this rank's states were restored.
    """
    state = read_rng_state(directory)
    if state is None:
        return False
    restore_rng_state(state, directory)
    return True
