"""Selftest scenarios (and the test suite's workers) for an ordinary accelerate loop on a sharded model.

``train_rank`` runs the loop users write — ``prepare``, ``accumulate``, ``backward``, ``clip_grad_norm_``,
foreach AdamW — on a model loaded with ``DistributedConfig``; ``train_reference`` runs the same optimizer steps in
one process on the same global batches. Per-step loss, grad norm and the final parameters must agree.
"""

from __future__ import annotations

from typing import Any

from shardadopt import upstream
from shardadopt.selftest.scenario import Context, Scenario
from shardadopt.testing.accelerator import fresh_accelerator
from shardadopt.testing.layouts import LayoutUnsupported, distributed_sizes
from shardadopt.testing.models import local_copy

SEED = 4321
PER_DP_BATCH = 2
ACCUM = 2
STEPS = 5
LR = 1e-3
# Parameters after training. Adam normalises every element's update, so float reduction-order noise on a gradient
# that nearly cancels can move that one element by a sizeable fraction of a step (worst seen: 1e-5 = 1% of LR, one
# element of 8192, 2-D fsdp x tp on 4 ranks; no fixed per-element tolerance is safe). A parameter matches when no
# element is off by half a step or more and the tensor's RMS difference is within 1e-3 of LR: a real error (wrong
# data, gradient, clip or update) moves whole rows or tensors by ~LR per step, far beyond both.
PARAM_MAX_DIFF = 0.5 * LR
PARAM_RMS = 1e-3 * LR
MAX_NORM = 0.5  # below every tiny model's grad norm here, so clipping is always active
TOPOLOGY_FIELDS = ("source", "world_size", "dp_replicate_size", "dp_replicate_rank", "dp_shard_size",
                   "dp_shard_rank", "dp_size", "dp_rank", "tp_size", "tp_rank", "ep_size", "ep_rank")


def _dataset(dp_size: int, steps: int = STEPS, accum: int = ACCUM):
    from shardadopt.testing import token_batch

    rows = token_batch(SEED, steps * accum * dp_size * PER_DP_BATCH)
    return list(rows)


def _load(path: str, sizes: dict[str, Any] | None, dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype)}
    if sizes:
        from transformers.distributed import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(**sizes)
    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def streamed_dataset(rows: list[Any]):
    """``rows`` as a streamed ``datasets`` dataset (``to_iterable_dataset``) yielding ``{"input_ids": tensor}``."""
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": [row.tolist() for row in rows]}).to_iterable_dataset().with_format("torch")


def train_rank(path: str, sizes: dict[str, Any], dp_size: int, order: str = "together", patched: bool = True,
               cpu: bool = True, steps: int = STEPS, accum: int = ACCUM, streamed: bool = False,
               dtype: str = "float32") -> dict[str, Any]:
    """The user's accelerate loop on a load-time-sharded model; returns rank-side observations. ``streamed``: the
    rows come from a streamed ``datasets`` dataset, which accelerate dispatches from rank 0 by default. ``dtype``:
    the model's, by its torch name (``"bfloat16"``)."""
    import torch
    import torch.distributed as dist

    import shardadopt
    from shardadopt.testing import full

    shardadopt.enable() if patched else shardadopt.disable()
    try:
        accelerator = fresh_accelerator(cpu=cpu, gradient_accumulation_steps=accum)
        model = _load(path, sizes, dtype)
        before = {n: local_copy(p) for n, p in model.named_parameters()}
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
        rows = _dataset(dp_size, steps, accum)
        loader = torch.utils.data.DataLoader(streamed_dataset(rows) if streamed else rows, batch_size=PER_DP_BATCH)
        try:
            if order == "together":
                model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
            elif order == "loader-first":
                loader, model, optimizer = accelerator.prepare(loader, model, optimizer)
            else:  # "separate": the dataloader prepared on its own before the model
                loader = accelerator.prepare(loader)
                model, optimizer = accelerator.prepare(model, optimizer)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        # adoption leaves every local parameter exactly as loaded (EP experts included)
        unchanged = all(torch.equal(local_copy(p), before[n])
                        for n, p in accelerator.unwrap_model(model).named_parameters())
        layout = shardadopt.topology(accelerator.unwrap_model(model))
        topo = {k: getattr(layout, k) for k in TOPOLOGY_FIELDS}
        losses, norms, sync_flags, seen = [], [], [], []
        micro = []
        try:
            for batch in loader:
                batch = batch["input_ids"] if streamed else batch
                seen.append(batch.tolist())
                with accelerator.accumulate(model):
                    sync_flags.append(_fsdp_reduces(model))
                    loss = model(input_ids=batch, labels=batch).loss
                    micro.append(loss.detach())
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
                        step_loss = torch.stack(micro).mean()
                        losses.append(float(accelerator.reduce(step_loss, "mean")))
                        micro = []
                    optimizer.step()
                    optimizer.zero_grad()
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}", "unchanged": unchanged}
        # DTensors gathered whole; plain tensors as each rank holds them (old transformers keep TP/EP shards
        # plain: compare_training reassembles them); on the CPU, where the reference is
        params = {n: full(p).detach().cpu() for n, p in accelerator.unwrap_model(model).named_parameters()}
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, params)
        return {"losses": losses, "norms": norms, "sync_flags": sync_flags, "batches": seen,
                "unchanged": unchanged, "rank": dist.get_rank(), "topology": topo,
                "params": per_rank if dist.get_rank() == 0 else None}
    finally:
        shardadopt.disable()


def _fsdp_reduces(model) -> bool | None:
    """Whether FSDP2 will reduce gradients in this backward (None for models without FSDP modules)."""
    from torch.distributed.fsdp import FSDPModule

    flags = [upstream.fsdp_group_syncs_gradients(g) for m in model.modules() if isinstance(m, FSDPModule)
             for g in upstream.fsdp_param_groups(m)]
    return all(flags) if flags else None


def train_reference(path: str, dp_size: int, steps: int = STEPS, accum: int = ACCUM,
                    dtype: str = "float32") -> dict[str, Any]:
    """One process, same global batches: each optimizer step sees ``accum`` micro-batches of
    dp_size * PER_DP_BATCH."""
    import torch

    model = _load(path, None, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    rows = torch.stack(_dataset(dp_size, steps, accum))
    global_micro = dp_size * PER_DP_BATCH
    losses, norms = [], []
    for step in range(steps):
        micro = []
        for m in range(accum):
            start = (step * accum + m) * global_micro
            batch = rows[start:start + global_micro]
            loss = model(input_ids=batch, labels=batch).loss
            (loss / accum).backward()
            micro.append(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        losses.append(float(torch.stack(micro).mean()))
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "norms": norms,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def compare_training(result: dict[str, Any], expected: dict[str, Any], rtol: float = 1e-5) -> str | None:
    import torch

    if "error" in result:
        return f"the accelerate loop failed: {result['error']}"
    if not result["unchanged"]:
        return "prepare() changed this rank's parameters (they must stay exactly as loaded)"
    for what in ("losses", "norms"):
        got, want = torch.tensor(result[what]), torch.tensor(expected[what])
        if got.shape != want.shape or not torch.allclose(got, want, rtol=rtol, atol=0):
            return f"per-step {what} {result[what]} != single-process {expected[what]}"
    if result.get("params") is not None:
        bad = [n for n, p in expected["params"].items()
               if not _param_matches(whole_tensor([r[n] for r in result["params"]], p.shape), p)]
        if bad:
            return f"{len(bad)} parameters differ from the single-process run after training: {bad[:3]}"
    return None


def _param_matches(got: Any, want: Any) -> bool:
    if got.shape != want.shape:
        return False
    diff = (got - want).abs()
    return float(diff.max()) < PARAM_MAX_DIFF and float(diff.pow(2).mean().sqrt()) <= PARAM_RMS


def whole_tensor(pieces: list, shape) -> Any:
    """A parameter from the ranks' copies: the copy itself when whole, else the ranks' shards concatenated along
    the one dim where they are smaller (shards of a plain TP/EP tensor over the whole world)."""
    import torch

    if pieces[0].shape == shape:
        return pieces[0]
    dims = [d for d, (a, b) in enumerate(zip(pieces[0].shape, shape)) if a != b]
    if len(dims) != 1:
        return pieces[0]
    return torch.cat(pieces, dim=dims[0])


def eval_rank(path: str, sizes: dict[str, Any], n_samples: int) -> dict[str, Any]:
    """gather_for_metrics over an eval loader: every sample exactly once, in order."""
    import torch

    import shardadopt

    shardadopt.enable()
    try:
        accelerator = fresh_accelerator(cpu=True)
        model = _load(path, sizes)
        data = torch.arange(n_samples * 4).reshape(n_samples, 4)
        loader = torch.utils.data.DataLoader(list(data), batch_size=PER_DP_BATCH)
        model, loader = accelerator.prepare(model, loader)
        gathered = [accelerator.gather_for_metrics(batch) for batch in loader]
        objects = [accelerator.gather_for_metrics(batch[:, 0].tolist(), use_gather_object=True) for batch in loader]
        return {"tensors": torch.cat(gathered).tolist(), "objects": sum(objects, []), "expected": data.tolist()}
    finally:
        shardadopt.disable()


# -- selftest scenarios ------------------------------------------------------------------------------------------

def _scenario(name: str, model: str, sizes, dp, unsupported) -> Scenario:
    def run(ctx: Context):
        return train_rank(ctx.models[model], sizes(ctx.nproc), dp(ctx.nproc), cpu=ctx.device == "cpu")

    def reference(ctx: Context):
        return train_reference(ctx.models[model], dp(ctx.nproc))

    run.__qualname__ = run.__name__ = f"_run_{name.replace('-', '_')}"
    globals()[run.__name__] = run  # the pool pickles functions by reference
    return Scenario(name=name, description=f"accelerate loop, {model}: per-step loss, grad norm and final params "
                    f"equal one process ({STEPS} steps, accumulation {ACCUM}, foreach AdamW)",
                    run=run, reference=reference, compare=compare_training, unsupported=unsupported)


def _multiple_of(needed: int):
    return lambda nproc: None if nproc % needed == 0 else f"needs a multiple of {needed} processes"


def _layout_unsupported(layout: str):
    """Why ``layout`` (``"2d"``: fsdp x tp, transformers 5.18 and newer; ``"hsdp"``: a transformers with
    ``dp_replicate_size``) cannot run on ``nproc`` ranks (it needs 4), or None."""
    def reason(nproc: int) -> str | None:
        try:
            distributed_sizes(layout, nproc)
        except LayoutUnsupported as exc:
            return str(exc)
        return None

    return reason


def _layout_sizes(layout: str):
    return lambda nproc: distributed_sizes(layout, nproc)[0]


SCENARIOS = [
    _scenario("accelerate-fsdp", "llama", lambda n: {"fsdp_size": n}, lambda n: n, _multiple_of(2)),
    # qwen3's q_norm/k_norm make TP with accumulation depend on transformers-tp-replicated-grad-accumulation; the
    # tiny qwen3 has 2 KV heads, so tp_size is 2.
    _scenario("accelerate-tp", "qwen3", lambda n: {"tp_size": 2}, lambda n: 1,
              lambda n: None if n == 2 else "tp_size 2 (the tiny qwen3 has 2 KV heads) needs exactly 2 processes"),
    _scenario("accelerate-2d", "qwen3", lambda n: {"fsdp_size": 2, "tp_size": 2}, lambda n: 2,
              _layout_unsupported("2d")),
    _scenario("accelerate-hsdp", "llama", _layout_sizes("hsdp"), lambda n: 4, _layout_unsupported("hsdp")),
]
