"""Context parallelism beside other layouts on 4 ranks: ``fsdp x cp`` trains as one process; TP and EP are refused.

``ParallelismConfig(dp_shard_size=2, cp_size=2)`` on 4 gloo ranks (two batches, each split over a CP group of 2) on
a tiny Llama sharded at load time, against one process on the whole global batch (4 rows of 16 tokens), fp32,
3 AdamW steps: per-step loss and grad norm, parameters after training. Two load layouts: ``fsdp_size=4`` (the
parameters sharded over all four ranks, as accelerate's own FSDP2 shards over ``dp_shard x cp``) and
``dp_replicate_size=2 x fsdp_size=2`` (each FSDP group is a CP group; replicas take different batches). Each
forward sees 8 of the 16 positions. ``tp_size`` or ``ep_size`` with ``cp_size`` is refused by name at the first
step (:mod:`shardadopt.adopt.context_layouts` says why).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = pytest.mark.multiproc

STEPS, ROWS, SEQ, LR, MAX_NORM = 3, 4, 16, 1e-3, 1e9  # ROWS: the global batch (2 rows per CP group)
# AdamW moves a parameter by about LR whatever its gradient's size: compared as shardadopt.selftest.accelerate does
PARAM_MAX_DIFF, PARAM_RMS = 0.5 * LR, 1e-3 * LR


def global_batches(padded: bool) -> list[dict[str, torch.Tensor]]:
    """The global batches; ``padded``: the last 6 labels of every row are ``-100`` (the chunks of a row then hold
    different numbers of valid tokens)."""
    from shardadopt.testing.models import token_batch

    out = []
    for step in range(STEPS):
        ids = token_batch(300 + step, ROWS, SEQ)
        labels = ids.clone()
        if padded:
            labels[:, -6:] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def rows(padded: bool) -> list[dict[str, torch.Tensor]]:
    return [{k: v[i] for k, v in batch.items()} for batch in global_batches(padded) for i in range(ROWS)]


def one_process(path: str, padded: bool) -> dict[str, Any]:
    """One process on the whole global batch: losses, grad norms, final parameters."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, foreach=False)
    losses, norms = [], []
    for batch in global_batches(padded):
        loss = model(**batch).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        losses.append(float(loss))
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def cp_loop(path: str, sizes: dict[str, int], parallelism: dict[str, int], padded: bool) -> dict[str, Any]:
    """The accelerate loop as accelerate documents ``maybe_context_parallel`` (labels shifted before the split,
    global position ids), on a model loaded with ``DistributedConfig(**sizes)``."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from accelerate import ParallelismConfig
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import shardadopt
    from shardadopt.testing.accelerator import fresh_accelerator
    from shardadopt.testing.models import full

    shardadopt.enable()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa",
                                                     distributed_config=DistributedConfig(**sizes))
        accelerator = fresh_accelerator(cpu=True, parallelism_config=ParallelismConfig(**parallelism))
        per_rank = ROWS // (accelerator.parallelism_config.dp_replicate_size
                            * accelerator.parallelism_config.dp_shard_size)
        model, optimizer, loader = accelerator.prepare(
            model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, foreach=False),
            torch.utils.data.DataLoader(rows(padded), batch_size=per_rank))
        seen, losses, norms = [], [], []
        for batch in loader:
            input_ids, labels = batch["input_ids"], batch["labels"]
            shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
            position_ids = torch.arange(SEQ).expand(input_ids.shape[0], -1).contiguous()
            buffers = [input_ids, labels, shift_labels, position_ids]
            with accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1, 1, 1],
                                                    no_restore_buffers=set(buffers)):
                seen.append(tuple(input_ids.shape))
                loss = model(input_ids=input_ids, labels=labels, shift_labels=shift_labels,
                             position_ids=position_ids).loss
                accelerator.backward(loss)
            norms.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
            losses.append(float(accelerator.reduce(loss.detach(), "mean")))
            optimizer.step()
            optimizer.zero_grad()
        params = {n: full(p).detach().clone() for n, p in model.named_parameters()}
        return {"seen": seen, "losses": losses, "norms": norms, "params": params if dist.get_rank() == 0 else None}
    except Exception as exc:  # noqa: BLE001  (the test reads what each rank raised)
        import traceback

        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    finally:
        shardadopt.disable()


def _param_matches(got: torch.Tensor, want: torch.Tensor) -> bool:
    diff = (got - want).abs()
    return float(diff.max()) < PARAM_MAX_DIFF and float(diff.pow(2).mean().sqrt()) <= PARAM_RMS


def mismatch(result: dict[str, Any], expected: dict[str, Any], rtol: float = 1e-4) -> str | None:
    """What differs from one process (None: nothing)."""
    if "error" in result:
        return result.get("traceback", result["error"])
    for what in ("losses", "norms"):
        if not torch.allclose(torch.tensor(result[what]), torch.tensor(expected[what]), rtol=rtol, atol=1e-6):
            return f"{what} {result[what]} != one process {expected[what]}"
    if result.get("params") is not None:
        bad = [n for n, p in expected["params"].items() if not _param_matches(result["params"][n], p)]
        if bad:
            worst = max(float((result["params"][n] - expected["params"][n]).abs().max()) for n in bad)
            return f"{len(bad)} parameters differ after {STEPS} steps (up to {worst:.3g}): {bad[:3]}"
    return None
