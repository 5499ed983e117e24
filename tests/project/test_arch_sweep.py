"""The architecture matrix: ``docs/architectures.md`` states what the recorded data says, a fixed sample of the
sweep still holds on the installed release, and ``shardadopt doctor --model`` reports it.

``tools/arch_sweep.py`` records one verdict per model type and layout for each release line
(``shardadopt/data/arch_matrix/transformers-<minor>.json``). Re-running the whole sweep takes far longer than CI has;
the sample below (a few types per 2-rank layout, chosen for what they exercise) must give its recorded verdict on
the installed release, so a recorded ``verified`` cell that stops holding fails CI. The image-text-to-text matrix
(vision-language models trained with images, ``--task image-text-to-text``) has its own sample.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from packaging.version import Version

from shardadopt.testing.releases import newer_than_recorded
from shardadopt.testing.scripts import load_tool

REPO = Path(__file__).resolve().parents[2]

# layout -> types: a dense baseline, a type with its own quirks per layout, and the cells fixed or refused here
SAMPLE = {
    "fsdp": ["gemma2", "apertus"],  # sliding/full layers and soft-capping; xIELU scalars under FSDP
    "tp": ["apertus", "phi3", "llama4_text"],  # xIELU scalars (transformers-tp-partial-grad); fused qkv; fails
    "ep": ["mixtral", "deepseek_v3"],  # plain top-k router; MLA attention with grouped routing and shared experts
}
# image-text-to-text: patch-flattened images with a grid and rotary sections per axis (Qwen2.5-VL: window attention
# in the tower, a merger); fixed-size images pooled to fewer tokens, image tokens attending both ways (Gemma 3)
VLM_SAMPLE = {"fsdp": ["qwen2_5_vl"], "tp": ["gemma3"]}
# the types whose verdicts ``doctor --model`` must give on fsdp and tp (issue 41)
VLM_NAMED = ("qwen2_5_vl", "qwen3_vl", "gemma3", "llava")


def _installed_matrix(task: str = "causal-lm") -> dict:
    import transformers

    tool = load_tool("arch_sweep")
    path = tool.release_file(transformers.__version__, task)
    lines = [m["transformers"] for m in tool.load_matrices(task)]
    newer = newer_than_recorded("transformers", lines)
    if not path.exists() and newer:
        pytest.skip(newer)
    if not path.exists() and task != "causal-lm" and Version(transformers.__version__) < Version(lines[0]):
        pytest.skip(f"the {task} matrix is recorded from transformers {lines[0]} on")
    assert path.exists(), (f"no recorded {task} matrix for transformers {transformers.__version__}: run "
                           f"tools/arch_sweep.py --task {task}")
    return json.loads(path.read_text())


@pytest.mark.parametrize("task", ["causal-lm", "image-text-to-text"])
def test_docs_coverage_section_is_what_the_matrices_derive(task):
    tool = load_tool("arch_sweep")
    begin, end = tool.MARKERS[task]
    block = tool.coverage_block((REPO / "docs" / "architectures.md").read_text(), task)
    assert block is not None, f"docs/architectures.md lacks the {begin} ... {end} block"
    assert block == tool.coverage_section(tool.load_matrices(task)), (
        f"docs/architectures.md's {task} coverage differs from shardadopt/data/arch_matrix; run "
        "`python tools/arch_sweep.py --docs`")


def test_readme_vision_language_counts_are_the_recorded_ones():
    """The README's "Models:" line states how many image-text-to-text types are verified per layout on the newest
    recorded release: the numbers the matrix holds."""
    import re

    text = " ".join((REPO / "README.md").read_text().split())
    found = re.search(r"\((\d+) image-text-to-text types verified on `fsdp`, (\d+) on `tp`, (\d+) MoE types on `ep`, "
                      r"(\d+) on 2-D and (\d+) on HSDP, transformers (\d+\.\d+)\)", text)
    assert found, "README.md's Models line no longer states the vision-language counts in the form this test reads"
    newest = load_tool("arch_sweep").load_matrices("image-text-to-text")[-1]
    assert newest["transformers"].startswith(f"{found[6]}."), (newest["transformers"], found[6])
    verified = {layout: sum(cells.get(layout, {}).get("verdict") == "verified" for cells in newest["cells"].values())
                for layout in ("fsdp", "tp", "ep", "2d", "hsdp")}
    assert [int(n) for n in found.groups()[:5]] == list(verified.values()), verified


@pytest.mark.parametrize("task", ["causal-lm", "image-text-to-text"])
def test_every_recorded_cell_has_a_known_verdict_and_a_reason(task):
    from shardadopt.testing.sweep_compare import VERDICTS, VERIFIED

    matrices = load_tool("arch_sweep").load_matrices(task)
    assert matrices, f"no recorded {task} matrix"
    for matrix in matrices:
        for model_type, cells in matrix["cells"].items():
            for layout, cell in cells.items():
                assert cell["verdict"] in VERDICTS, (matrix["transformers"], model_type, layout, cell)
                assert (cell["verdict"] == VERIFIED) != bool(cell["detail"]), (
                    f"transformers {matrix['transformers']} {model_type} {layout}: a verdict other than verified "
                    f"states why, a verified one has nothing to say: {cell}")


def test_resume_retries_only_the_cells_not_testable_here():
    """``--resume`` keeps a recorded model verdict but retries "not testable here", a verdict about the harness of
    its day (glm4v_moe's cells said no image processor long after the harness used its dense sibling's)."""
    from shardadopt.testing.sweep_compare import NOT_TESTABLE, VERDICTS

    settled = load_tool("arch_sweep")._settled
    assert not settled(None) and not settled({"verdict": NOT_TESTABLE, "detail": "LookupError"})
    assert all(settled({"verdict": verdict}) for verdict in VERDICTS if verdict != NOT_TESTABLE)


def test_the_matrix_covers_every_type_with_a_tp_or_ep_plan():
    from shardadopt.testing.sweep import candidates

    matrix = _installed_matrix()
    for layout in ("tp", "ep"):
        missing = [t for t in candidates(layout) if layout not in matrix["cells"].get(t, {})]
        assert not missing, f"{layout}: no recorded cell for {missing}; run tools/arch_sweep.py --resume"


@pytest.mark.multiproc
@pytest.mark.parametrize(("task", "layout"), [("causal-lm", layout) for layout in sorted(SAMPLE)]
                         + [("image-text-to-text", layout) for layout in sorted(VLM_SAMPLE)])
def test_sample_of_the_sweep_gives_its_recorded_verdicts(pool2, tmp_path_factory, task, layout):
    from shardadopt.testing.sweep import sweep_layout
    from shardadopt.testing.sweep_compare import VERIFIED

    sample = (SAMPLE if task == "causal-lm" else VLM_SAMPLE)[layout]
    recorded = _installed_matrix(task)["cells"]
    live = {}
    sweep_layout(sample, layout, tmp_path_factory.mktemp(f"sweep-{task}-{layout}"),
                 lambda model_type, cell: live.__setitem__(model_type, cell), pool=pool2, task=task)
    for model_type in sample:
        cell = recorded.get(model_type, {}).get(layout)
        assert cell is not None, f"{model_type} {layout}: not recorded; run tools/arch_sweep.py"
        got = live[model_type]
        if cell["verdict"] == VERIFIED:
            assert got.verdict == VERIFIED, f"{model_type} {layout}: recorded verified, now {got.verdict}: {got.detail}"
        else:  # a cell fixed since it was recorded must be recorded again
            assert got.verdict == cell["verdict"], (f"{model_type} {layout}: recorded {cell['verdict']}, now "
                                                    f"{got.verdict} ({got.detail}); rerun tools/arch_sweep.py")


def fused_load_rank(path: str, sizes: dict, auto: str = "AutoModelForCausalLM") -> dict:
    """On each rank: the tiny checkpoint loaded by transformers' ``auto`` class with ``DistributedConfig(**sizes)``
    after ``shardadopt.enable()``; every parameter as this rank holds it (DTensors whole)."""
    import torch
    import transformers
    from transformers.distributed import DistributedConfig

    import shardadopt
    from shardadopt.testing import full

    shardadopt.enable()
    try:
        model = getattr(transformers, auto).from_pretrained(path, dtype=torch.float32,
                                                            distributed_config=DistributedConfig(**sizes))
        return {name: full(p).detach().clone() for name, p in model.named_parameters()}
    finally:
        shardadopt.disable()


def unsplit_fused_projections(pool2, path: str) -> dict[str, list[str]]:
    """layout -> the parameters whose ranks' pieces do not put together what one process loads."""
    import torch
    from transformers import AutoModelForCausalLM

    from shardadopt.testing.sweep_compare import _whole

    reference = dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).named_parameters())
    wrong = {}
    for layout, sizes in {"tp": {"tp_size": 2}, "fsdp": {"fsdp_size": 2}}.items():
        results = pool2.run(fused_load_rank, path, sizes, timeout=300)
        wrong[layout] = []
        for name, want in reference.items():
            candidates, every = _whole([r[name] for r in results], want.shape)
            matches = [torch.equal(c, want) for c in candidates]
            if not candidates or not (all(matches) if every else any(matches)):
                wrong[layout].append(name)
    return wrong


@pytest.mark.multiproc
def test_fused_checkpoint_tensors_load_into_their_own_shards(pool2, tmp_path):
    """HRM checkpoints store gate/q/k/v as one ``attn.gqkv_proj`` that the load chunks into four projections
    (transformers-fused-weight-sharding): sharded at load time, each must hold its own rows, as one process loads
    them (upstream sliced the fused tensor with the first projection's bounds first: silently wrong training)."""
    from safetensors import safe_open

    from shardadopt.testing.archs import write_tiny

    path = write_tiny("hrm_text", tmp_path)
    stored = [key for file in Path(path).glob("*.safetensors") for key in safe_open(str(file), "pt").keys()]
    assert any(key.endswith("attn.gqkv_proj.weight") for key in stored), stored  # the fused form is on disk
    assert unsplit_fused_projections(pool2, path) == {"tp": [], "fsdp": []}


def _expert_layouts(root: Path) -> dict[str, str]:
    """A tiny Qwen3-VL-MoE saved in transformers' expert layout (``save_pretrained``: ``gate_up_proj`` ``[experts,
    2 * intermediate, hidden]``) and the same weights in the original release's (dims 1 and 2 swapped on disk), with
    ``hidden != 2 * intermediate`` so the conversion can tell the two apart."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from shardadopt.testing.archs import IMAGE_TEXT, model_class, tiny_config

    config = tiny_config("qwen3_vl_moe", task=IMAGE_TEXT)
    config.text_config.moe_intermediate_size = config.text_config.hidden_size // 4
    torch.manual_seed(0)
    model_class("qwen3_vl_moe", IMAGE_TEXT)(config).save_pretrained(root / "model-layout")
    shutil.copytree(root / "model-layout", root / "release-layout")
    for file in (root / "release-layout").glob("*.safetensors"):
        tensors = load_file(file)
        swapped = {k: v.transpose(1, 2).contiguous() if k.endswith(("experts.gate_up_proj", "experts.down_proj"))
                   else v for k, v in tensors.items()}
        assert any(k.endswith("experts.down_proj") for k in tensors), sorted(tensors)
        save_file(swapped, file, metadata={"format": "pt"})
    return {"model": str(root / "model-layout"), "release": str(root / "release-layout")}


@pytest.mark.multiproc
def test_stacked_experts_of_either_stored_layout_load_into_their_shards(pool2, tmp_path):
    """Qwen3-VL-MoE's conversion transposes a checkpoint's stacked experts where their shape is not the
    parameter's (transformers-sharded-transpose-check): sharded at load time (fsdp, ep), each rank's slice was
    compared with the global shape and a slice already in the model's layout transposed (the load raised on
    ``down_proj``; a square ``gate_up_proj`` was transposed silently). Either stored layout must load as one
    process loads it."""
    import torch
    from transformers import AutoModelForImageTextToText

    from shardadopt.testing.layouts import distributed_sizes, unloadable_reason
    from shardadopt.testing.sweep_compare import _whole

    wrong = {}
    for stored, path in _expert_layouts(tmp_path).items():
        reference = dict(AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).named_parameters())
        experts = [n for n in reference if n.endswith("experts.down_proj")]
        assert experts and all(reference[n].shape[1] != reference[n].shape[2] for n in experts), experts
        for layout in ("fsdp", "ep"):
            sizes = distributed_sizes(layout)[0]
            if unloadable_reason(sizes):
                continue
            results = pool2.run(fused_load_rank, path, sizes, "AutoModelForImageTextToText", timeout=300)
            for name, want in reference.items():
                candidates, every = _whole([r[name] for r in results], want.shape)
                matches = [torch.equal(c, want) for c in candidates]
                if not candidates or not (all(matches) if every else any(matches)):
                    wrong.setdefault(f"{stored} layout, {layout}", []).append(name)
    assert wrong == {}


def _doctor(capsys, *argv: str) -> tuple[int, str]:
    from shardadopt.cli import main

    code = main(["doctor", *argv])
    return code, capsys.readouterr().out


def test_doctor_model_on_a_verified_architecture(capsys):
    code, out = _doctor(capsys, "--model", "apertus", "--layout", "tp=2")
    assert code == 0, out
    assert "(installed): verified" in out and "transformers-tp-partial-grad (applied)" in out, out


LAYOUT_FLAGS = {"fsdp": "fsdp=2", "tp": "tp=2", "ep": "ep=2,fsdp=2", "hsdp": "dp_replicate=2,fsdp=2",
                "2d": "fsdp=2,tp=2"}


@pytest.mark.parametrize("model_type", VLM_NAMED)
def test_doctor_model_gives_the_image_text_verdicts_of_a_vision_language_model(capsys, model_type):
    """A VLM type's fsdp and tp cells come from the image-text-to-text matrix (trained with images), recorded for
    the installed release line."""
    from shardadopt.testing.sweep import candidates

    cells = _installed_matrix("image-text-to-text")["cells"]
    for layout, flags in (("fsdp", "fsdp=2"), ("tp", "tp=2")):
        cell = cells.get(model_type, {}).get(layout)
        code, out = _doctor(capsys, "--model", model_type, "--layout", flags)
        header = f"layout {layout}, image-text-to-text (with images):\n"
        assert header in out, out
        rows = out.split(header, 1)[1].split("\npatches on", 1)[0].splitlines()
        if cell is None:  # Qwen3-VL's text model has no TP plan on transformers 5.15
            assert model_type not in candidates(layout, "image-text-to-text"), (
                f"{model_type} {layout}: not recorded; run tools/arch_sweep.py --task image-text-to-text")
            assert f"  transformers {_line()} (installed): not in the matrix (no tp plan, or not swept)" in rows, out
            continue
        assert any(row.startswith(f"  transformers {_line()} (installed): {cell['verdict']}") for row in rows), out
        assert code == (1 if cell["verdict"] in ("fails", "refused upstream", "refused by shardadopt") else 0), out


def _line() -> str:
    import transformers

    return ".".join(transformers.__version__.split(".")[:2])


def test_doctor_model_on_a_failing_architecture_exits_1(capsys, tmp_path):
    from shardadopt.commands.coverage import parse_layout
    from shardadopt.testing.archs import tiny_config

    cells = _installed_matrix()["cells"]
    failing = sorted((t, layout) for t, c in cells.items() for layout, cell in c.items() if cell["verdict"] == "fails")
    assert failing, "the installed release's matrix records no failing cell to report"
    model_type, layout = ("llama4_text", "tp") if ("llama4_text", "tp") in failing else failing[0]
    assert parse_layout(LAYOUT_FLAGS[layout]) == layout
    tiny_config(model_type).save_pretrained(tmp_path)  # a checkpoint directory's config.json
    code, out = _doctor(capsys, "--model", str(tmp_path), "--layout", LAYOUT_FLAGS[layout])
    assert code == 1, out
    assert f"model type '{model_type}'" in out and "(installed): fails" in out, out


def test_doctor_model_on_an_unknown_architecture(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_architecture"}))
    code, out = _doctor(capsys, "--model", str(tmp_path))
    assert code == 0, out
    assert "unknown to transformers" in out, out


def test_doctor_model_without_a_recorded_cell_says_why(capsys, monkeypatch):
    import shardadopt.commands.coverage as coverage

    # a recorded release line with no cell for the type: each layout's line says why
    monkeypatch.setattr(coverage, "matrices", lambda task="causal-lm": {"5.0": {"transformers": "5.0.0", "cells": {}}})
    code, out = _doctor(capsys, "--model", "llama")
    assert code == 0, out
    lines = out.splitlines()
    expected = {"fsdp": "not swept", "hsdp": "not swept", "tp": "no tp plan, or not swept",
                "2d": "no tp plan, or not swept", "ep": "no ep plan, or not swept"}
    for name, why in expected.items():
        row = lines[lines.index(f"layout {name}:") + 1]
        assert row == f"  transformers 5.0 (recorded): not in the matrix ({why})", out


def _expert_lora_line(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("expert LoRA ")]
    assert len(lines) == 1, out
    return lines[0]


def test_doctor_model_says_whether_expert_lora_is_supported(capsys):
    """The expert LoRA line follows what ``shardadopt.adapters.experts`` needs: fused 3-D expert tensors and an ep
    mesh (transformers 5.21+) with a verified ep cell in the installed matrix (Qwen3-MoE); a dense model is not an
    MoE; an MoE whose ep load the matrix does not record is not supported."""
    from transformers.distributed import DistributedConfig

    cells = _installed_matrix()["cells"]
    code, out = _doctor(capsys, "--model", "qwen3_moe", "--layout", "ep=2,fsdp=2")
    line = _expert_lora_line(out)
    if "ep_size" in DistributedConfig.__dataclass_fields__:
        assert cells["qwen3_moe"]["ep"]["verdict"] == "verified", cells["qwen3_moe"]
        assert ": supported: fused 3-D expert tensors (mlp.experts.down_proj, mlp.experts.gate_up_proj)" in line, line
    else:
        assert ": not supported on transformers" in line and "TP mesh" in line and "5.21" in line, line
    code, out = _doctor(capsys, "--model", "llama")
    assert ": not an MoE" in _expert_lora_line(out), out
    code, out = _doctor(capsys, "--model", "llama", "--layout", "tp=2")
    assert "expert LoRA" not in out, "the line belongs to the ep layout"
    if "ep_size" in DistributedConfig.__dataclass_fields__ and "jetmoe" in cells:
        assert "ep" not in cells["jetmoe"], cells["jetmoe"]  # fused experts, no expert-parallel plan recorded
        code, out = _doctor(capsys, "--model", "jetmoe", "--layout", "ep=2,fsdp=2")
        assert ": not supported: no expert-parallel (ep) cell" in _expert_lora_line(out), out


def test_doctor_layout_without_model_or_unknown_layout_is_refused(capsys):
    from shardadopt.cli import main

    assert main(["doctor", "--layout", "tp=2"]) == 2
    assert main(["doctor", "--model", "llama", "--layout", "pp=2"]) == 2
    assert "--layout 'pp=2'" in capsys.readouterr().err


@pytest.mark.multiproc
def test_doctor_check_runs_the_sweep_check_here(capsys):
    code, out = _doctor(capsys, "--model", "gemma2", "--layout", "fsdp=2", "--check")
    assert code == 0, out
    assert "check fsdp here: verified" in out, out


def test_layout_flags_name_the_sweep_layouts():
    from shardadopt.commands.coverage import LayoutError, parse_layout

    assert {name: parse_layout(flags) for name, flags in LAYOUT_FLAGS.items()} == {n: n for n in LAYOUT_FLAGS}
    assert parse_layout("ep=2") == "ep" and parse_layout("fsdp=4") == "fsdp"
    with pytest.raises(LayoutError, match="the sweep records"):
        parse_layout("ep=2,tp=2")


def fsdp_units_rank(path: str, exclude: list[str]) -> list[str]:
    """On each rank: the tiny VLM at ``path`` loaded with ``fsdp_size=2`` after ``shardadopt.enable(exclude=...)``;
    the names of its modules that are FSDP units (``fully_shard`` applied), the root aside."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoModelForImageTextToText
    from transformers.distributed import DistributedConfig

    import shardadopt

    shardadopt.enable(exclude=exclude)
    try:
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32,
                                                            distributed_config=DistributedConfig(fsdp_size=2))
        return sorted(name for name, module in model.named_modules() if name and isinstance(module, FSDPModule))
    finally:
        shardadopt.disable()


@pytest.mark.multiproc
def test_fsdp_load_makes_the_vision_blocks_units_of_their_own(pool2, tmp_path_factory):
    """transformers-fsdp-plan-unmatched-units: a Qwen2.5-VL loaded with ``fsdp_size=2`` has each vision block and
    each decoder layer as an FSDP unit; without the patch the vision blocks sit in the root unit (upstream's rule
    ``model.visual.layers.*`` matches nothing). That this load trains like one process is the fsdp cell of
    ``VLM_SAMPLE`` above (``test_sample_of_the_sweep_gives_its_recorded_verdicts``)."""
    from shardadopt.testing.archs import IMAGE_TEXT, write_tiny

    patch = "transformers-fsdp-plan-unmatched-units"
    path = write_tiny("qwen2_5_vl", tmp_path_factory.mktemp("vlm-units"), task=IMAGE_TEXT)
    patched, upstream_units = (pool2.run(fsdp_units_rank, path, exclude, timeout=300)
                               for exclude in ([], [patch]))
    assert patched[0] == patched[1] and upstream_units[0] == upstream_units[1]
    blocks = ["model.visual.blocks.0", "model.visual.blocks.1"]
    layers = ["model.language_model.layers.0", "model.language_model.layers.1"]
    assert set(blocks + layers) <= set(patched[0]), patched[0]
    assert set(layers) <= set(upstream_units[0]) and not set(blocks) & set(upstream_units[0]), upstream_units[0]


def vlm_generate_rank(path: str, sizes: dict, batch: dict, sample_seed: int | None,
                      exclude: tuple[str, ...] = ()) -> dict[str, list | str]:
    """On each rank: the tiny VLM at ``path`` loaded with ``DistributedConfig(**sizes)`` after
    ``shardadopt.enable(exclude=exclude)``; ``generate`` on the image-text ``batch`` greedily and, given
    ``sample_seed``, sampled after ``torch.manual_seed(sample_seed + rank)`` (a per-rank seed, as TRL and a user's
    loop seed). A patch left out may make generate raise: ``{"error": ...}`` then (a rank that raises would shut
    the module's pool down)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForImageTextToText
    from transformers.distributed import DistributedConfig

    import shardadopt

    shardadopt.enable(exclude=exclude)
    try:
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32,
                                                            distributed_config=DistributedConfig(**sizes)).eval()
        try:
            out = {"greedy": model.generate(**batch, do_sample=False, max_new_tokens=8).tolist()}
        except RuntimeError as exc:
            if not exclude:
                raise
            return {"error": f"{type(exc).__name__}: {exc}"}
        if sample_seed is not None:
            torch.manual_seed(sample_seed + dist.get_rank())
            out["sampled"] = model.generate(**batch, do_sample=True, max_new_tokens=8).tolist()
        return out
    finally:
        shardadopt.disable()


@pytest.fixture(scope="module")
def vlm_generation(tmp_path_factory):
    """model type -> (tiny checkpoint, image-text batch of 2 samples, the greedy tokens a plain load generates in
    this process), made once per type."""
    import torch
    from transformers import AutoModelForImageTextToText

    from shardadopt.testing.archs import IMAGE_TEXT, write_tiny
    from shardadopt.testing.vlm import collate, write_batches

    made = {}

    def get(model_type: str) -> tuple[str, dict, list]:
        if model_type not in made:
            path = write_tiny(model_type, tmp_path_factory.mktemp(f"vlm-generate-{model_type}"), task=IMAGE_TEXT)
            # what a processor hands generate: no labels, no num_crops (Gemma3Processor pops it; generate refuses it)
            batch = {k: v for k, v in collate(torch.load(write_batches(path, model_type, 2, 0))).items()
                     if k not in ("labels", "num_crops")}
            batch["attention_mask"] = torch.ones_like(batch["input_ids"])  # no padding: every row is one length
            plain = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
            want = plain.generate(**batch, do_sample=False, max_new_tokens=8).tolist()
            assert len(want[0]) > batch["input_ids"].shape[1], want  # it generated something
            made[model_type] = path, batch, want
        return made[model_type]

    return get


GENERATE_CELLS = [pytest.param(model_type, layout, id=f"{model_type}-{layout}")
                  for model_type in ("qwen2_5_vl", "gemma3") for layout in ("fsdp", "tp")]


@pytest.mark.multiproc
@pytest.mark.parametrize(("model_type", "layout"), GENERATE_CELLS)
def test_generate_with_images_on_a_sharded_vlm_matches_one_process(pool2, vlm_generation, model_type, layout):
    """``model.generate`` with ``pixel_values`` (and the type's grid / token-type tensors) on a tiny VLM loaded with
    ``fsdp_size=2`` or ``tp_size=2``: every rank's greedy tokens are the ones a plain load generates in this
    process from the same batch (fsdp: transformers-fsdp-generate-encoder-unshard gathers the root unit for the
    image encoding generate runs before the prefill); sampled with a per-rank seed on ``tp_size=2``, both TP ranks
    draw the same tokens (transformers-tp-sampling-agreement)."""
    from shardadopt.testing.layouts import distributed_sizes, unloadable_reason

    sizes = distributed_sizes(layout)[0]
    if reason := unloadable_reason(sizes):
        pytest.skip(reason)
    path, batch, want = vlm_generation(model_type)
    results = pool2.run(vlm_generate_rank, path, sizes, batch, 1234 if layout == "tp" else None, timeout=300)
    wrong = [rank for rank, result in enumerate(results) if result["greedy"] != want]
    assert not wrong, f"{model_type} {layout} ranks {wrong}: {[results[r]['greedy'] for r in wrong]} != {want}"
    if layout == "tp":
        assert results[0]["sampled"] == results[1]["sampled"], f"{model_type} tp: the TP ranks sampled apart"


@pytest.mark.multiproc
def test_generate_with_images_on_fsdp_fails_without_its_patch(pool2, vlm_generation):
    """Where transformers-fsdp-generate-encoder-unshard applies (generate encodes the images before the prefill,
    outside any forward: 5.25), leaving it out makes the fsdp cell above raise on every rank: the root unit's
    vision parameters are still shards when the patch embedding runs."""
    from shardadopt.patches.transformers_fsdp_generate_encoder_unshard import PATCH, probe

    found = probe()
    if not found.needed:
        pytest.skip(f"{PATCH.id} is not needed here: {found.reason}")
    path, batch, _ = vlm_generation("qwen2_5_vl")
    results = pool2.run(vlm_generate_rank, path, {"fsdp_size": 2}, batch, None, (PATCH.id,), timeout=300)
    assert all("DTensor" in result.get("error", "") for result in results), results
