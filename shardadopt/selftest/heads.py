"""Classification heads on load-time-sharded models: the test suite's accelerate-loop workers and their one-process
reference (next to ``accelerate``, whose loop settings and comparison they share; not a selftest scenario).

``AutoModelForSequenceClassification`` and ``AutoModelForTokenClassification`` put a ``score`` linear on the base
model, outside the LM's TP plan. :func:`train_rank` runs the accelerate loop users write (``prepare``,
``accumulate``, ``backward``, ``clip_grad_norm_``, AdamW) on a head loaded with ``DistributedConfig``;
:func:`train_reference` runs the same steps in one process on the same global batches. Rows are padded (on the right,
with the config's ``pad_token_id``), so sequence classification pools a token before the row's end, and token
classification ignores the pads; every data-parallel rank's micro-batch has the same number of labelled tokens, so
the mean of the ranks' losses is the one-process loss.
"""

from __future__ import annotations

from typing import Any

from shardadopt.selftest.accelerate import ACCUM, LR, MAX_NORM, PER_DP_BATCH, STEPS, whole_tensor
from shardadopt.testing.accelerator import fresh_accelerator
from shardadopt.testing.models import PAD_ID, SEQUENCE_LABELS, TOKEN_LABELS, VOCAB_SIZE, local_copy

HEADS = ("sequence", "token")
SEQ_LEN = 16
SEED = 97
GRAD_RTOL = 1e-4  # sharded matmuls and reductions sum in another order than one process
GRAD_ATOL = 1e-7


def auto_class(head: str):
    """The transformers Auto class a user loads ``head`` ("sequence" or "token") with."""
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    return {"sequence": AutoModelForSequenceClassification, "token": AutoModelForTokenClassification}[head]


def load(path: str, head: str, sizes: dict[str, Any] | None):
    """The head in fp32, sharded per ``sizes`` (``DistributedConfig`` kwargs) or plain."""
    import torch

    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if sizes:
        from transformers.distributed import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(**sizes)
    return auto_class(head).from_pretrained(path, **kwargs)


def rows(head: str, dp_size: int, steps: int = STEPS, accum: int = ACCUM) -> list[dict[str, Any]]:
    """The dataset: ``steps * accum`` global micro-batches of ``dp_size * PER_DP_BATCH`` rows. Odd rows are padded
    on the right by 3 to 6 tokens (the same length across one global micro-batch, so every rank's micro-batch holds
    as many labelled tokens); labels per row ("sequence") or per token, -100 on pads ("token")."""
    import torch

    n = steps * accum * dp_size * PER_DP_BATCH
    generator = torch.Generator().manual_seed(SEED)
    ids = torch.randint(1, VOCAB_SIZE, (n, SEQ_LEN), generator=generator)  # 0 is the pad id
    mask = torch.ones_like(ids)
    for i in range(1, n, 2):
        pad = 3 + (i // (dp_size * PER_DP_BATCH)) % 4
        ids[i, SEQ_LEN - pad:], mask[i, SEQ_LEN - pad:] = PAD_ID, 0
    if head == "sequence":
        labels = torch.randint(0, SEQUENCE_LABELS, (n,), generator=generator)
    else:
        labels = torch.randint(0, TOKEN_LABELS, (n, SEQ_LEN), generator=generator).masked_fill(mask == 0, -100)
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(n)]


def score_layout(model) -> dict[str, Any]:
    """How the ``score`` head's weight is held: its type, DTensor placements, local shape, and whether ``score`` is an
    FSDP unit of its own (else the unit that holds it)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    weight = model.score.weight
    owner = next((name or "<root>" for name, m in reversed(list(model.named_modules()))
                  if isinstance(m, FSDPModule) and any(p is weight for p in m.parameters())), None)
    return {"type": type(weight).__name__,
            "placements": [str(p) for p in weight.placements] if isinstance(weight, DTensor) else None,
            "local_shape": tuple(local_copy(weight).shape), "fsdp_unit": owner}


def _gathered(tensors: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every rank's ``tensors`` (DTensors gathered whole first) on global rank 0, None elsewhere."""
    import torch.distributed as dist

    from shardadopt.testing import full

    mine = {n: full(t).detach().cpu() for n, t in tensors.items()}
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine)
    return per_rank if dist.get_rank() == 0 else None


def train_rank(path: str, head: str, sizes: dict[str, Any], dp_size: int, patched: bool = True) -> dict[str, Any]:
    """The accelerate loop on ``head`` loaded sharded per ``sizes``: per-step loss and clipped norm, the first step's
    gradients and the final parameters (every rank's copy, on global rank 0), the score head's layout, and whether
    ``prepare`` left every local parameter as loaded."""
    import torch

    import shardadopt

    shardadopt.enable() if patched else shardadopt.disable()
    try:
        accelerator = fresh_accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
        model = load(path, head, sizes)
        before = {n: local_copy(p) for n, p in model.named_parameters()}
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
        loader = torch.utils.data.DataLoader(rows(head, dp_size), batch_size=PER_DP_BATCH)
        try:
            model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        network = accelerator.unwrap_model(model)
        unchanged = all(torch.equal(local_copy(p), before[n]) for n, p in network.named_parameters())
        losses, norms, micro, grads = [], [], [], []
        try:
            for batch in loader:
                with accelerator.accumulate(model):
                    loss = model(**batch).loss
                    micro.append(loss.detach())
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        if not losses:  # the first step's gradients, reduced and not yet clipped
                            grads = _gathered({n: p.grad for n, p in network.named_parameters()})
                        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
                        losses.append(float(accelerator.reduce(torch.stack(micro).mean(), "mean")))
                        micro = []
                    optimizer.step()
                    optimizer.zero_grad()
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        return {"losses": losses, "norms": norms, "grads": grads, "score": score_layout(network),
                "params": _gathered(dict(network.named_parameters())), "unchanged": unchanged}
    finally:
        shardadopt.disable()


def train_reference(path: str, head: str, dp_size: int) -> dict[str, Any]:
    """One process, the same global micro-batches and optimizer steps as :func:`train_rank` over ``dp_size``
    data-parallel ranks."""
    import torch

    model = load(path, head, None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    data = rows(head, dp_size)
    size = dp_size * PER_DP_BATCH
    losses, norms, grads = [], [], None
    for step in range(STEPS):
        micro = []
        for m in range(ACCUM):
            start = (step * ACCUM + m) * size
            batch = {k: torch.stack([row[k] for row in data[start:start + size]]) for k in data[0]}
            loss = model(**batch).loss
            (loss / ACCUM).backward()
            micro.append(loss.detach())
        if grads is None:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        losses.append(float(torch.stack(micro).mean()))
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "norms": norms, "grads": grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def wrong_grads(result: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """The parameters whose first-step gradient (reassembled from the ranks) differs from one process's."""
    import torch

    bad = []
    for name, want in expected["grads"].items():
        got = whole_tensor([r[name] for r in result["grads"]], want.shape)
        if got.shape != want.shape or not torch.allclose(got, want, rtol=GRAD_RTOL, atol=GRAD_ATOL):
            bad.append(name)
    return bad


# -- checkpoints: accelerate save_state/load_state and the full-weight export -------------------------------------

SAVE_AFTER, TOTAL = 2, 4  # steps before save_state, steps in all


def _checkpoint_setup(path: str, head: str, sizes: dict[str, Any], dp_size: int, project_dir: str):
    """Accelerator (checkpoints under ``project_dir``), the sharded head, AdamW and a warm-up scheduler, and the
    dataloader, through ``prepare``."""
    import torch
    from accelerate.utils import ProjectConfiguration

    accelerator = fresh_accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=project_dir, automatic_checkpoint_naming=True))
    model = load(path, head, sizes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
    loader = torch.utils.data.DataLoader(rows(head, dp_size, steps=TOTAL, accum=1), batch_size=PER_DP_BATCH)
    return (accelerator, *accelerator.prepare(model, optimizer, loader, scheduler))


def _checkpoint_steps(accelerator, model, optimizer, batches, scheduler, steps: int) -> list[float]:
    """``steps`` optimizer steps on the next batches of the iterator ``batches``; the global mean losses."""
    losses = []
    for _, batch in zip(range(steps), batches):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(float(accelerator.reduce(loss.detach(), "mean")))
    return losses


def probe_batch(head: str) -> dict[str, Any]:
    """A fixed padded batch for comparing outputs (the same on every rank)."""
    import torch

    data = rows(head, 1, steps=1, accum=1)
    return {k: torch.stack([row[k] for row in data]) for k in ("input_ids", "attention_mask")}


def checkpoint_run(path: str, head: str, sizes: dict[str, Any], dp_size: int, project_dir: str,
                   export_dir: str) -> dict[str, Any]:
    """:data:`TOTAL` steps with ``accelerator.save_state()`` after :data:`SAVE_AFTER`, then
    ``shardadopt.checkpoint.save_full`` into ``export_dir``. Per-step losses, the final parameters (full tensors)
    and the sharded model's logits on :func:`probe_batch`, or ``{"error"}`` (on global rank 0)."""
    import torch

    import shardadopt
    from shardadopt import checkpoint
    from shardadopt.testing import full

    shardadopt.enable()
    try:
        accelerator, model, optimizer, loader, scheduler = _checkpoint_setup(path, head, sizes, dp_size, project_dir)
        batches = iter(loader)  # one pass over the data, across the save
        losses = _checkpoint_steps(accelerator, model, optimizer, batches, scheduler, SAVE_AFTER)
        accelerator.save_state()
        losses += _checkpoint_steps(accelerator, model, optimizer, batches, scheduler, TOTAL - SAVE_AFTER)
        network = accelerator.unwrap_model(model)
        params = {n: full(p).detach().clone() for n, p in network.named_parameters()}
        try:
            checkpoint.save_full(network, export_dir)
        except checkpoint.CheckpointError as exc:
            return {"losses": losses, "params": params, "error": f"{type(exc).__name__}: {exc}"}
        network.eval()
        with torch.no_grad():
            logits = full(network(**probe_batch(head)).logits).detach().clone()
        return {"losses": losses, "params": params, "logits": logits}
    finally:
        shardadopt.disable()


def checkpoint_resume(path: str, head: str, sizes: dict[str, Any], dp_size: int, project_dir: str) -> dict[str, Any]:
    """A fresh accelerator and load: ``accelerator.load_state()`` (the latest checkpoint under ``project_dir``),
    the batches seen skipped, the remaining steps trained. Their losses and the final parameters."""
    import torch

    import shardadopt
    from shardadopt.testing import full

    shardadopt.enable()
    try:
        torch.manual_seed(12345)  # what continues must come from the checkpoint
        accelerator, model, optimizer, loader, scheduler = _checkpoint_setup(path, head, sizes, dp_size, project_dir)
        accelerator.load_state()
        remaining = iter(accelerator.skip_first_batches(loader, SAVE_AFTER))
        losses = _checkpoint_steps(accelerator, model, optimizer, remaining, scheduler, TOTAL - SAVE_AFTER)
        params = {n: full(p).detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters()}
        return {"losses": losses, "params": params}
    finally:
        shardadopt.disable()


def fresh_head_copies(causal_lm: str, sizes: dict[str, Any]) -> dict[str, Any]:
    """Each rank seeded with its own rank (``set_seed(seed, device_specific=True)`` does this), a sequence-
    classification model loaded sharded from the causal-LM checkpoint ``causal_lm`` (its ``score`` is missing there:
    each rank initialises it), then ``accelerator.prepare``: this rank's ``score`` before and after."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForSequenceClassification
    from transformers.distributed import DistributedConfig

    import shardadopt

    shardadopt.enable()
    try:
        accelerator = fresh_accelerator(cpu=True)
        torch.manual_seed(dist.get_rank())
        model = AutoModelForSequenceClassification.from_pretrained(causal_lm, num_labels=1, dtype=torch.float32,
                                                                   distributed_config=DistributedConfig(**sizes))
        before = local_copy(model.score.weight)
        model = accelerator.prepare(model)
        return {"before": before, "after": local_copy(accelerator.unwrap_model(model).score.weight)}
    finally:
        shardadopt.disable()
