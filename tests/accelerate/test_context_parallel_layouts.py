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


def cp_loop(path: str, sizes: dict[str, int], parallelism: dict[str, int], padded: bool,
            packed: bool = False) -> dict[str, Any]:
    """The accelerate loop as accelerate documents ``maybe_context_parallel`` (labels shifted before the split,
    global position ids), on a model loaded with ``DistributedConfig(**sizes)``; ``packed``: every row packs two
    sequences (10 and 6 tokens, position ids restarting at 0)."""
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
            positions = torch.cat([torch.arange(10), torch.arange(SEQ - 10)]) if packed else torch.arange(SEQ)
            position_ids = positions.expand(input_ids.shape[0], -1).contiguous()
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

        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(),
                "seen": locals().get("seen")}
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


def cp_trainer(path: str, sizes: dict[str, int], parallelism: dict[str, int], padded: bool) -> dict[str, Any]:
    """``Trainer`` with ``TrainingArguments(parallelism_config=ParallelismConfig(**parallelism))`` on the same rows
    (2 per CP group and step): losses and grad norms as it logs them, the shape each forward saw, the parameters."""
    import tempfile

    import torch.distributed as dist
    from accelerate import ParallelismConfig
    from transformers import AutoModelForCausalLM, PrinterCallback, Trainer, TrainingArguments
    from transformers.distributed import DistributedConfig

    import shardadopt
    from shardadopt.testing.accelerator import forget_accelerate_state
    from shardadopt.testing.models import full

    shardadopt.enable()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa",
                                                     distributed_config=DistributedConfig(**sizes))
        seen: list[Any] = []
        model.register_forward_pre_hook(lambda m, a, kw: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
        config = ParallelismConfig(**parallelism)
        per_rank = ROWS // (config.dp_replicate_size * config.dp_shard_size)
        forget_accelerate_state()
        with tempfile.TemporaryDirectory() as out:
            args = TrainingArguments(
                output_dir=out, per_device_train_batch_size=per_rank, max_steps=STEPS, learning_rate=LR,
                lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=MAX_NORM, optim="adamw_torch",
                logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                train_sampling_strategy="sequential", disable_tqdm=True, parallelism_config=config)
            trainer = Trainer(model=model, args=args, train_dataset=rows(padded))
            trainer.remove_callback(PrinterCallback)
            trainer.train()
        logged = [row for row in trainer.state.log_history if "loss" in row and "grad_norm" in row]
        params = {n: full(p).detach().clone() for n, p in trainer.model.named_parameters()}
        return {"seen": seen, "losses": [row["loss"] for row in logged],
                "norms": [float(row["grad_norm"]) for row in logged],
                "params": params if dist.get_rank() == 0 else None}
    except Exception as exc:  # noqa: BLE001  (the test reads what each rank raised)
        import traceback

        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    finally:
        shardadopt.disable()


def run_cases(cases: list[tuple[str, str, dict, dict, bool]]) -> list[dict[str, Any]]:
    """Several runs in one pool call: (form, path, DistributedConfig sizes, ParallelismConfig sizes, padded)."""
    workers = {"loop": cp_loop, "trainer": cp_trainer}
    return [workers[form](path, sizes, parallelism, padded) for form, path, sizes, parallelism, padded in cases]


def _loadable(sizes: dict[str, int]) -> str | None:
    from shardadopt.testing.layouts import unloadable_reason

    return unloadable_reason(sizes)


DP_CP = {"dp_shard_size": 2, "cp_size": 2}
TP_CP = {"tp_size": 2, "cp_size": 2}
# (name, model, DistributedConfig sizes, ParallelismConfig sizes, form, padded)
PARITY = [
    ("fsdp4-loop", "llama", {"fsdp_size": 4}, DP_CP, "loop", False),
    ("fsdp4-loop-padded", "llama", {"fsdp_size": 4}, DP_CP, "loop", True),
    ("fsdp4-trainer-padded", "llama", {"fsdp_size": 4}, DP_CP, "trainer", True),
    ("hsdp-loop-padded", "llama", {"dp_replicate_size": 2, "fsdp_size": 2}, DP_CP, "loop", True),
    ("fsdp2xtp2-loop-padded", "llama", {"fsdp_size": 2, "tp_size": 2}, TP_CP, "loop", True),
    ("ep-qwen3moe-loop-padded", "qwen3moe", {"fsdp_size": 4, "ep_size": 2}, DP_CP, "loop", True),
]


def test_layouts_match_one_process(pool4, tiny_models):
    """Each layout with ``cp_size=2`` on 4 ranks trains as one process on the whole global batch, and each forward
    saw half of the positions. One pool call for all (a layout this transformers cannot load is left out, named)."""
    cases, skipped = [], []
    for name, model, sizes, parallelism, form, padded in PARITY:
        reason = _loadable(sizes)
        (skipped.append(f"{name}: {reason}") if reason else
         cases.append((name, (form, tiny_models[model], sizes, parallelism, padded))))
    if not cases:
        pytest.skip("; ".join(skipped))
    references = {(model, padded): one_process(tiny_models[model], padded)
                  for _, model, _, _, _, padded in PARITY}
    results = pool4.run(run_cases, [case for _, case in cases], timeout=900)
    failures = []
    for rank, per_rank in enumerate(results):
        for (name, (*_, padded)), result in zip(cases, per_rank):
            model = next(m for n, m, *_ in PARITY if n == name)
            problem = mismatch(result, references[(model, padded)])
            if problem is None and any(shape[1] != SEQ // 2 for shape in result["seen"]):
                problem = f"forwards saw {result['seen']}, not {SEQ // 2} of {SEQ} positions"
            if problem is not None:
                failures.append(f"{name} rank {rank}: {problem}")
    assert not failures, "\n".join(failures)
    if skipped:
        print("left out on this transformers:", "; ".join(skipped))


def test_mismatched_layout_refused_at_prepare(pool4, tiny_models):
    """A TP model whose accelerate config has no ``tp_size`` (its CP groups would cut across the TP groups and its
    data-parallel ranks would not be accelerate's dp x cp ranks) is refused by name with the fix, before a step."""
    sizes = {"fsdp_size": 2, "tp_size": 2}
    reason = _loadable(sizes)
    if reason:
        pytest.skip(reason)
    for result in pool4.run(cp_loop, tiny_models["llama"], sizes, DP_CP, True, timeout=300):
        error = result.get("error", "")
        assert error.startswith("AdoptionError") and "ParallelismConfig(cp_size=2, tp_size=2)" in error, result
        assert "traceback" in result and "accelerator.prepare(" in result["traceback"], result


def test_packed_rows_refused_at_first_step(pool4, tiny_models):
    """Rows packing two sequences (position ids restarting inside the row) under CP, where the attention mask is
    dropped for ``is_causal=True``: refused by name at the first step's forward, on every rank."""
    for result in pool4.run(cp_loop, tiny_models["llama"], {"fsdp_size": 4}, DP_CP, False, packed=True,
                            timeout=300):
        error = result.get("error", "")
        assert error.startswith("AdoptionError") and "position ids restart inside a row" in error, result
        assert "padding_free=False" in error and result["seen"] == [(2, SEQ // 2)], result
