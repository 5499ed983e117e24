"""LoRA on a load-time-sharded model through the ordinary accelerate loop, and the one-process reference.

Workers for ``tests/test_adapters*.py`` (importable by RankPool workers): ``train_lora_rank`` is what a user writes
(load with ``DistributedConfig``, seed, ``get_peft_model``, AdamW over ``model.parameters()``, ``prepare``,
``accumulate``, ``clip_grad_norm_``, ``step``), then exports the adapter with ``save_pretrained`` on every rank and
loads it back onto a fresh sharded base; ``train_lora_reference`` runs the same steps in one process on the same
global batches.
"""

from __future__ import annotations

from typing import Any

SEED = 1234
TARGETS = ("q_proj", "v_proj", "o_proj", "down_proj")
ATTENTION = ("q_proj", "v_proj", "o_proj")  # Qwen3-MoE: every down_proj is an expert tensor
PER_DP_BATCH = 2
STEPS = 3
ACCUM = 2
LR = 1e-2
MAX_NORM = 0.05  # below every step's adapter grad norm here: clipping is always active (the tests check)


def lora_config(**overrides: Any):
    from peft import LoraConfig

    return LoraConfig(**{"r": 8, "lora_alpha": 16, "target_modules": list(TARGETS), **overrides})


def _rows(dp_size: int, steps: int, accum: int):
    from shardadopt.testing import token_batch

    return token_batch(SEED, steps * accum * dp_size * PER_DP_BATCH)


def _load(path: str, sizes: dict[str, Any] | None):
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if sizes:
        from transformers.distributed import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(**sizes)
    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` is trained by the adapter: LoRA factors, DoRA magnitudes, ``modules_to_save``
    copies."""
    return "lora_" in name or ".modules_to_save." in name


def _adapter_params(model) -> dict[str, Any]:
    from shardadopt.testing import full

    return {n: full(p).detach().clone() for n, p in model.named_parameters() if is_adapter(n)}


def _adapter_grads(model) -> dict[str, Any]:
    from shardadopt.testing import full

    return {n: full(p.grad).detach().clone() for n, p in model.named_parameters() if is_adapter(n)}


def probe_batch():
    from shardadopt.testing import token_batch

    return token_batch(SEED + 1, 2)


def train_lora_reference(path: str, dp_size: int, targets: tuple[str, ...] = TARGETS, steps: int = STEPS,
                         accum: int = ACCUM, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """One process, the same global batches: each step sees ``accum`` micro-batches of dp_size * PER_DP_BATCH.
    ``overrides``: more ``LoraConfig`` options (e.g. ``use_dora``)."""
    import torch
    from peft import get_peft_model

    base = _load(path, None)
    torch.manual_seed(SEED)
    model = get_peft_model(base, lora_config(target_modules=list(targets), **(overrides or {})))
    init = _adapter_params(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    rows = _rows(dp_size, steps, accum)
    global_micro = dp_size * PER_DP_BATCH
    losses, norms = [], []
    for step in range(steps):
        micro = []
        for m in range(accum):
            batch = rows[(step * accum + m) * global_micro:(step * accum + m + 1) * global_micro]
            loss = model(input_ids=batch, labels=batch).loss
            (loss / accum).backward()
            micro.append(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        losses.append(float(torch.stack(micro).mean()))
        grads = _adapter_grads(model)
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        logits = model(input_ids=probe_batch()).logits
    return {"losses": losses, "norms": norms, "init": init, "grads": grads, "params": _adapter_params(model),
            "logits": logits}


def train_lora_rank(path: str, sizes: dict[str, Any], dp_size: int, export_dir: str,
                    targets: tuple[str, ...] = TARGETS, steps: int = STEPS, accum: int = ACCUM,
                    overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The user's accelerate loop with LoRA on a sharded load, then ``save_pretrained`` and a sharded reload."""
    import torch
    import torch.distributed as dist
    from peft import PeftModel, get_peft_model

    import shardadopt
    from shardadopt.adapters import AdapterLayoutError
    from shardadopt.testing.accelerator import fresh_accelerator
    from shardadopt.testing.models import local_copy

    shardadopt.enable()
    try:
        accelerator = fresh_accelerator(cpu=True, gradient_accumulation_steps=accum)
        base = _load(path, sizes)
        torch.manual_seed(SEED)
        try:
            model = get_peft_model(base, lora_config(target_modules=list(targets), **(overrides or {})))
        except AdapterLayoutError as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        init = _adapter_params(model)
        frozen = {n: local_copy(p) for n, p in model.named_parameters() if not is_adapter(n)}
        # foreach: one kernel over plain and DTensor factors, which needs per-mesh groups (split at prepare)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
        loader = torch.utils.data.DataLoader(list(_rows(dp_size, steps, accum)), batch_size=PER_DP_BATCH)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        losses, norms, micro, grads = [], [], [], {}
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(input_ids=batch, labels=batch).loss
                micro.append(loss.detach())
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
                    losses.append(float(accelerator.reduce(torch.stack(micro).mean(), "mean")))
                    micro = []
                    grads = _adapter_grads(model)
                optimizer.step()
                optimizer.zero_grad()
        unwrapped = accelerator.unwrap_model(model)
        base_unchanged = all(torch.equal(local_copy(p), frozen[n]) for n, p in unwrapped.named_parameters()
                             if n in frozen)
        trainable = sorted(n for n, p in unwrapped.named_parameters() if p.requires_grad)
        with torch.no_grad():
            logits = unwrapped(input_ids=probe_batch()).logits
        unwrapped.save_pretrained(export_dir)
        # the export loaded back onto a fresh sharded base: resharded, equal outputs
        reloaded = PeftModel.from_pretrained(_load(path, sizes), export_dir)
        with torch.no_grad():
            reloaded_logits = reloaded(input_ids=probe_batch()).logits
        return {"losses": losses, "norms": norms, "init": init, "grads": grads, "params": _adapter_params(unwrapped),
                "base_unchanged": base_unchanged, "trainable": trainable, "logits": logits,
                "reloaded_logits": reloaded_logits, "rank": dist.get_rank()}
    finally:
        shardadopt.disable()


# Adam normalises each element's step: a gradient that nearly cancels can move one element by a fraction of LR
# (see shardadopt.selftest.accelerate); whole-tensor errors (wrong data, gradient, clip) move by ~LR per step.
PARAM_MAX_DIFF = 0.5 * LR
PARAM_RMS = 1e-3 * LR


def _close(got, want) -> bool:
    diff = (got - want).abs()
    return got.shape == want.shape and float(diff.max()) < PARAM_MAX_DIFF and float(diff.pow(2).mean().sqrt()) \
        <= PARAM_RMS


def reference_cache(tiny_models: dict[str, str]):
    """``get(model, dp, targets, overrides)``: :func:`train_lora_reference`, computed once per argument set."""
    cache: dict[tuple, dict[str, Any]] = {}

    def get(model: str, dp: int, targets: tuple[str, ...], overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        key = (model, dp, targets, repr(sorted((overrides or {}).items())))
        if key not in cache:
            cache[key] = train_lora_reference(tiny_models[model], dp, targets, overrides=overrides)
        return cache[key]

    return get


def check_lora_training(pool, path: str, model: str, sizes: dict[str, Any], dp: int, references, workdir: str,
                        overrides: dict[str, Any] | None = None) -> None:
    """Run :func:`train_lora_rank` on ``pool`` and assert it equals the one-process run (test helper): losses, grad
    norms, last-step adapter gradients (DoRA: magnitudes too, ``lora_magnitude_vector``), initial and final
    adapters, identical on every rank, base unchanged; the export loads in this process with equal outputs and back
    onto a sharded base with equal outputs. ``overrides``: more ``LoraConfig`` options on both sides."""
    import json
    import os

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from shardadopt.adapters import dtensor_tensor_parallel

    targets = ATTENTION if model == "qwen3moe" else TARGETS
    export = os.path.join(workdir, "adapter")
    results = pool.run(train_lora_rank, path, sizes, dp, export, targets, STEPS, ACCUM, overrides, timeout=600)
    if sizes.get("tp_size", 1) > 1 and not dtensor_tensor_parallel():
        for result in results:  # refused at get_peft_model, naming the fix
            assert "tensor parallelism on transformers before 5.17" in result["error"], result
            assert "Upgrade transformers to 5.17" in result["error"]
        return
    assert "error" not in results[0], results[0]["error"]
    expected = references(model, dp, targets, overrides)
    assert all(n > MAX_NORM for n in expected["norms"]), "clipping must be active in every step"
    first = results[0]
    for rank, result in enumerate(results):
        assert result["base_unchanged"], f"rank {rank}: a base weight changed"
        assert result["trainable"] and all(is_adapter(n) for n in result["trainable"]), result["trainable"]
        for key in ("init", "params", "grads"):
            for name, value in result[key].items():
                assert torch.equal(value, first[key][name]), f"{key} {name} differs between rank 0 and {rank}"
        assert result["losses"] == first["losses"] and result["norms"] == first["norms"]
    assert sorted(first["init"]) == sorted(expected["init"])
    for name, value in expected["init"].items():
        assert torch.equal(first["init"][name], value), f"initial {name} differs from one process"
    torch.testing.assert_close(torch.tensor(first["losses"]), torch.tensor(expected["losses"]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(first["norms"]), torch.tensor(expected["norms"]), rtol=1e-5, atol=0)
    for name, value in expected["grads"].items():
        torch.testing.assert_close(first["grads"][name], value, rtol=1e-4, atol=1e-7, msg=f"gradient of {name}")
    bad = [n for n, v in expected["params"].items() if not _close(first["params"][n], v)]
    assert not bad, f"adapter weights differ from one process after training: {bad[:3]}"

    # the export: an ordinary PEFT adapter, full tensors, that one process loads with equal outputs
    assert sorted(os.listdir(export)) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    with open(os.path.join(export, "adapter_config.json")) as file:
        assert sorted(json.load(file)["target_modules"]) == sorted(targets)
    one = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), export)
    with torch.no_grad():
        logits = one(input_ids=probe_batch()).logits
    for result in results:
        torch.testing.assert_close(result["logits"], logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(result["reloaded_logits"], result["logits"], rtol=1e-6, atol=1e-6)


def resume_lora_rank(path: str, sizes: dict[str, Any], dp_size: int, directory: str, plan: tuple[str, ...],
                     save_after: int = 2) -> dict[str, Any]:
    """Two adapters, ``plan``: the one active in each step; ``save_state(directory)`` after ``save_after`` steps;
    then a fresh load (the default adapter active), adapters initialised from another seed,
    ``load_state(directory)`` and the remaining steps. Both runs' losses and final adapters, and (rank 0) what the
    checkpoint holds: its model entries with their bytes, its optimizer entries, and the bytes of the adapters."""
    import os

    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    import shardadopt
    from shardadopt.testing.accelerator import fresh_accelerator

    shardadopt.enable()
    try:
        def run(seed: int, resume: bool) -> tuple[list[float], dict[str, Any]]:
            from peft import get_peft_model

            accelerator = fresh_accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
            torch.manual_seed(seed)
            model = get_peft_model(_load(path, sizes), lora_config())
            model.add_adapter("b", lora_config(**SECOND))
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
            loader = torch.utils.data.DataLoader(list(_rows(dp_size, len(plan), ACCUM)),
                                                 batch_size=PER_DP_BATCH)
            model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
            if resume:
                accelerator.load_state(directory)
            losses, done = [], save_after if resume else 0
            for index, batch in enumerate(loader):
                if resume and index < save_after * ACCUM:
                    continue  # the batches the saved run consumed
                if index % ACCUM == 0:
                    model.set_adapter(plan[done])
                with accelerator.accumulate(model):
                    loss = model(input_ids=batch, labels=batch).loss
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                        losses.append(float(accelerator.reduce(loss.detach(), "mean")))
                    optimizer.step()
                    optimizer.zero_grad()
                if accelerator.sync_gradients:
                    done += 1
                    if not resume and done == save_after:
                        accelerator.save_state(directory)
            return losses, _adapter_params(model)

        straight, params = run(SEED, False)
        resumed, resumed_params = run(SEED + 99, True)
        metadata = FileSystemReader(os.path.join(directory, "state")).read_metadata().state_dict_metadata
        tensors = {k: v for k, v in metadata.items() if isinstance(v, TensorStorageMetadata)}
        model_bytes = {k: v.size.numel() * v.properties.dtype.itemsize for k, v in tensors.items()
                       if k.split(".")[0].startswith("model")}
        return {"straight": straight, "resumed": resumed, "params": params, "resumed_params": resumed_params,
                "model_entries": model_bytes, "optimizer_entries": sorted(k for k in tensors
                                                                           if k.startswith("optimizer")),
                "adapter_bytes": sum(v.numel() * v.element_size() for v in params.values())}
    finally:
        shardadopt.disable()


REFUSALS = {  # case -> LoraConfig overrides; each is refused when peft adds the adapter to a sharded model
    "expert-tensors": {},  # Qwen3-MoE: down_proj matches the experts' fused tensors
    "pissa": {"init_lora_weights": "pissa"},
    "gather-output-plan": {"target_modules": ["lm_head"]},  # TP plan colwise_gather_output
    "save-sharded-module": {"modules_to_save": ["gate_proj"]},  # TP plan colwise: its copy would output whole
    "save-fsdp-unit": {"modules_to_save": ["embed_tokens"]},
    "modules-to-save": {"modules_to_save": ["lm_head"]},  # an untied head: an FSDP unit of its own (norm + head)
}


def adapter_case(path: str, sizes: dict[str, Any], case: str) -> dict[str, Any]:
    """One adapter scenario on a sharded load: a refusal (``REFUSALS``, ``added-before-enable``, ``merge``) as the
    error text, or ``seeds-differ``: adapters added with every rank seeded differently (rank 0 with ``SEED``), a
    second one through ``add_adapter``: their initial values on this rank."""
    import torch
    import torch.distributed as dist
    from peft import get_peft_model

    import shardadopt
    from shardadopt.testing.accelerator import fresh_accelerator

    shardadopt.enable()
    try:
        accelerator = fresh_accelerator(cpu=True)
        base = _load(path, sizes)
        torch.manual_seed(SEED)
        try:
            if case in REFUSALS:
                get_peft_model(base, lora_config(**REFUSALS[case]))
            elif case == "added-before-enable":
                shardadopt.disable()
                model = get_peft_model(base, lora_config())
                shardadopt.enable()
                accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
            elif case == "merge":
                get_peft_model(base, lora_config()).merge_and_unload()
            elif case == "seeds-differ":
                torch.manual_seed(SEED + 1000 * dist.get_rank())
                model = get_peft_model(base, lora_config(init_lora_weights="gaussian"))
                model.add_adapter("second", lora_config(r=4, init_lora_weights="gaussian"))
                return {"init": _adapter_params(model)}
            else:
                raise ValueError(f"unknown case {case!r}")
        except ValueError as exc:  # AdapterLayoutError, AdoptionError
            return {"error": f"{type(exc).__name__}: {exc}"}
        return {"error": None}
    finally:
        shardadopt.disable()


def initial_adapters(path: str) -> dict[str, Any]:
    """What one process initialises for ``adapter_case(..., "seeds-differ")`` from ``SEED``."""
    import torch
    from peft import get_peft_model

    torch.manual_seed(SEED)
    model = get_peft_model(_load(path, None), lora_config(init_lora_weights="gaussian"))
    model.add_adapter("second", lora_config(r=4, init_lora_weights="gaussian"))
    return _adapter_params(model)


# -- several adapters on one model ---------------------------------------------------------------------------------

SECOND = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "o_proj", "gate_proj"]}  # adapter "b"
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
    out["params"] = _adapter_params(model)
    adapters = ["default", "b"]
    try:
        model.add_weighted_adapter(*MIXED)
        adapters.append(MIXED[2])
        out["mixed"] = {n: v for n, v in _adapter_params(model).items() if f".{MIXED[2]}." in n}
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
    model = get_peft_model(_load(path, None), lora_config())
    model.add_adapter("b", lora_config(**SECOND))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    rows = _rows(dp_size, len(PHASES) + 1, ACCUM)
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
            model = get_peft_model(_load(path, sizes), lora_config())
        except AdapterLayoutError as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        model.add_adapter("b", lora_config(**SECOND))
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
        loader = torch.utils.data.DataLoader(list(_rows(dp_size, len(PHASES) + 1, ACCUM)), batch_size=PER_DP_BATCH)
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
        reloaded = PeftModel.from_pretrained(_load(path, sizes), export)
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
    bad = [n for n, v in expected["params"].items() if not _close(first["params"][n], v)]
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
