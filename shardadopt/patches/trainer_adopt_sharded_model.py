"""Trainer leaves a load-time-sharded model where it is and hands the optimizer its sharded parameters (F6).

Upstream (``transformers/trainer.py``; which releases need the patch is what its probe says, recorded per release in
``tests/data/release_matrix.json``) treated such a model like a plain one. ``Trainer.__init__`` moves it
(``place_model_on_device`` is True unless DeepSpeed/FSDP-plugin/model-parallel)::

    if self.place_model_on_device and ...:
        self._move_model_to_device(model, args.device)      # model.to(device) on FSDP2 / DTensor parameters

``.to()`` on FSDP2 modules re-creates every sharded parameter (``FSDPModule._apply`` -> ``reset_sharded_param``):
with ``fsdp_cpu_offload`` it moves the offloaded shards onto the accelerator (or fails pinning them), the same
happens again for ``model_init`` in ``train()``. And ``_prepare_for_training`` builds the optimizer with::

    if not delay_optimizer_creation:
        self.create_optimizer()

from ``model.parameters()`` as they are at that moment: after any forward before training (``trainer.evaluate()``
before ``train()``), the FSDP2 groups built with ``reshard_after_forward=False`` (the final norm and LM head) still
expose their *unsharded* plain parameters, so the optimizer steps copies that FSDP throws away and those weights
silently never train. Read in each release: 5.15 .. 5.17 move the model; 5.18 sets ``place_model_on_device =
False`` for a model with a ``_device_mesh``, 5.19 for ``is_distributed_loading_by_transformers`` models; only 5.24
also calls ``module.reshard()`` on every FSDP2 module before ``create_optimizer()``. The probe parses both places
(the ``place_model_on_device = False`` conditions in ``__init__``, a ``reshard()`` before ``create_optimizer()`` in
``_prepare_for_training``) and answers not-needed only where it finds both fixes. 5.15's tensor parallelism also
leaves row-parallel shards as plain non-contiguous views, which torch's fused CPU AdamW
(``optim="adamw_torch_fused"``) mis-updates (5.19+ shard TP with DTensors).

The accelerate side of adoption (no DDP wrap, data split, clipping, optimizer groups) is the
accelerate-adopt-sharded-model patch, which Trainer reaches through ``accelerator.prepare``. Here, only for a
sharded model outside accelerate's FSDP/DeepSpeed plugins: ``_move_model_to_device`` leaves it in place, and
``create_optimizer`` first reshards its FSDP2 modules and gives non-contiguous plain shards their own storage
(:func:`shardadopt.parallel.optimizer_ready.prepare_for_optimizer`).
"""

from __future__ import annotations

import ast
from typing import Any

from shardadopt import upstream
from shardadopt.patching.contract import Patch, Probe, Target
from shardadopt.upstream.versions import supported

_MODULE = upstream.TRAINER_MODULE


def _ours(trainer: Any, model: Any) -> bool:
    from shardadopt.checkpoint import is_sharded

    if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False):
        return False
    return model is not None and is_sharded(model)


def move_model_to_device(wrapped, instance, args, kwargs):
    model = args[0] if args else kwargs.get("model")
    if _ours(instance, model):
        return None  # the model's shards are where its DistributedConfig put them
    return wrapped(*args, **kwargs)


def create_optimizer(wrapped, instance, args, kwargs):
    model = args[0] if args else kwargs.get("model")
    model = model if model is not None else instance.model
    if instance.optimizer is None and _ours(instance, model):
        from shardadopt.parallel.optimizer_ready import prepare_for_optimizer

        prepare_for_optimizer(model)
    return wrapped(*args, **kwargs)


# Conditions under which upstream keeps a load-time-sharded model in place: 5.19+ test
# `self.is_distributed_loading_by_transformers`, 5.18 `getattr(model, "_device_mesh", None) is not None`.
_IN_PLACE_MARKERS = {"is_distributed_loading_by_transformers", upstream.MODEL_DEVICE_MESH_ATTRIBUTE}


def _keeps_sharded_model_in_place(init) -> bool:
    """From ``Trainer.__init__``: the condition list that sets ``self.place_model_on_device = False`` (an ``or`` of
    DeepSpeed, FSDP, model parallel, ...), and whether it names a load-time-sharded model."""
    from shardadopt.upstream.probing import if_chains, names, undecided

    for chain in if_chains(init):
        for test, body in chain:
            sets_false = any(isinstance(s, ast.Assign) and isinstance(s.value, ast.Constant) and s.value.value is False
                             and any(isinstance(t, ast.Attribute) and t.attr == "place_model_on_device"
                                     for t in s.targets) for s in body)
            if test is not None and sets_false and "is_deepspeed_enabled" in names(test):
                return bool(names(test) & _IN_PLACE_MARKERS)
    raise undecided("Trainer.__init__", "the conditions that set place_model_on_device = False")


def _reshards_before_optimizer(prepare) -> bool:
    """From ``Trainer._prepare_for_training``: whether load-time-sharded FSDP2 modules are resharded before
    ``self.create_optimizer()`` (the call without arguments; ``create_optimizer(model)`` is the FSDP-plugin path that
    creates it after ``prepare``). The fix's shape (5.24): a ``.reshard()`` under ``isinstance(.., FSDPModule)``
    guarded by a test naming load-time sharding; a ``.reshard()`` before the optimizer in any other shape is one this
    probe does not know."""
    from shardadopt.upstream.probing import callee, enclosing_tests, in_order, names, undecided

    where = upstream.TRAINER_PREPARE_FOR_TRAINING.qualname
    reshards = []
    for node in in_order(prepare):
        if isinstance(node, ast.Call) and callee(node) == "reshard":
            reshards.append(node)
        if isinstance(node, ast.Call) and callee(node) == "create_optimizer" and not node.args:
            for reshard in reshards:
                guards = set().union(*map(names, enclosing_tests(prepare, reshard)))
                if "FSDPModule" not in guards or not guards & _IN_PLACE_MARKERS:
                    raise undecided(where, "no reshard before self.create_optimizer() (this patch's broken shape) "
                                    "nor the reshard of load-time-sharded FSDPModules (the fix)")
            return bool(reshards)
    raise undecided(where, "the self.create_optimizer() call")


def probe() -> Probe:
    """Parse ``Trainer.__init__`` (device placement) and ``Trainer._prepare_for_training`` (optimizer creation)."""
    from transformers.trainer import Trainer

    from shardadopt.upstream.probing import source_tree, upstream_function

    where = "trainer-adopt probe"
    in_place = _keeps_sharded_model_in_place(source_tree(upstream_function(Trainer, "__init__", where)))
    prepare = upstream.upstream_method(upstream.TRAINER_PREPARE_FOR_TRAINING, where)
    reshards = _reshards_before_optimizer(source_tree(prepare))
    if in_place and reshards:
        return Probe(False, "Trainer keeps load-time-sharded models in place and reshards them before building the "
                            "optimizer")
    moves = "" if in_place else "moves load-time-sharded models with .to() and "
    fixed = "; it does keep them in place" if in_place else ""
    return Probe(True, f"Trainer {moves}builds the optimizer from whatever parameters FSDP2 exposes (unsharded ones "
                       f"after an evaluate() before train()){fixed}")


PATCH = Patch(
    id="trainer-adopt-sharded-model",
    summary="Trainer: no .to() of load-time-sharded models; optimizer built from the resharded FSDP2 parameters",
    upstream="backports huggingface/transformers: load-time-sharded models stay in place (5.18 `_device_mesh`, "
             "5.19 is_distributed_loading_by_transformers) and FSDP2 reshards before create_optimizer (5.24)",
    requires=supported("transformers"),
    wrappers={upstream.TRAINER_MOVE_MODEL_TO_DEVICE: move_model_to_device,
              Target(_MODULE, "Trainer.create_optimizer"): create_optimizer},
    probe=probe,
    # Trainer prepares the model through accelerate: without adoption it DDP-wraps the sharded model.
    depends_on=("accelerate-adopt-sharded-model",),
)
