"""transformers 5.16 / 5.17: refuse ``DistributedConfig(fsdp_size=N, tp_size=M)``, which they accept but cannot apply.

transformers 5.15 refuses the combination in ``DistributedConfig`` ("FSDP+TP is not supported yet"); 5.16 dropped
that check, but ``DistributedMixin.prepare_distribute_model`` and ``maybe_distribute_model``
(``transformers/distributed/mixin.py``) still apply one kind of sharding only::

    if distributed_config.tp_size > 1:
        ...
        model = apply_tensor_parallelism(model, tp_mesh)

    elif distributed_config.fsdp_size > 1:

so a 2-D request builds a ``tp_size``-rank mesh, FSDP is never applied, and on the ranks outside that mesh loading
fails with ``IndexError: list index out of range`` (``DeviceMesh.get_group``) while the others wait in collectives.
5.18 applies both (transformers 5.18 ``maybe_distribute_model``: "Both may apply"). The wrapper calls
:func:`shardadopt.loadtime.refuse_fsdp_with_tp` at the top of ``prepare_distribute_model``, before any mesh exists,
so every rank raises the same error naming the fix.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

from shardadopt.registry import Patch, Probe, Target

MODULE = "transformers.distributed.mixin"
FSDP_APPLY = "apply_fully_sharded_data_parallelism"


def fsdp_applied_only_without_tp(function) -> bool:
    """Whether ``function`` calls ``apply_fully_sharded_data_parallelism`` only in the else branch of a
    ``tp_size`` test (so it never applies both)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))

    def calls_fsdp(nodes) -> bool:
        return any(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == FSDP_APPLY
                   for node in nodes for n in ast.walk(node))

    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "tp_size" in ast.unparse(node.test) and calls_fsdp(node.orelse):
            return not calls_fsdp(node.body)
    return False


def probe() -> Probe:
    from transformers.distributed import DistributedConfig, mixin

    try:
        DistributedConfig(fsdp_size=2, tp_size=2)
    except (TypeError, ValueError):
        return Probe(False, "DistributedConfig itself refuses fsdp_size with tp_size")
    if not fsdp_applied_only_without_tp(mixin.DistributedMixin.maybe_distribute_model):
        return Probe(False, "maybe_distribute_model applies FSDP and TP together (2-D loading)")
    return Probe(True, "DistributedConfig accepts fsdp_size with tp_size, but maybe_distribute_model applies TP "
                       "alone: 2-D loading fails on the ranks outside the TP mesh")


def _prepare_distribute_model(wrapped, instance, args, kwargs):
    from transformers import __version__

    from shardadopt.loadtime import refuse_fsdp_with_tp

    refuse_fsdp_with_tp(args[0] if args else kwargs.get("distributed_config"), __version__)
    return wrapped(*args, **kwargs)


PATCH = Patch(
    id="transformers-fsdp-tp-refused",
    summary="fsdp_size with tp_size (2-D) raises a clear error where transformers accepts it but applies TP alone",
    upstream="fixed by 2-D loading in transformers 5.18 (maybe_distribute_model applies TP then FSDP)",
    requires={"transformers": ">=5.15,<5.25"},
    wrappers={Target(MODULE, "DistributedMixin.prepare_distribute_model"): _prepare_distribute_model},
    probe=probe,
)
