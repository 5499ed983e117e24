"""Scenario "several": several adapters on one model, as peft's docs show (``set_adapter``, ``add_weighted_adapter``,
``save_pretrained``, ``delete_adapter``/``add_adapter``), on a sharded load against one process.
"""

from __future__ import annotations

from typing import Any

from shardadopt.testing.lora.common import (
    ACCUM,
    LR,
    MAX_NORM,
    PER_DP_BATCH,
    SECOND,
    SEED,
    adapter_params,
    is_adapter,
    load_model,
    lora_config,
    params_close,
    probe_batch,
    token_rows,
)

PHASES = ("default", "default", "b", "b", "default")  # the adapter set active for each optimizer step
MIXED = (["default", "b"], [0.6, 0.4], "mix")  # add_weighted_adapter(adapters, weights, name): svd, peft's default
READDED_SEED = SEED + 7  # before b is deleted and added again


def _active_grads(model) -> dict[str, Any]:
    from shardadopt.testing import full

    return {n: full(p.grad).detach().clone() for n, p in model.named_parameters()
            if is_adapter(n) and p.grad is not None}


def _adapter_logits(model, adapters: list[str]) -> dict[str, Any]:
    """Each adapter's output on the probe batch (``set_adapter`` in turn), then ``adapters[0]`` active again."""
    import torch

    logits = {}
    for adapter in adapters:
        model.set_adapter(adapter)
        with torch.no_grad():
            logits[adapter] = model(input_ids=probe_batch()).logits
    model.set_adapter(adapters[0])
    return logits


def _exported(directory: str) -> list[str]:
    import os

    return sorted(os.path.relpath(os.path.join(d, f), directory) for d, _, files in os.walk(directory) for f in files)


def _several_adapters(model, step, export: str) -> dict[str, Any]:
    """What a user does with several adapters, as peft's docs show (``model`` holds "default" and "b"): train each
    in turn with ``set_adapter`` (``step(update)`` runs one optimizer step's micro-batches, returns (loss, norm)),
    ``add_weighted_adapter``, ``save_pretrained``, then ``delete_adapter("b")`` and ``add_adapter("b")`` again and
    one backward of the new "b". Returns what the tests compare."""
    import torch

    from shardadopt.adapters import AdapterLayoutError

    out: dict[str, Any] = {"losses": [], "norms": [], "grads": []}
    for adapter in PHASES:
        model.set_adapter(adapter)
        loss, norm = step(True)
        out["losses"].append(loss)
        out["norms"].append(norm)
        out["grads"].append(step.grads)
    out["params"] = adapter_params(model)
    adapters = ["default", "b"]
    try:
        model.add_weighted_adapter(*MIXED)
        adapters.append(MIXED[2])
        out["mixed"] = {n: v for n, v in adapter_params(model).items() if f".{MIXED[2]}." in n}
    except AdapterLayoutError as exc:
        out["mixed_error"] = f"{type(exc).__name__}: {exc}"
    out["logits"] = _adapter_logits(model, adapters)
    model.save_pretrained(export)
    out["exported"] = _exported(export)
    model.delete_adapter("b")
    out["after_delete"] = sorted(model.peft_config)
    torch.manual_seed(READDED_SEED)
    model.add_adapter("b", lora_config(**SECOND, init_lora_weights="gaussian"))
    model.set_adapter("b")
    out["readded_loss"], _ = step(False)
    out["readded_grads"] = step.grads
    return out


def several_adapters_reference(path: str, dp_size: int, export: str) -> dict[str, Any]:
    """:func:`_several_adapters` in one process on the same global batches."""
    import torch
    from peft import get_peft_model

    torch.manual_seed(SEED)
    model = get_peft_model(load_model(path, None), lora_config())
    model.add_adapter("b", lora_config(**SECOND))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    rows = token_rows(dp_size, len(PHASES) + 1, ACCUM)
    global_micro = dp_size * PER_DP_BATCH
    batches = iter(rows[i:i + global_micro] for i in range(0, len(rows), global_micro))

    def step(update: bool) -> tuple[float, float]:
        micro = []
        for _ in range(ACCUM):
            batch = next(batches)
            loss = model(input_ids=batch, labels=batch).loss
            (loss / ACCUM).backward()
            micro.append(loss.detach())
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        step.grads = _active_grads(model)
        if update:
            optimizer.step()
        optimizer.zero_grad()
        return float(torch.stack(micro).mean()), norm

    return _several_adapters(model, step, export)


def several_adapters_rank(path: str, sizes: dict[str, Any], dp_size: int, workdir: str) -> dict[str, Any]:
    """:func:`_several_adapters` through the accelerate loop on a sharded load; then the export loaded back onto a
    fresh sharded base (``PeftModel.from_pretrained`` + ``load_adapter``): each adapter's output there."""
    import os

    import torch
    from peft import PeftModel, get_peft_model

    import shardadopt
    from shardadopt.adapters import AdapterLayoutError
    from shardadopt.testing.accelerator import fresh_accelerator

    shardadopt.enable()
    try:
        accelerator = fresh_accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
        torch.manual_seed(SEED)
        try:
            model = get_peft_model(load_model(path, sizes), lora_config())
        except AdapterLayoutError as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        model.add_adapter("b", lora_config(**SECOND))
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
        loader = torch.utils.data.DataLoader(list(token_rows(dp_size, len(PHASES) + 1, ACCUM)), batch_size=PER_DP_BATCH)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        batches = iter(loader)

        def step(update: bool) -> tuple[float, float]:
            micro, norm = [], None
            for _ in range(ACCUM):
                batch = next(batches)
                with accelerator.accumulate(model):
                    loss = model(input_ids=batch, labels=batch).loss
                    micro.append(loss.detach())
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        norm = float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM))
                        step.grads = _active_grads(model)
                    if update:
                        optimizer.step()
                    optimizer.zero_grad()
            return float(accelerator.reduce(torch.stack(micro).mean(), "mean")), norm

        export = os.path.join(workdir, "adapters")
        out = _several_adapters(accelerator.unwrap_model(model), step, export)
        reloaded = PeftModel.from_pretrained(load_model(path, sizes), export)
        for adapter in [a for a in out["logits"] if a != "default"]:
            reloaded.load_adapter(os.path.join(export, adapter), adapter_name=adapter)
        out["reloaded_logits"] = _adapter_logits(reloaded, list(out["logits"]))
        return out
    finally:
        shardadopt.disable()


def check_several_adapters(pool, path: str, sizes: dict[str, Any], dp: int, workdir: str) -> None:
    """Run :func:`several_adapters_rank` on ``pool`` and assert it equals :func:`several_adapters_reference` (test
    helper): per step the loss, grad norm and gradients (of the active adapter's parameters only), both adapters
    after training, the new "b" after delete and add, equal on every rank; ``add_weighted_adapter`` as in one
    process (data-parallel loads) or refused by name (TP); ``save_pretrained`` writes the files one process writes
    (default at the root, the others in subfolders), which one process (``from_pretrained`` + ``load_adapter``)
    and a fresh sharded base load with each adapter's outputs equal."""
    import os

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from shardadopt.adapters import dtensor_tensor_parallel

    results = pool.run(several_adapters_rank, path, sizes, dp, workdir, timeout=600)
    tp = sizes.get("tp_size", 1) > 1
    if tp and not dtensor_tensor_parallel():
        for result in results:  # refused at get_peft_model, naming the fix
            assert "tensor parallelism on transformers before 5.17" in result["error"], result
        return
    assert "error" not in results[0], results[0]["error"]
    expected = several_adapters_reference(path, dp, os.path.join(workdir, "reference"))
    first = results[0]
    for rank, result in enumerate(results):
        assert result["losses"] == first["losses"] and result["norms"] == first["norms"], f"rank {rank}"
        assert result["readded_loss"] == first["readded_loss"], f"rank {rank}"
        for key in ("params", "mixed", "readded_grads"):
            for name, value in result.get(key, {}).items():
                assert torch.equal(value, first[key][name]), f"{key} {name} differs between rank 0 and {rank}"
        for got, want in zip(result["grads"], first["grads"]):
            assert all(torch.equal(got[n], want[n]) for n in want), f"rank {rank}: gradients differ from rank 0"
    torch.testing.assert_close(torch.tensor(first["losses"]), torch.tensor(expected["losses"]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(first["norms"]), torch.tensor(expected["norms"]), rtol=1e-5, atol=0)
    for step, (adapter, got, want) in enumerate(zip(PHASES, first["grads"], expected["grads"])):
        assert sorted(got) == sorted(want) and all(f".{adapter}." in n for n in want), f"step {step}: {sorted(got)}"
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-7, msg=f"step {step}: gradient {name}")
    bad = [n for n, v in expected["params"].items() if not params_close(first["params"][n], v)]
    assert sorted(first["params"]) == sorted(expected["params"]) and not bad, f"adapters differ: {bad[:3]}"
    mixed = MIXED[2]
    assert first["after_delete"] == [a for a in expected["after_delete"] if not (tp and a == mixed)] == \
        sorted(["default", mixed] if not tp else ["default"])
    torch.testing.assert_close(torch.tensor(first["readded_loss"]), torch.tensor(expected["readded_loss"]),
                               rtol=1e-5, atol=0)
    assert sorted(first["readded_grads"]) == sorted(expected["readded_grads"])
    for name, value in expected["readded_grads"].items():
        torch.testing.assert_close(first["readded_grads"][name], value, rtol=1e-4, atol=1e-7, msg=f"re-added {name}")

    if tp:
        assert "mixed" not in first and first["mixed_error"].startswith("AdapterLayoutError: add_weighted_adapter "
                                                                        "on a tensor-parallel load (tp_size=2)")
        assert first["exported"] == [f for f in expected["exported"] if not f.startswith(f"{mixed}/")]
    else:  # SVD factors are defined up to sign: the combined adapter is compared by its outputs
        assert "mixed_error" not in first and first["mixed"]
        assert first["exported"] == expected["exported"]
    assert "adapter_model.safetensors" in first["exported"] and "b/adapter_model.safetensors" in first["exported"]
    export = os.path.join(workdir, "adapters")
    one = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), export)
    for adapter in [a for a in first["logits"] if a != "default"]:
        one.load_adapter(os.path.join(export, adapter), adapter_name=adapter)
    loaded = _adapter_logits(one, list(first["logits"]))
    for adapter, want in expected["logits"].items():
        if adapter not in first["logits"]:
            continue
        for result in results:
            torch.testing.assert_close(result["logits"][adapter], want, rtol=1e-5, atol=1e-5, msg=adapter)
            torch.testing.assert_close(loaded[adapter], result["logits"][adapter], rtol=1e-5, atol=1e-5, msg=adapter)
            torch.testing.assert_close(result["reloaded_logits"][adapter], result["logits"][adapter], rtol=1e-6,
                                       atol=1e-6, msg=adapter)
