"""Where the stacking order of two shipped patches on one upstream attribute changes what a call does, the shipped
order is the declared one (``wraps_around``, shardadopt.patching.stacking): each test here calls the real stacked
attribute and fails when the two patches stack the other way round."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import shardadopt
from shardadopt.patching.registry import APPLIED

INIT_PARALLELISM, CHECKPOINT = "trainer-model-init-parallelism", "trainer-sharded-checkpoint"


class TensorParallelModel(torch.nn.Module):
    """What a model_init returns after ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=2))`` on
    transformers 5.15 as far as both patches read it: ``tp_size`` 2, plain (non-DTensor) parameters."""

    tp_size = 2

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(2, 2)
        self.config = SimpleNamespace(distributed_config=SimpleNamespace(tp_size=2))


def test_the_accelerator_rebuilt_for_a_model_init_model_sees_save_only_model_as_trainer_model_does(monkeypatch):
    """``Trainer(model_init=...)`` on a tensor-parallel model: trainer-sharded-checkpoint lifts the Trainer's refusal
    (``save_only_model`` set for the ``__init__``) once ``call_model_init`` returned the model, and
    trainer-model-init-parallelism rebuilds the accelerator for it. The rebuild (upstream's
    ``create_accelerator_and_postprocess``, whose ``save_only_model`` checks it runs) must come after the lift, as
    for ``Trainer(model=...)``, where the flag is lifted before ``__init__`` builds the accelerator: the
    model-init patch wraps around the checkpoint patch."""
    from transformers.trainer import Trainer

    from shardadopt import upstream
    from shardadopt.checkpoint.trainer import refusal_lifted

    monkeypatch.setattr(upstream, "reset_accelerator_state", lambda: None)  # no accelerator state to forget here
    try:
        states = {s.id: s.state for s in shardadopt.enable(only=[INIT_PARALLELISM, CHECKPOINT])}
        if {states[INIT_PARALLELISM], states[CHECKPOINT]} != {APPLIED}:
            pytest.skip(f"both patches must apply to stack: {states}")
        seen = []
        args = SimpleNamespace(save_strategy="steps", save_only_model=False)
        # a Trainer as far as call_model_init and the two wrappers read it, calling the stacked method itself
        fake = type("FakeTrainer", (SimpleNamespace,), {"call_model_init": Trainer.__dict__["call_model_init"]})
        trainer = fake(model_init=TensorParallelModel, args=args, accelerator=SimpleNamespace(parallelism_config=None),
                       create_accelerator_and_postprocess=lambda: seen.append(args.save_only_model))
        with refusal_lifted(trainer, args, None):  # as the checkpoint patch's Trainer.__init__ wrapper does
            model = trainer.call_model_init()
        assert trainer.model is model and seen == [True], (
            "the accelerator was rebuilt before the refusal was lifted: trainer-model-init-parallelism must wrap "
            "around trainer-sharded-checkpoint")
        assert args.save_only_model is False, "the lift ends with the Trainer's __init__"
    finally:
        shardadopt.disable()
