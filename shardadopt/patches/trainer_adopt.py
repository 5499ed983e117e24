"""Trainer leaves a load-time-sharded model where it is and hands the optimizer its sharded parameters (F6).

Upstream (transformers 5.15 .. 5.18, ``transformers/trainer.py``) treats such a model like a plain one:

``Trainer.__init__`` moves it (``place_model_on_device`` is True unless DeepSpeed/FSDP-plugin/model-parallel)::

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
silently never train. 5.19 sets ``place_model_on_device = False`` for ``is_distributed_loading_by_transformers``
models; later releases (5.24 has it, 5.20 not yet) also call ``module.reshard()`` on every FSDP2 module before
``create_optimizer``. 5.15's tensor
parallelism also leaves row-parallel shards as plain non-contiguous views, which torch's fused CPU AdamW
(``optim="adamw_torch_fused"``) mis-updates (5.19+ shard TP with DTensors).

The accelerate side of adoption (no DDP wrap, data split, clipping, optimizer groups) is the
accelerate-adopt-sharded-model patch, which Trainer reaches through ``accelerator.prepare``. Here, only for a
sharded model outside accelerate's FSDP/DeepSpeed plugins: ``_move_model_to_device`` leaves it in place, and
``create_optimizer`` first reshards its FSDP2 modules and gives non-contiguous plain shards their own storage
(:func:`shardadopt.optimizer_ready.prepare_for_optimizer`).
"""

from __future__ import annotations

import inspect
from typing import Any

from shardadopt.registry import Patch, Probe, Target

PATCH_ID = "trainer-adopt-sharded-model"
_MODULE = "transformers.trainer"


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
        from shardadopt.optimizer_ready import prepare_for_optimizer

        prepare_for_optimizer(model)
    return wrapped(*args, **kwargs)


def probe() -> Probe:
    from transformers.trainer import Trainer

    init = inspect.getsource(Trainer.__init__)
    training = inspect.getsource(Trainer._inner_training_loop)
    if hasattr(Trainer, "_prepare_for_training"):
        training += inspect.getsource(Trainer._prepare_for_training)
    in_place, reshards = "is_distributed_loading_by_transformers" in init, ".reshard()" in training
    if in_place and reshards:
        return Probe(False, "Trainer keeps load-time-sharded models in place and reshards them before building the "
                            "optimizer")
    # 5.19 .. 5.20 already keep the model in place but still build the optimizer without resharding.
    moves = "" if in_place else "moves load-time-sharded models with .to() and "
    return Probe(True, f"Trainer {moves}builds the optimizer from whatever parameters FSDP2 exposes (unsharded ones "
                       "after an evaluate() before train())")


PATCH = Patch(
    id=PATCH_ID,
    summary="Trainer: no .to() of load-time-sharded models; optimizer built from the resharded FSDP2 parameters",
    upstream="backports huggingface/transformers 5.19 (Trainer.is_distributed_loading_by_transformers: "
             "place_model_on_device=False, FSDP2 reshard before create_optimizer)",
    requires={"transformers": ">=5.15,<5.25"},
    wrappers={Target(_MODULE, "Trainer._move_model_to_device"): move_model_to_device,
              Target(_MODULE, "Trainer.create_optimizer"): create_optimizer},
    probe=probe,
)
