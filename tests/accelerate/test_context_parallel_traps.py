"""What makes context-parallel training silently wrong, each case against one process on the whole sequence or
refused by name (``AdoptionError`` naming the problem and the fix) at the first step.

2 gloo ranks, ``DistributedConfig(fsdp_size=2)`` with ``ParallelismConfig(cp_size=2)``, the accelerate loop as
accelerate documents ``maybe_context_parallel``, fp32, 2 AdamW steps (per-step loss and grad norm, the parameters
after them). All cases run in one pool call: labels not shifted before the split; position ids left out (made for
the whole sequence) or counted from 0 in each chunk (refused); a right-padding mask with labels ``-100`` (equal;
the chunks hold different numbers of valid tokens) and a left-padding mask (refused); GQA with fewer key/value
heads than CP ranks; a sliding-window model (refused); sequence lengths not divisible by ``2 x cp_size`` (equal)
or by ``cp_size`` (refused: ring attention aborts the process); ``generate()`` inside the context (refused) and
outside it (one process's tokens). Gradients are reduced over the CP group exactly once: the grad norms and
parameters equal one process's (never reducing or reducing twice changes both).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

STEPS, BATCH, LR, MAX_NORM, PAD = 2, 2, 1e-3, 1e9, 5
PARAM_MAX_DIFF, PARAM_RMS = 0.5 * LR, 1e-3 * LR  # as tests/accelerate/test_context_parallel.py (AdamW's sign steps)
PROMPT, NEW_TOKENS = 6, 4

# name: (model, sequence length, padding, position ids, labels shifted before the split)
CASES: dict[str, dict[str, Any]] = {
    "global-positions": {},
    "positions-left-out": {"positions": "none"},
    "positions-per-chunk": {"positions": "local"},
    "labels-not-shifted": {"shift": False},
    "right-padding": {"padding": "right"},
    "left-padding": {"padding": "left"},
    "gqa-1-kv-head": {"model": "gqa1"},
    "sliding-window": {"model": "mistral"},
    "length-18": {"seq": 18},
    "length-17": {"seq": 17},
    "generate-inside": {"generate": "inside"},
    "generate-outside": {"generate": "outside"},
    "trainer-right-padding": {"padding": "right", "trainer": True},
    "trainer-left-padding": {"padding": "left", "trainer": True},
}
REFUSED = {  # case: what the error must name
    "positions-per-chunk": ("position_ids", "count from 0 in its own chunk"),
    "labels-not-shifted": ("labels passed without shift_labels", "shift_labels = F.pad(labels"),
    "left-padding": ("padding (attention_mask 0) at position 0", "padding_side = 'right'"),
    "trainer-left-padding": ("padding (attention_mask 0) at position 0", "padding_side = 'right'"),
    "sliding-window": ("sliding", "context parallelism"),
    "length-17": ("17 positions does not split into 2 equal chunks", "pad_to_multiple_of=4"),
    "generate-inside": ("generate() inside maybe_context_parallel", "outside the context"),
}


def _case(name: str) -> dict[str, Any]:
    return {"model": "llama", "seq": 16, "padding": None, "positions": "global", "shift": True, "generate": None,
            "trainer": False, **CASES[name]}


def batches(seq: int, padding: str | None) -> list[dict[str, torch.Tensor]]:
    """The global batches (the same on every rank); ``padding``: row 1 has ``PAD`` pad tokens (mask 0, labels
    ``-100``) on that side."""
    from shardadopt.testing.models import token_batch

    out = []
    for step in range(STEPS):
        ids = token_batch(200 + step, BATCH, seq)
        labels, mask = ids.clone(), torch.ones_like(ids)
        if padding is not None:
            pads = slice(seq - PAD, seq) if padding == "right" else slice(0, PAD)
            ids[1, pads], labels[1, pads], mask[1, pads] = 0, -100, 0
        out.append({"input_ids": ids, "labels": labels, **({"attention_mask": mask} if padding else {})})
    return out


def one_process(path: str, seq: int, padding: str | None, generate: bool) -> dict[str, Any]:
    """One process on the whole sequence: losses, grad norms, parameters after ``STEPS``; greedy tokens first."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, foreach=False)
    tokens = None
    if generate:
        prompt = batches(seq, None)[0]["input_ids"][:, :PROMPT]
        tokens = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                                do_sample=False).tolist()
    losses, norms = [], []
    for batch in batches(seq, padding):
        loss = model(**batch).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        losses.append(float(loss.detach()))
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "norms": norms, "tokens": tokens,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def cp_case(path: str, seq: int, padding: str | None, positions: str, shift: bool, generate: str | None
            ) -> dict[str, Any]:
    """The user's accelerate loop under ``maybe_context_parallel``, every buffer split on its sequence dim (the
    padding mask too, as the Trainer splits it)."""
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
                                                     distributed_config=DistributedConfig(fsdp_size=2))
        accelerator = fresh_accelerator(cpu=True, parallelism_config=ParallelismConfig(cp_size=2))
        model, optimizer = accelerator.prepare(
            model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, foreach=False))
        tokens = None
        if generate == "outside":  # after prepare (accelerate's attention hooks attached), outside the context
            prompt = batches(seq, None)[0]["input_ids"][:, :PROMPT]
            tokens = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                                    do_sample=False).tolist()
        seen, losses, norms = [], [], []
        for batch in batches(seq, padding):
            input_ids, labels = batch["input_ids"], batch["labels"]
            shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
            position_ids = torch.arange(seq).expand(BATCH, -1).contiguous()
            buffers = [input_ids, labels, shift_labels]
            buffers += [position_ids] if positions == "global" else []
            buffers += [batch["attention_mask"]] if padding else []
            with accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                                                    no_restore_buffers=set(buffers)):
                kwargs = {"shift_labels": shift_labels} if shift else {}
                if positions == "global":
                    kwargs["position_ids"] = position_ids
                elif positions == "local":  # made after the split: counted from 0 in each chunk
                    kwargs["position_ids"] = torch.arange(input_ids.shape[1]).expand(BATCH, -1)
                if padding:
                    kwargs["attention_mask"] = batch["attention_mask"]
                if generate == "inside":
                    model.generate(input_ids[:, :PROMPT], max_new_tokens=NEW_TOKENS, do_sample=False)
                seen.append(input_ids.shape[1])
                loss = model(input_ids=input_ids, labels=labels, **kwargs).loss
                accelerator.backward(loss)
            norms.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
            losses.append(float(accelerator.reduce(loss.detach(), "mean")))
            optimizer.step()
            optimizer.zero_grad()
        params = {n: full(p).detach().clone() for n, p in model.named_parameters()}
        return {"seen": seen, "losses": losses, "norms": norms, "tokens": tokens,
                "params": params if dist.get_rank() == 0 else None}
    except Exception as exc:  # noqa: BLE001  (the test reads what each rank raised)
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        shardadopt.disable()


def cp_trainer_case(path: str, padding: str) -> dict[str, Any]:
    """``Trainer`` with ``TrainingArguments(parallelism_config=ParallelismConfig(cp_size=2))`` on the padded rows
    (it passes ``num_items_in_batch``, counted before the split, and splits the padding mask as a buffer)."""
    import tempfile

    import torch.distributed as dist
    from accelerate import ParallelismConfig
    from transformers import AutoModelForCausalLM, PrinterCallback, Trainer, TrainingArguments
    from transformers.distributed import DistributedConfig

    import shardadopt
    from shardadopt.testing.accelerator import forget_accelerate_state
    from shardadopt.testing.models import full

    rows = [{k: v[i] for k, v in batch.items()} for batch in batches(16, padding) for i in range(BATCH)]
    shardadopt.enable()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa",
                                                     distributed_config=DistributedConfig(fsdp_size=2))
        seen: list[int] = []
        model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True)
        forget_accelerate_state()
        with tempfile.TemporaryDirectory() as out:
            args = TrainingArguments(
                output_dir=out, per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=LR,
                lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=MAX_NORM, optim="adamw_torch",
                logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                train_sampling_strategy="sequential", disable_tqdm=True,
                parallelism_config=ParallelismConfig(cp_size=2))
            trainer = Trainer(model=model, args=args, train_dataset=rows)
            trainer.remove_callback(PrinterCallback)
            trainer.train()
        logged = [row for row in trainer.state.log_history if "loss" in row and "grad_norm" in row]
        params = {n: full(p).detach().clone() for n, p in trainer.model.named_parameters()}
        return {"seen": seen, "losses": [row["loss"] for row in logged], "tokens": None,
                "norms": [float(row["grad_norm"]) for row in logged],
                "params": params if dist.get_rank() == 0 else None}
    except Exception as exc:  # noqa: BLE001  (the test reads what each rank raised)
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        shardadopt.disable()


def cp_cases(paths: dict[str, str], cases: list[str]) -> dict[str, dict[str, Any]]:
    """Every case in one pool call."""
    out = {}
    for name in cases:
        case = _case(name)
        if case["trainer"]:
            out[name] = cp_trainer_case(paths[case["model"]], case["padding"])
            continue
        out[name] = cp_case(paths[case["model"]], case["seq"], case["padding"], case["positions"], case["shift"],
                            case["generate"])
    return out


def mismatch(result: dict[str, Any], expected: dict[str, Any], rtol: float = 1e-4) -> str | None:
    """What differs from one process (None: nothing)."""
    if "error" in result:
        return result["error"]
    for what in ("losses", "norms"):
        if not torch.allclose(torch.tensor(result[what]), torch.tensor(expected[what]), rtol=rtol, atol=1e-6):
            return f"{what} {result[what]} != one process {expected[what]}"
    if result["tokens"] != expected["tokens"]:
        return f"generated {result['tokens']} != one process {expected['tokens']}"
    if result.get("params") is not None:
        bad = [n for n, want in expected["params"].items() if not (
            float((result["params"][n] - want).abs().max()) < PARAM_MAX_DIFF
            and float((result["params"][n] - want).pow(2).mean().sqrt()) <= PARAM_RMS)]
        if bad:
            return f"{len(bad)} parameters differ after {STEPS} steps: {bad[:3]}"
    return None


@pytest.fixture(scope="module")
def paths(tiny_models, tmp_path_factory):
    """The tiny Llama, the same with 1 key/value head (GQA, fewer than the 2 CP ranks), and a Mistral whose
    sliding window (4) is shorter than the sequence."""
    from transformers import AutoConfig, AutoModelForCausalLM, MistralConfig, MistralForCausalLM

    root = tmp_path_factory.mktemp("cp-traps")
    out = {"llama": tiny_models["llama"], "gqa1": str(root / "gqa1"), "mistral": str(root / "mistral")}
    config = AutoConfig.from_pretrained(tiny_models["llama"])
    config.num_key_value_heads = 1
    with torch.random.fork_rng():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(out["gqa1"])
        MistralForCausalLM(MistralConfig(vocab_size=config.vocab_size, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, sliding_window=4)).save_pretrained(out["mistral"])
    assert os.path.exists(os.path.join(out["mistral"], "config.json"))
    return out


@pytest.fixture(scope="module")
def results(pool2, paths):
    return pool2.run(cp_cases, paths, list(CASES), timeout=600)


def _reference(paths: dict[str, str], name: str) -> dict[str, Any]:
    case = _case(name)
    return one_process(paths[case["model"]], case["seq"], case["padding"], case["generate"] == "outside")


@pytest.mark.multiproc
@pytest.mark.parametrize("name", [n for n in CASES if n not in REFUSED])
def test_matches_one_process(results, paths, name):
    """Global position ids passed or left out, a right-padding mask (unequal valid tokens per chunk), GQA with
    fewer key/value heads than CP ranks, a length not divisible by 2 x cp_size, generate() outside the context:
    one process's losses, grad norms (gradients reduced over the CP group exactly once) and parameters."""
    expected = _reference(paths, name)
    seq = _case(name)["seq"]
    for result in results:
        assert mismatch(result[name], expected) is None, mismatch(result[name], expected)
        assert result[name]["seen"] == [seq // 2] * STEPS, result[name]["seen"]  # the split happened


@pytest.mark.multiproc
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_by_name(results, name):
    for result in results:
        error = result[name].get("error", "")
        assert all(part in error for part in REFUSED[name]), (name, result[name].get("error", result[name]))
