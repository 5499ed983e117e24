"""The states a patch can be in (``shardadopt.status()`` reports one per patch), and the one line that tells a user
which installed releases are untested and which patches could not decide or apply.
"""

from __future__ import annotations

from typing import Any

from shardadopt.upstream.versions import OPTIONAL, TESTED, newer_than_tested

APPLIED = "applied"
NOT_NEEDED = "not-needed"
UNSUPPORTED = "unsupported"
OFF = "off"
PENDING = "pending"  # enabled, waiting for its upstream modules to be imported


def untested_summary(states: list[Any]) -> str | None:
    """One line for a user: the installed releases newer than ``TESTED`` and the patches whose probe could not
    decide (``states``: ``PatchStatus`` records); None when everything installed is tested and every patch decided.
    """
    newer = newer_than_tested()
    unsupported = sorted(s.id for s in states if s.state == UNSUPPORTED and not integration_absent(s))
    if not newer and not unsupported:
        return None
    parts = []
    if newer:
        releases = ", ".join(f"{name} {version}" for name, version in newer.items())
        tested = ", ".join(f"{name} {TESTED[name]}" for name in newer)
        verb = "is" if len(newer) == 1 else "are"
        parts.append(f"{releases} {verb} newer than the tested range (up to {tested}): each patch's probe decides")
    if unsupported:
        parts.append(f"could not decide or apply: {', '.join(unsupported)} (load-time-sharded models that need "
                     "them are refused at accelerate prepare / Trainer; `shardadopt doctor` says why)")
    else:
        parts.append("every probe decided so far")
    return "shardadopt: " + "; ".join(parts)


def integration_absent(status: Any) -> bool:
    """Whether ``status`` (a ``PatchStatus``) is a patch left ``unsupported`` only because the optional integration
    it patches (peft) is not installed: nothing can use it then, so like the package itself it is not an error."""
    return status.state == UNSUPPORTED and any(status.reason.startswith(f"{name} is not installed")
                                               for name in OPTIONAL)
