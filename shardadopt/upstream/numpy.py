"""numpy's private names. Checked on numpy 1.26 and 2.x."""

from __future__ import annotations

from typing import Any

from shardadopt.upstream.base import attribute


def array_reconstructor() -> Any:
    """``numpy.core.multiarray._reconstruct`` (``numpy._core`` from numpy 2): the global a pickled ``ndarray`` names,
    such as the arrays in numpy's RNG state, which ``torch.load(weights_only=True)`` must be allowed to call
    (transformers' ``trainer_pt_utils.safe_globals`` allows it too). Checked on numpy 1.26 and 2.x."""
    import numpy as np

    core = np._core if hasattr(np, "_core") else np.core
    return attribute(core.multiarray, "_reconstruct", "array_reconstructor", "numpy")
