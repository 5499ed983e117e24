"""The Trainer's accelerator taking the parallelism of a model that ``model_init`` built.

``Trainer.__init__`` builds its accelerator before ``model_init`` has produced a model, so
``ParallelismConfig(tp_size, dp_shard_size)``, which upstream derives from ``self.model``, is left out; accelerate
then keeps that first process-wide state for every later ``Accelerator``. A model sharded at load time with
``tp_size > 1`` then trains with every rank taken as its own data-parallel replica: the TP ranks get different
batches and the run is silently wrong. ``Trainer.call_model_init`` (patch ``trainer-model-init-parallelism``),
which ``Trainer.__init__`` and ``train()`` call (outside a search and in every trial of ``hyperparameter_search``), goes
through :func:`align_accelerator_with_model`.
"""

from __future__ import annotations

from typing import Any

from shardadopt import upstream


def align_accelerator_with_model(trainer: Any, model: Any) -> bool:
    """Rebuild ``trainer``'s accelerator for ``model`` when ``model`` is tensor parallel (``tp_size > 1``) and the
    accelerator's ``ParallelismConfig`` is missing or has another ``tp_size``: forget accelerate's process-wide
    state (its ranks stay), make ``model`` the Trainer's model (upstream derives the config from it) and call
    ``create_accelerator_and_postprocess``. Returns whether it rebuilt; any other model leaves everything as is."""
    tp_size = getattr(model, "tp_size", None) or 1
    config = trainer.accelerator.parallelism_config
    if tp_size <= 1 or (config is not None and config.tp_size == tp_size):
        return False
    upstream.reset_accelerator_state()
    trainer.model = model
    trainer.create_accelerator_and_postprocess()
    return True
