"""This rank's progress count, which the hang monitor watches while a fence with a hang timeout is armed.

Module forward calls (a global forward pre-hook) and optimizer steps (a global step hook) count, installed only while
such a fence is armed; control-plane rounds, the Trainer's step and evaluation events, checkpoint steps and custom
code call ``progress()``.
"""

from __future__ import annotations

from typing import Any

_COUNT = [0]  # a list: the hooks add to it on every forward call, without a global statement
_HOOKS: list[Any] = []


def progress() -> None:
    """Count one unit of progress on this rank: call it from long custom work that makes no forward call,
    optimizer step or control round (e.g. a data-preparation loop inside a trial), so it is not taken for a hang."""
    _COUNT[0] += 1


def count() -> int:
    """This rank's progress count since the last ``reset``."""
    return _COUNT[0]


def reset() -> None:
    """Count from zero: a hang monitor starts counting at a section's start, which every rank enters together."""
    _COUNT[0] = 0


def _count_progress(*args: Any) -> None:
    _COUNT[0] += 1


def add_hooks() -> None:
    """Count every module forward call and optimizer step (once: a no-op while the hooks are installed)."""
    if _HOOKS:
        return
    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _HOOKS.append(register_module_forward_pre_hook(_count_progress))
    _HOOKS.append(register_optimizer_step_post_hook(_count_progress))


def remove_hooks() -> None:
    """Stop counting forward calls and optimizer steps."""
    while _HOOKS:
        _HOOKS.pop().remove()
