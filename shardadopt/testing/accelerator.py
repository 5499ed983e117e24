"""A new ``Accelerator`` in a process that may have built one before (pooled ranks, several runs per test).

accelerate keeps its state in process-wide singletons, so a second ``Accelerator()`` would inherit the first one's
configuration; tests, ``shardadopt selftest`` and the benchmarks build each one through :func:`fresh_accelerator`,
or call :func:`forget_accelerate_state` before a ``Trainer`` (which builds its own).
"""

from __future__ import annotations

from typing import Any

from shardadopt import upstream


def forget_accelerate_state() -> None:
    """Forget accelerate's process-wide state (``AcceleratorState``, ``PartialState``, ``GradientState``), so the
    next ``Accelerator`` (one a ``Trainer`` builds, say) is configured from its own arguments."""
    upstream.reset_accelerate_state()


def fresh_accelerator(**kwargs: Any):
    """Forget accelerate's process-wide state, then build ``Accelerator(**kwargs)``.

    Args:
        **kwargs: ``Accelerator``'s arguments (``cpu=True`` for a CPU rank).

    Returns:
        The new ``accelerate.Accelerator``.
    """
    from accelerate import Accelerator

    forget_accelerate_state()
    return Accelerator(**kwargs)
