"""Scenario "collectives": the collectives of each optimizer step of LoRA on a load-time-sharded model, counted.

``count_lora_step_collectives`` runs the user's accelerate loop (as ``training`` does) and counts, per optimizer
step, the collectives by kind (``shardadopt.testing.collectives.counted_collectives``) and the ``all_reduce`` calls
that average adapter gradients (one per step per data-parallel group: the factors are averaged together), with the
FSDP2 layout the counts follow from: the parameter groups holding weights (one all-gather each), which of them
reshard after forward, and how many decoder layers (the units whose backward needs their weights again) there are.
tests/adapters/ asserts them.
"""

from __future__ import annotations

from typing import Any

from shardadopt.testing.lora.common import ACCUM, LR, MAX_NORM, PER_DP_BATCH, SEED, load_model, lora_config, token_rows


def count_lora_step_collectives(
    path: str, sizes: dict[str, Any], dp_size: int, gathered: bool | str, steps: int = 2, accum: int = ACCUM
) -> dict[str, Any]:
    """``steps`` optimizer steps of ``accum`` micro-batches; ``gathered``: with
    ``AdoptionKwargs(keep_frozen_units_gathered=True)``, or ``"across_steps"`` with
    ``AdoptionKwargs(keep_frozen_units_gathered_across_steps=True)``. Returns ``{"per_step": [{kind: calls,
    "adapter_averages": calls}], "units": FSDP modules holding weights, "groups": their parameter groups (one
    all-gather each), "frozen_units": modules all frozen, "kept": groups not resharded after forward, "layers":
    decoder layers, "held": bytes the option holds, "accum": accum}``."""
    import torch
    import torch.distributed as dist
    from peft import get_peft_model
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    import shardadopt
    from shardadopt import upstream
    from shardadopt.adapters.data_parallel import covered_gradients
    from shardadopt.adopt import frozen_units, keep_frozen_units_gathered
    from shardadopt.testing.accelerator import fresh_accelerator
    from shardadopt.testing.collectives import counted_collectives

    shardadopt.enable()
    try:
        handlers = [shardadopt.AdoptionKwargs(keep_frozen_units_gathered=bool(gathered),
                                              keep_frozen_units_gathered_across_steps=gathered == "across_steps")]
        accelerator = fresh_accelerator(cpu=True, gradient_accumulation_steps=accum, kwargs_handlers=handlers)
        torch.manual_seed(SEED)
        model = get_peft_model(load_model(path, sizes), lora_config())
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
        loader = torch.utils.data.DataLoader(list(token_rows(dp_size, steps, accum)), batch_size=PER_DP_BATCH)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        factors = [p for n, p in model.named_parameters() if "lora_" in n and p.requires_grad]
        units = [m for m in model.modules() if isinstance(m, FSDPModule) and upstream.fsdp_managed_parameters(m)]
        # the all-gather units: parameter groups (modules sharded together, fully_shard([norm, lm_head]), share one)
        groups = {id(g): g for m in units for g in upstream.fsdp_param_groups(m)}
        layout = {
            "units": len(units),
            "groups": len(groups),
            "frozen_units": len(frozen_units(model)),
            "kept": sum(g.post_forward_mesh_info is None for g in groups.values()),
            "layers": len(model.get_base_model().model.layers),
            "accum": accum,
            "held": keep_frozen_units_gathered(model, across_steps=gathered == "across_steps") if gathered else 0,
        }

        averages = [0]
        original = dist.all_reduce

        def all_reduce(tensor, *args, **kwargs):
            grads = [upstream.dtensor_local(p.grad) if isinstance(p.grad, DTensor) else p.grad for p in factors]
            if covered_gradients(tensor) or any(g is not None and g.data_ptr() == tensor.data_ptr() for g in grads):
                averages[0] += 1
            return original(tensor, *args, **kwargs)

        per_step = []
        batches = iter(loader)
        dist.all_reduce = all_reduce
        try:
            for _ in range(steps):
                averages[0] = 0
                with counted_collectives() as counts:
                    for _ in range(accum):
                        with accelerator.accumulate(model):
                            batch = next(batches)
                            accelerator.backward(model(input_ids=batch, labels=batch).loss)
                            if accelerator.sync_gradients:
                                accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                            optimizer.step()
                            optimizer.zero_grad()
                per_step.append({**counts, "adapter_averages": averages[0]})
        finally:
            dist.all_reduce = original
        return {"per_step": per_step, **layout}
    finally:
        shardadopt.disable()


def average_gradient_sets() -> dict[str, Any]:
    """``shardadopt.adapters.average_gradients`` on this rank's gradients (each rank's values differ by rank):
    ``{"calls": all_reduce calls it reported, "issued": calls seen, "grads": the averaged gradients, "rank_grads":
    gradients of every rank before averaging (gathered), "untouched": a parameter without gradient stayed so}``. A
    world set of two fp32 parameters and one fp64, and a set over a subgroup."""
    import torch
    import torch.distributed as dist

    from shardadopt.adapters import average_gradients

    rank = dist.get_rank()
    params = [
        torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        for shape, dtype in (
            ((3, 2), torch.float32),
            ((4,), torch.float32),
            ((2,), torch.float64),
            ((5,), torch.float32),
        )
    ]
    for index, param in enumerate(params):
        param.grad = torch.arange(param.numel(), dtype=param.dtype).reshape(param.shape) * (rank + 1) + index
    without = torch.nn.Parameter(torch.zeros(2))
    before = [p.grad.clone() for p in params]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, before)
    subgroup = dist.new_group(list(range(dist.get_world_size())))
    issued = [0]
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        issued[0] += 1
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        calls = average_gradients([(params[:3] + [without], None), (params[3:], subgroup)])
    finally:
        dist.all_reduce = original
    return {
        "calls": calls,
        "issued": issued[0],
        "grads": [p.grad for p in params],
        "rank_grads": gathered,
        "untouched": without.grad is None,
    }


def trainer_lora_run(path: str, sizes: dict[str, Any], dp_size: int, gathered: bool, directory: str,
                     steps: int = 2, accum: int = ACCUM) -> dict[str, Any]:
    """LoRA trained by the plain transformers ``Trainer`` (``gradient_accumulation_steps=accum``, clipping, logging
    every step) for ``steps`` optimizer steps; ``gathered``: the user called
    ``shardadopt.adopt.keep_frozen_units_gathered(model)`` after ``get_peft_model`` (the Trainer builds its own
    Accelerator, so ``AdoptionKwargs`` cannot reach it). Returns ``{"log": [{"loss", "grad_norm"} per step],
    "per_step": [{kind: calls} from each step's first micro-batch to its update (the loss logging after it not
    included)], "groups": the FSDP parameter groups holding weights (one all-gather each), "held": bytes the option
    holds}``."""
    import contextlib

    import torch
    from peft import get_peft_model
    from torch.distributed.fsdp import FSDPModule
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    import shardadopt
    from shardadopt import upstream
    from shardadopt.adopt import keep_frozen_units_gathered
    from shardadopt.testing.collectives import counted_collectives
    from shardadopt.testing.trl import logged_steps

    per_step: list[dict[str, int]] = []

    class CountSteps(TrainerCallback):
        def __init__(self) -> None:
            self.stack = contextlib.ExitStack()

        def on_step_begin(self, args, state, control, **kwargs):
            per_step.append(self.stack.enter_context(counted_collectives()))

        def on_step_end(self, args, state, control, **kwargs):
            self.stack.close()

    shardadopt.enable()
    try:
        upstream.reset_accelerate_state()  # pooled ranks run several trainers in one process
        torch.manual_seed(SEED)
        model = get_peft_model(load_model(path, sizes), lora_config())
        held = keep_frozen_units_gathered(model) if gathered else 0
        groups = {id(g) for m in model.modules() if isinstance(m, FSDPModule) for g in upstream.fsdp_param_groups(m)
                  if upstream.fsdp_managed_parameters(m)}
        data = [{"input_ids": row, "labels": row} for row in token_rows(dp_size, steps, accum)]
        args = TrainingArguments(output_dir=directory, per_device_train_batch_size=PER_DP_BATCH,
                                 gradient_accumulation_steps=accum, max_steps=steps, learning_rate=LR,
                                 lr_scheduler_type="constant", max_grad_norm=MAX_NORM, logging_steps=1,
                                 save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[CountSteps()])
        trainer.remove_callback(PrinterCallback)
        trainer.train()
        return {"log": logged_steps(trainer), "per_step": per_step, "groups": len(groups), "held": held}
    finally:
        shardadopt.disable()
