"""What every accessor module of :mod:`shardadopt.upstream` shares: :class:`Target`, :class:`UpstreamChanged` and
the lookups that raise it."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from shardadopt.upstream.probing import Undecided, upstream_function
from shardadopt.upstream.versions import installed_version


@dataclass(frozen=True)
class Target:
    """An upstream object (a patch replaces it, a probe reads it): ``module`` plus a dotted ``qualname`` inside it."""

    module: str
    qualname: str

    def __str__(self) -> str:
        return f"{self.module}.{self.qualname}"


class UpstreamChanged(Undecided):
    """A private upstream name that an accessor of :mod:`shardadopt.upstream` reaches is gone in this release.

    An :class:`~shardadopt.upstream.probing.Undecided`, so a probe that hits it reports its patch ``unsupported``."""


def changed(accessor: str, what: str, distribution: str) -> UpstreamChanged:
    version = installed_version(distribution)
    return UpstreamChanged(f"shardadopt.upstream.{accessor}: {what} does not exist in {distribution} "
                           f"{version or '(not installed)'} (renamed or removed upstream; shardadopt needs updating)")


_MISSING = object()


def attribute(obj: Any, name: str, accessor: str, distribution: str) -> Any:
    value = getattr(obj, name, _MISSING)
    if value is _MISSING:
        owner = obj if isinstance(obj, (type, ModuleType)) else type(obj)
        raise changed(accessor, f"{getattr(owner, '__qualname__', owner.__name__)}.{name}", distribution)
    return value


_IMPORTED: dict[str, ModuleType] = {}  # accessors run per training step: import each module once


def module_attribute(module: str, name: str, accessor: str, distribution: str) -> Any:
    owner = _IMPORTED.get(module)
    if owner is None:
        try:
            owner = _IMPORTED[module] = importlib.import_module(module)
        except ImportError as exc:
            raise changed(accessor, f"module {module}", distribution) from exc
    return attribute(owner, name, accessor, distribution)  # looked up each call: a replaced kernel is used


def upstream_method(target: Target, where: str) -> Callable[..., Any]:
    """The function ``target`` names (its module imported), for probes that read or run it; a missing class or
    method raises :class:`~shardadopt.upstream.probing.Undecided` saying ``<Class>.<method> does not exist in this
    release``."""
    *path, name = target.qualname.split(".")
    try:
        owner: Any = importlib.import_module(target.module)
    except ImportError as exc:
        raise Undecided(f"{where}: module {target.module} does not exist in this release (renamed or removed "
                        "upstream; the patch needs updating)") from exc
    for part in path:
        owner = upstream_function(owner, part, where)
    return upstream_function(owner, name, where)
