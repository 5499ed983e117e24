"""``shardadopt doctor --model``: what the recorded architecture matrix knows about one model and layout.

The matrix (``shardadopt/data/arch_matrix/transformers-<minor>.json``, written by ``tools/arch_sweep.py``) holds one
verdict per model type and layout for each recorded transformers release line; the image-text-to-text matrix
(``image-text-to-text-transformers-<minor>.json``) the same for vision-language models trained with images.
:func:`report` reads a model's config (a checkpoint directory or a model type), prints the cells for the installed
release line (and the other recorded lines), the patches that act on that layout with their state on this
installation, and with ``check=True`` runs the sweep's check for that type and layout here, on a tiny model shrunk
from the same config.
:func:`expert_lora_support` says whether LoRA on the experts (``shardadopt.adapters.experts``) can be laid out for
the type, from what that layout needs: fused 3-D expert tensors (seen on the type's tiny model, built on the meta
device) and a recorded expert-parallel cell on the installed release line.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

MATRIX_DIR = Path(__file__).resolve().parents[1] / "data" / "arch_matrix"  # package data: found in any install
# DistributedConfig field -> the name --layout uses
_SIZE_NAMES = {"fsdp": "fsdp", "tp": "tp", "ep": "ep", "dp_replicate": "dp_replicate"}
_BAD = ("fails", "refused upstream", "refused by shardadopt")


class LayoutError(ValueError):
    """A ``--layout`` the sweep has no layout for."""


def parse_layout(text: str) -> str:
    """``fsdp=2,tp=2`` -> the sweep's layout name (``fsdp``, ``tp``, ``ep``, ``hsdp``, ``2d``)."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in _SIZE_NAMES or not value.isdigit():
            raise LayoutError(f"--layout {text!r}: expected NAME=SIZE pairs with NAME one of {sorted(_SIZE_NAMES)}, "
                              f"e.g. fsdp=2,tp=2")
        sizes[name] = int(value)
    used = frozenset(name for name, size in sizes.items() if size > 1)
    layouts = {frozenset({"fsdp"}): "fsdp", frozenset({"tp"}): "tp", frozenset({"ep"}): "ep",
               frozenset({"ep", "fsdp"}): "ep", frozenset({"fsdp", "tp"}): "2d",
               frozenset({"dp_replicate", "fsdp"}): "hsdp"}
    if used not in layouts:
        raise LayoutError(f"--layout {text!r}: the sweep records fsdp, tp, ep (alone or with fsdp), "
                          f"dp_replicate x fsdp (hsdp) and fsdp x tp (2d)")
    return layouts[used]


def matrices(task: str = "causal-lm") -> dict[str, dict[str, Any]]:
    """Release line (``5.24``) -> its recorded matrix for ``task`` (``causal-lm``, ``image-text-to-text``); empty
    when this installation has none."""
    if not MATRIX_DIR.is_dir():
        return {}
    found = {}
    prefix = "" if task == "causal-lm" else f"{task}-"
    for path in MATRIX_DIR.glob(f"{prefix}transformers-*.json"):
        data = json.loads(path.read_text())
        found[".".join(data["transformers"].split(".")[:2])] = data
    return found


def model_type_of(model: str) -> tuple[str, Any | None]:
    """(model type, the checkpoint's config or None) for a checkpoint directory or a model type name."""
    if os.path.isdir(model):
        config_file = os.path.join(model, "config.json")
        if not os.path.exists(config_file):
            raise FileNotFoundError(f"{model} has no config.json: pass a checkpoint directory or a model type")
        with open(config_file) as f:
            values = json.load(f)
        return values.get("model_type", ""), values
    return model, None


# the patches every sharded training loop goes through, whatever the layout
_EVERY_LAYOUT = ("accelerate-adopt-sharded-model", "accelerate-cpu-parallelism-config", "transformers-sharding-sizes",
                 "trainer-adopt-sharded-model")


def relevant_patches(layout: str) -> list[dict[str, str]]:
    """The patches acting on ``layout`` (by what their id names: ``-tp-``, ``-ep-``, ``fsdp-tp``) and those every
    sharded training loop goes through, with their state here."""
    import shardadopt

    def concerns(pid: str) -> bool:
        if "fsdp-tp" in pid:
            return layout == "2d"
        if "-tp-" in pid:
            return layout in ("tp", "2d")
        if "-ep-" in pid:
            return layout == "ep"
        return pid in _EVERY_LAYOUT

    return [s.as_dict() for s in shardadopt.status() if concerns(s.id)]


def expert_lora_support(model_type: str, values: dict[str, Any] | None = None) -> str:
    """Whether LoRA on the experts of ``model_type`` is laid out under expert parallelism on this installation, and
    why: the type must be an MoE (an expert count in its config), its experts fused 3-D tensors (what
    ``shardadopt.adapters.experts`` lays out by expert; checked on its tiny model built on the meta device), the
    installed transformers must shard experts on an ``ep`` mesh (``DistributedConfig(ep_size=...)``, 5.21+) and the
    installed release line's matrix must record an ``ep`` cell that is not a failure.

    Args:
        model_type: a transformers model type (``qwen3_moe``).
        values: a checkpoint's config values (the tiny model is shrunk from them), or None for the type's default.

    Returns:
        One line: ``"supported: ..."``, ``"not supported: ..."``, ``"unverified: ..."`` (an ep cell that is neither
        verified nor a failure), ``"unknown: ..."`` (no tiny config) or ``"not an MoE ..."``.
    """
    import torch
    import transformers
    from transformers.distributed import DistributedConfig

    from shardadopt.testing import archs

    try:
        config = archs.tiny_config(model_type, values)
        if not any(getattr(config, key, None) for key in archs.EXPERT_COUNTS):
            return f"not an MoE (no expert count among {', '.join(archs.EXPERT_COUNTS)} in its config)"
        with torch.device("meta"):
            network = archs.model_class(model_type)(config)
    except Exception as exc:  # a config the generic shrink cannot build: the sweep records it the same way
        return f"unknown: its tiny model does not build ({type(exc).__name__}: {exc})"
    # what experts.py lays out: a module's own 3-D parameter holding one slice per expert (num_experts)
    fused = sorted({f"{prefix.split('.', 3)[-1]}.{name}" for prefix, module in network.named_modules()
                    if isinstance(getattr(module, "num_experts", None), int)
                    for name, p in module.named_parameters(recurse=False)
                    if p.ndim == 3 and p.shape[0] == module.num_experts})
    if not fused:
        return ("not supported: its experts are not fused 3-D tensors (one per-expert tensor per projection is "
                "what is sharded by expert and laid out)")
    line = ".".join(transformers.__version__.split(".")[:2])
    if "ep_size" not in DistributedConfig.__dataclass_fields__:
        return (f"not supported on transformers {transformers.__version__}: it shards experts on the TP mesh "
                f"(no ep_size); upgrade to 5.21 or newer")
    cell = matrices().get(line, {}).get("cells", {}).get(model_type, {}).get("ep")
    if cell is None:
        return f"not supported: no expert-parallel (ep) cell for it in the transformers {line} matrix"
    if cell["verdict"] in _BAD:
        return f"not supported: its ep load {cell['verdict']} on transformers {line}"
    if cell["verdict"] != "verified":
        return f"unverified: fused 3-D expert tensors, but its ep cell is {cell['verdict']!r} on transformers {line}"
    return f"supported: fused 3-D expert tensors ({', '.join(fused)}), ep {cell['verdict']} on transformers {line}"


def report(model: str, layout: str | None = None, check: bool = False, timeout: float = 300.0) -> int:
    """Print what is known about ``model`` (and run the check with ``check``); 1 when a selected combination is
    known to fail on the installed release line (or fails the check), else 0."""
    import importlib

    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    import shardadopt
    from shardadopt.patches import process_registry
    from shardadopt.testing import archs, sweep

    model_type, values = model_type_of(model)
    line = ".".join(transformers.__version__.split(".")[:2])
    known = model_type in CONFIG_MAPPING
    recorded = matrices()
    print(f"model type {model_type!r}" + (f" (from {model})" if values is not None else "")
          + f"; transformers {transformers.__version__}")
    if not known:
        print(f"  unknown to transformers {transformers.__version__}: the matrix has nothing on it (it records the "
              f"types of the installed releases' Auto mappings)")
        return 0
    if not recorded:
        print(f"  no recorded matrix in this installation (looked in {MATRIX_DIR}: the package data "
              f"is missing; reinstall shardadopt)")
    layouts = [layout] if layout else list(sweep.LAYOUTS)
    bad = False
    tasks = _tasks(model_type)
    for task in tasks:
        recorded = matrices(task)
        for name in layouts:
            cells = {release: data["cells"].get(model_type, {}).get(name)
                     for release, data in sorted(recorded.items())}
            print(f"layout {name}:" if task == archs.CAUSAL_LM else f"layout {name}, {task} (with images):")
            for release, cell in cells.items():
                marker = "installed" if release == line else "recorded"
                if cell is None:
                    plan = sweep.LAYOUTS[name][1]  # fsdp and hsdp need no per-architecture plan
                    why = f"no {plan} plan, or not swept" if plan else "not swept"
                    print(f"  transformers {release} ({marker}): not in the matrix ({why})")
                    continue
                print(f"  transformers {release} ({marker}): {cell['verdict']}"
                      + (f": {cell['detail']}" if cell["detail"] else "")
                      + (f" ({cell['note']})" if cell.get("note") else ""))
                bad |= release == line and cell["verdict"] in _BAD
            if line not in cells:
                print(f"  transformers {line} (installed): no recorded matrix for this release line")
    if layout in (None, "ep"):
        print(f"expert LoRA (LoRA on the experts under ep, docs/expert-lora.md): "
              f"{expert_lora_support(model_type, values)}")
    shardadopt.enable()
    try:
        for module in sorted({m for p in process_registry().patches() for m in p.modules}):
            try:
                importlib.import_module(module)
            except Exception:  # `shardadopt doctor` reports import errors; here only the patch states matter
                continue
        for name in layouts:
            states = ", ".join(f"{p['id']} ({p['state']})" for p in relevant_patches(name))
            print(f"patches on {name}: {states}")
    finally:
        shardadopt.disable()
    if check:
        for task in tasks:
            for name in layouts:
                cell = check_here(model_type, name, values, timeout, task)
                what = name if task == archs.CAUSAL_LM else f"{name}, {task} (with images),"
                print(f"check {what} here: {cell.verdict}" + (f": {cell.detail}" if cell.detail else ""))
                bad |= cell.verdict in _BAD
    return 1 if bad else 0


def _tasks(model_type: str) -> list[str]:
    """The matrices that speak of ``model_type``: the causal-LM one (for every type, as before image-text models
    had their own), and the image-text-to-text one where that Auto mapping has the type."""
    from shardadopt.testing import archs

    in_mapping = {task: model_type in archs.auto_mapping(task) for task in archs.TASKS}
    if in_mapping[archs.IMAGE_TEXT] and not in_mapping[archs.CAUSAL_LM]:
        return [archs.IMAGE_TEXT]
    return [archs.CAUSAL_LM] + [archs.IMAGE_TEXT] * in_mapping[archs.IMAGE_TEXT]


def check_here(model_type: str, layout: str, values: dict[str, Any] | None, timeout: float,
               task: str = "causal-lm"):
    """The sweep's check of ``model_type`` on ``layout`` for ``task`` on this machine (its own ranks), on a tiny
    model shrunk from ``values`` (a checkpoint's config) or from the type's default config."""
    from shardadopt.testing import sweep

    cells = []
    with tempfile.TemporaryDirectory(prefix="shardadopt-check-") as root:
        sweep.sweep_layout([model_type], layout, root, lambda _, cell: cells.append(cell), timeout=timeout,
                           log=os.path.join(root, "ranks.log"), config_values=values, task=task)
    return cells[0]
