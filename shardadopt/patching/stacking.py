"""The order in which patches' wrappers stack on an attribute that several of them replace.

Several patches may wrap the same upstream attribute (six wrap ``DistributedMixin.maybe_distribute_model``). Their
stack is decided by one order over all registered patches, not by when each happened to apply (which depends on
import order, ``enable(only=...)``, ``exclude`` and re-enabling):

* the registry's order (``shardadopt.patches`` registers them sorted by id), except that
* a patch comes after every patch it ``depends_on`` and every patch it ``wraps_around``;
* on a shared attribute a patch earlier in this order wraps *inside* a later one: its wrapper runs nearer to
  upstream's code (its code before the call runs later, its code after the call earlier).

:func:`stack_order` computes the order (a stable topological sort: ties keep the registry's order);
:class:`Stack` holds one attribute's original and the wrappers on it and rebuilds it in that order whenever a patch
joins or leaves, so a patch re-enabled later goes back to its place. :func:`check_constraints` refuses a
``wraps_around`` that names no registered patch, shares no target with the patch, or closes a cycle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import wrapt

if TYPE_CHECKING:
    from shardadopt.patching.contract import Patch


def _after(patch: Patch) -> tuple[str, ...]:
    """The patches ``patch`` must come after (wrap outside of)."""
    return tuple(dict.fromkeys((*patch.depends_on, *patch.wraps_around)))


def check_constraints(patches: Sequence[Patch]) -> None:
    """Refuse ``wraps_around`` declarations that cannot hold (see the module docstring).

    Args:
        patches: the registry's patches.

    Raises:
        ValueError: naming the patch and the declaration to fix.
    """
    by_id = {p.id: p for p in patches}
    for patch in patches:
        for other in patch.wraps_around:
            if other not in by_id or other == patch.id:
                raise ValueError(f"patch {patch.id} wraps_around {other!r}, which is not another registered patch")
            if not set(patch.targets) & set(by_id[other].targets):
                raise ValueError(f"patch {patch.id} wraps_around {other}, but they wrap no target in common: drop "
                                 f"the declaration")
    stack_order(patches)


def stack_order(patches: Sequence[Patch]) -> list[str]:
    """The patch ids, innermost first: ``patches``' order, each patch moved after those it depends on or wraps
    around.

    Args:
        patches: the registry's patches, in the registry's order.

    Returns:
        Their ids in stacking order.

    Raises:
        ValueError: the declarations form a cycle (named).
    """
    ids = [p.id for p in patches]
    waiting = {p.id: {d for d in _after(p) if d in ids} for p in patches}
    order: list[str] = []
    while waiting:
        ready = next((pid for pid in ids if pid in waiting and not waiting[pid]), None)
        if ready is None:
            raise ValueError(f"patches {sorted(waiting)} depend on / wrap around each other in a cycle")
        order.append(ready)
        del waiting[ready]
        for rest in waiting.values():
            rest.discard(ready)
    return order


@dataclass
class Stack:
    """One upstream attribute that patches replaced: its original and each applied patch's wrapper."""

    owner: Any
    attribute: str
    original: Any
    wrappers: dict[str, Callable[..., Any]] = field(default_factory=dict)

    def rebuild(self, rank: Mapping[str, int]) -> None:
        """Set the attribute to the original wrapped by every wrapper, the lowest ``rank`` innermost (the original
        itself when none is left)."""
        value = self.original
        for pid in sorted(self.wrappers, key=rank.__getitem__):
            value = wrapt.FunctionWrapper(value, self.wrappers[pid])
        setattr(self.owner, self.attribute, value)
