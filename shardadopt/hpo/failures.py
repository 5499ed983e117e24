"""Why a trial failed, recorded on the trial, so a requeue job can retry what is worth retrying.

Kinds: ``oom``, ``nan_loss``, ``config_error`` and ``error`` are deterministic (a retry fails again);
``preempted``, ``comm_error`` and ``hang`` (a rank made no progress for the hang timeout, ``shardadopt.fence``)
are transient (a retry on healthy machines can succeed).
"""

from __future__ import annotations

import math

from shardadopt.fence.errors import FAILURE_KIND_ATTRIBUTE, HANG_KIND

OOM = "oom"
NAN_LOSS = "nan_loss"
CONFIG_ERROR = "config_error"
PREEMPTED = "preempted"
COMM_ERROR = "comm_error"
HANG = HANG_KIND
ERROR = "error"

KINDS = (OOM, NAN_LOSS, CONFIG_ERROR, PREEMPTED, COMM_ERROR, HANG, ERROR)
TRANSIENT = frozenset({PREEMPTED, COMM_ERROR, HANG})

# Trial user attributes written by shardadopt.
ATTR_KIND = "failure_kind"
ATTR_MESSAGE = "failure_message"
ATTR_RETRY_OF = "retry_of"


class InvalidConfigError(ValueError):
    """Raise from ``hp_space``/``model_init`` when sampled hyperparameters cannot be trained (never retried)."""


class NonFiniteLossError(FloatingPointError):
    """The training loss or the objective became NaN or infinite (never retried)."""


class PreemptedError(RuntimeError):
    """The worker was told to stop (SIGTERM) or its trial's heartbeat went stale (retried once)."""


def mark(exc: BaseException, kind: str) -> BaseException:
    """Tag ``exc`` with a failure kind decided where the context was known (e.g. before training started).

    Args:
        exc: the exception.
        kind: one of the failure kinds (``oom``, ``nan_loss``, ``config_error``, ``preempted``, ``comm_error``,
            ``error``).

    Returns:
        ``exc``, tagged.
    """
    setattr(exc, FAILURE_KIND_ATTRIBUTE, kind)
    return exc


def classify(exc: BaseException, *, before_training: bool = False) -> str:
    """The failure kind of ``exc``. ``before_training``: raised while building the config/model for a trial.

    Args:
        exc: the exception that failed the trial.
        before_training: whether it was raised while the trial's config or model was built.

    Returns:
        The failure kind recorded as the trial's ``failure_kind``.
    """
    marked = getattr(exc, FAILURE_KIND_ATTRIBUTE, None)
    if marked in KINDS:
        return marked
    names = {cls.__name__ for cls in type(exc).__mro__}
    message = str(exc).lower()
    if isinstance(exc, InvalidConfigError):
        return CONFIG_ERROR
    if isinstance(exc, (NonFiniteLossError, FloatingPointError)):
        return NAN_LOSS
    if isinstance(exc, (PreemptedError, KeyboardInterrupt)):
        return PREEMPTED
    if "OutOfMemoryError" in names or "out of memory" in message:
        return OOM
    # torch.distributed reports lost peers and collective timeouts under these types; gloo says it in words.
    if names & {"DistBackendError", "DistNetworkError", "DistStoreError", "RankTimeout", "ControlTimeout",
                "PeerLostError"} or any(s in message for s in (
                    "connection closed by peer", "connection reset by peer", "timed out", "broken pipe")):
        return COMM_ERROR
    if before_training and isinstance(exc, (ValueError, TypeError)):
        return CONFIG_ERROR
    return ERROR


def check_finite(value: float, what: str = "objective") -> float:
    """``value`` if it is finite, else ``NonFiniteLossError``.

    Args:
        value: the loss or objective value.
        what: what the value is, for the error message.

    Returns:
        ``value``.

    Raises:
        NonFiniteLossError: ``value`` is NaN or infinite.
    """
    if value is None or not math.isfinite(float(value)):
        raise NonFiniteLossError(f"the {what} is {value}: the trial diverged; lower the learning rate or narrow "
                                 f"the search space")
    return value
