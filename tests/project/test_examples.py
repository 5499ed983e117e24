"""The examples page (``docs/examples.md``), run as users run it.

Every ``bash`` block of that page runs verbatim (``bash -e -o pipefail``) in a scratch directory that holds
``examples/`` (a link to this checkout's) and ``runs/tiny-models`` (the session's tiny checkpoints, the path the
examples generate them at), with the active interpreter's ``bin`` first on ``PATH`` as an activated virtual
environment has it. Then the test checks what the block left behind: checkpoints, the step a resumed run started
from, the consolidated export (loaded with a plain ``from_pretrained``), the trials' states in storage. Every
``python`` block of the page must be lines of an example file, so the page cannot drift from the code.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
BLOCK_TIMEOUT = 900  # seconds: a hang fails the test instead of stalling CI

# CI time: .ci/run runs this suite on the newest and on the oldest supported set, and the library tests cover every
# path these examples take on both. So each block below runs on one set only (split so that each set sheds about
# half of this module's time), and every block still runs once per CI run; on the other set these cover its paths:
# - accelerate_loop fsdp/tp: test_accelerate_adopt (each layout against one process), test_checkpoint_integrations
#   (save_state resumes exactly, full state dict and save_model per layout);
# - hpo_search: test_hpo_trainer (a sharding model_init, a SIGKILLed search requeued by the CLI and resumed from its
#   last complete checkpoint), test_hpo_multijob (two jobs on one study), test_hpo_release (reseed and a seeded
#   Trainer re-run, check-pruning, plot, warm-start);
# - trainer_finetune: test_checkpoint_integrations (Trainer checkpoints, save_total_limit, resume, save_model);
# - custom_loop_hpo: test_hpo_loop (optimize with pruning), test_hpo_multijob (trial_checkpoint_dir,
#   resume_checkpoint).
# - lora_sft tp (LoRA on TP needs transformers 5.17+, so newest only): test_trl_lora (SFTTrainer with LoRA on fsdp
#   against DDP) and test_adapters (save_pretrained, reload in one process) on the oldest set.
# - grpo tp (TRL's fused LM head needs DTensor TP shards, transformers 5.17+, so newest only): test_online (GRPO and
#   RLOO on fsdp and ep against DDP, TP refused by name) on the oldest set.
# - long_context: test_context_parallel (the accelerate loop and the Trainer with cp_size=2 against one process).
# The ep and 2d blocks are on neither list: the oldest transformers cannot load those layouts (skip_reason).
ONE_SET_BLOCKS = {"accelerate_loop-fsdp": "oldest", "accelerate_loop-tp": "oldest", "trainer_finetune": "oldest",
                  "custom_loop_hpo": "oldest", "hpo_search": "newest", "lora_sft-tp": "newest",
                  "grpo-tp": "newest", "long_context": "oldest"}


def page() -> str:
    """docs/examples.md, then the "## Example" section of docs/long-context.md (its other code is prose's)."""
    long_context = (ROOT / "docs" / "long-context.md").read_text().split("\n## Example\n", 1)[1]
    return (ROOT / "docs" / "examples.md").read_text() + "\n" + long_context.split("\n## ", 1)[0]


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", page(), flags=re.M | re.S)


def commands(block: str) -> list[list[str]]:
    """The command lines of a block, split as the shell splits them (up to any control operator)."""
    lines = []
    for line in block.splitlines():
        words = shlex.split(line, comments=True)
        for stop, word in enumerate(words):
            if word in ("&", "&&", "||", ";", "|"):
                words = words[:stop]
                break
        if words:
            lines.append(words)
    return lines


def script(block: str) -> str:
    names = {Path(w).name for line in commands(block) for w in line if w.startswith("examples/")}
    assert len(names) == 1, f"a block runs one example: {names}"
    return names.pop()


def option(block: str, name: str) -> str | None:
    for line in commands(block):
        if name in line:
            return line[line.index(name) + 1]
    return None


def block_id(block: str) -> str:
    layout = option(block, "--layout")
    return script(block).removesuffix(".py") + (f"-{layout}" if layout else "")


def dependency_set() -> str:
    """``"oldest"`` on the oldest supported transformers minor release (CI's oldest set), else ``"newest"``."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    from shardadopt.upstream.versions import SUPPORTED, installed_version

    lowest = next(Version(s.version) for s in SpecifierSet(SUPPORTED["transformers"]) if s.operator == ">=")
    return "oldest" if installed_version("transformers").release[:2] == lowest.release[:2] else "newest"


def blocks_for_this_set() -> list[str]:
    here = dependency_set()
    return [b for b in blocks("bash") if ONE_SET_BLOCKS.get(block_id(b), here) == here]


# -- the page is complete and its code is the examples' code ----------------------------------------------------


def test_every_example_is_run_by_a_block_and_every_python_block_is_example_code():
    ran = {script(b) for b in blocks("bash")}
    assert ran == {p.name for p in EXAMPLES.glob("*.py")}, "each example needs a command block in docs/examples.md"
    assert set(ONE_SET_BLOCKS) <= {block_id(b) for b in blocks("bash")}, "ONE_SET_BLOCKS names a missing block"
    assert set(ONE_SET_BLOCKS.values()) <= {"oldest", "newest"}
    sources = {p.name: p.read_text().splitlines() for p in EXAMPLES.glob("*.py")}
    for code in blocks("python"):
        want = code.rstrip("\n").splitlines()
        found = [name for name, lines in sources.items()
                 if any(textwrap.dedent("\n".join(lines[i:i + len(want)])).splitlines() == want
                        for i in range(len(lines) - len(want) + 1))]
        assert found, f"docs/examples.md python block is not a verbatim excerpt of any example:\n{code}"


# -- running the blocks --------------------------------------------------------------------------------------------


def run(block: str, work: Path, tiny_models: dict[str, str]) -> str:
    """Run ``block`` in ``work`` as a user's shell would; its combined output (fails the test on an error)."""
    (work / "runs").mkdir(parents=True)
    (work / "examples").symlink_to(EXAMPLES)
    (work / "runs" / "tiny-models").symlink_to(Path(tiny_models["qwen3"]).parent)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", block], cwd=work, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=BLOCK_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"block did not finish within {BLOCK_TIMEOUT}s:\n{block}\n{out[-6000:]}")
    (work.parent / "block.log").write_text(out)
    if proc.returncode != 0:
        notable = "\n".join(line for line in out.splitlines()
                             if re.search(r"Error|terminate|Traceback|exitcode|Signal", line))
        pytest.fail(f"exit code {proc.returncode} (full output: {work.parent / 'block.log'}):\n{block}\n"
                    f"{notable[-4000:]}\n...\n{out[-4000:]}")
    return out


def skip_reason(block: str) -> str | None:
    """Why the installed transformers cannot run this block's layout (upstream's limitation), or None."""
    layout = option(block, "--layout")
    if layout == "2d":
        from shardadopt.testing.layouts import unloadable_reason

        return unloadable_reason({"fsdp_size": 2, "tp_size": 2})
    if layout == "ep" and script(block) == "accelerate_loop.py":
        from transformers.distributed import DistributedConfig

        if "ep_size" not in DistributedConfig.__dataclass_fields__:
            return ("this transformers runs expert parallelism on the TP mesh with plain per-rank shards: no "
                    "consolidated export (save_full refuses them; its save_pretrained writes wrong shapes)")
    return None


def assert_trained_export(final: Path, initial: str) -> None:
    """``final`` loads with a plain from_pretrained: the initial model's tensors, finite, and trained."""
    import torch
    from transformers import AutoModelForCausalLM

    trained = dict(AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).named_parameters())
    start = dict(AutoModelForCausalLM.from_pretrained(initial, dtype=torch.float32).named_parameters())
    assert trained.keys() == start.keys()
    assert all(trained[n].shape == p.shape and torch.isfinite(trained[n]).all() for n, p in start.items())
    moved = [n for n, p in start.items() if not torch.equal(trained[n], p)]
    assert len(moved) > len(start) // 2, f"the export is mostly the untrained model: {len(moved)}/{len(start)} moved"


def complete_checkpoints(root: Path) -> list[str]:
    from shardadopt import checkpoint

    return sorted(p.name for p in root.iterdir() if checkpoint.is_complete(p)) if root.is_dir() else []


def load_study(url: str, name: str):
    import optuna

    from shardadopt.hpo.storage import resolve_storage

    return optuna.load_study(study_name=name, storage=resolve_storage(url, heartbeat_interval=None))


@pytest.mark.parametrize("block", blocks_for_this_set(), ids=block_id)
def test_example_block(block, tmp_path, tiny_models):
    reason = skip_reason(block)
    if reason:
        pytest.skip(reason)
    work = tmp_path / "work"
    out = run(block, work, tiny_models)
    CHECKS[script(block)](block, work, out, tiny_models)


def check_accelerate_loop(block: str, work: Path, out: str, tiny_models: dict[str, str]) -> None:
    layout = option(block, "--layout")
    run_dir = work / "runs" / f"accelerate-{layout}"
    steps = int(option(block, "--steps") or 6)
    if option(block, "--stop-after"):  # interrupted after step 4's checkpoint, then resumed there
        assert "stopping after step 4" in out and "resumed at step 4" in out, out[-3000:]
        assert "step 5 loss" in out and "step 3 loss" in out.split("resumed at step 4")[0]
        assert "step 3 loss" not in out.split("resumed at step 4")[1], "the resumed run repeated steps"
    assert complete_checkpoints(run_dir / "checkpoints") == [f"step-{s}" for s in range(2, steps + 1, 2)]
    assert_trained_export(run_dir / "final", tiny_models["qwen3moe" if layout == "ep" else "qwen3"])


def check_trainer_finetune(block: str, work: Path, out: str, tiny_models: dict[str, str]) -> None:
    run_dir = work / "runs" / "trainer-finetune"
    assert "training from step 0 to 6" in out and "stopped after step 4" in out, out[-3000:]
    assert "training from step 4 to 6" in out, "the second run did not resume from checkpoint-4"
    # save_total_limit=2 rotated checkpoint-2 away
    assert complete_checkpoints(run_dir) == ["checkpoint-4", "checkpoint-6"]
    state = json.loads((run_dir / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["global_step"] == 6
    assert [e["step"] for e in state["log_history"] if "loss" in e] == [1, 2, 3, 4, 5, 6]
    assert_trained_export(run_dir / "final", tiny_models["qwen3"])


def check_hpo_search(block: str, work: Path, out: str, tiny_models: dict[str, str]) -> None:
    from shardadopt.hpo.durability import ATTR_CHECKPOINT_DIR, ATTR_RESUME_FROM
    from shardadopt.hpo.failures import ATTR_KIND, ATTR_RETRY_OF

    storage = option(block, "--storage")
    study = load_study(storage.replace("journal://", f"journal://{work}/"), option(block, "--study"))
    trials = study.trials
    assert len(trials) == 6, [(t.number, t.state.name) for t in trials]
    first, (dead, retry) = trials[:4], trials[4:]
    assert {t.state.name for t in first} <= {"COMPLETE", "PRUNED"}, [t.state.name for t in first]
    assert sum(t.state.name == "COMPLETE" for t in first) >= 2  # MedianPruner(n_startup_trials=2)
    assert len({t.user_attrs["pid"] for t in first}) == 2, "the first four trials came from two jobs"
    assert dead.state.name == "FAIL" and dead.user_attrs[ATTR_KIND] == "preempted", dead
    # the retry may be pruned: MedianPruner compares it with the first trials from step 2 on
    assert retry.state.name in ("COMPLETE", "PRUNED") and retry.user_attrs[ATTR_RETRY_OF] == dead.number
    assert retry.params == dead.params
    # reports are at training examples seen (4 per step on 2 ranks): the dead trial reported step 1 and was
    # killed after checkpoint-1, so its retry must start at step 2
    assert sorted(dead.intermediate_values) == [4], dead.intermediate_values
    assert min(retry.intermediate_values) == 8, retry.intermediate_values
    assert retry.user_attrs[ATTR_RESUME_FROM] == dead.user_attrs[ATTR_CHECKPOINT_DIR]
    assert retry.user_attrs[ATTR_CHECKPOINT_DIR] != dead.user_attrs[ATTR_CHECKPOINT_DIR]
    assert f"study {option(block, '--study')}: 6 trials" in out, out[-3000:]
    best = min((t for t in trials if t.state.name == "COMPLETE"), key=lambda t: t.value)  # n_startup_trials=2
    assert f"best #{best.number}:" in out
    check_hpo_release_story(storage.replace("journal://", f"journal://{work}/"), study, work, out)


def check_hpo_release_story(storage: str, study, work: Path, out: str) -> None:
    """The block's second half: re-runs with fresh seeds, the pruning check, the plots, a warm-started v2 study."""
    from shardadopt.hpo.plot import figures
    from shardadopt.hpo.pruning_check import ATTR_UNPRUNED, check_pruning
    from shardadopt.hpo.reseed import ATTR_RESEED_OF, ATTR_SEED, configurations
    from shardadopt.hpo.warmstart import ATTR_WARM_START_OF

    complete = sorted((t for t in study.trials if t.state.name == "COMPLETE"), key=lambda t: t.value)
    assert [t.number for t in study.trials if t.user_attrs.get(ATTR_UNPRUNED)] == [0, 1, 2, 3]
    reruns = load_study(storage, f"{study.study_name}-reseed").trials
    assert sorted(t.user_attrs[ATTR_RESEED_OF] for t in reruns) == sorted(t.number for t in complete[:3])
    assert all(t.state.name == "COMPLETE" and ATTR_SEED in t.user_attrs for t in reruns), reruns
    companion = load_study(storage, f"{study.study_name}-reseed")
    ranked = configurations(study, companion)
    assert f"#{ranked[0].trial}: mean {ranked[0].mean:.6g}" in out and "over 2 seed(s)" in out
    check = check_pruning(study)  # 4 unpruned trials are too few: it uses every completed one, and says so
    assert f"verdict: {check.verdict.upper()}: {check.reason}" in out and not check.unpruned_only
    drawn, skipped = figures(study, companion)
    assert skipped == {}, skipped
    lines = drawn["intermediate"].axes[0].get_lines()
    assert len(lines) == sum(bool(t.intermediate_values) for t in study.trials)  # one line per trial
    assert drawn["intermediate"].axes[0].get_xlabel() == "step"
    assert len(drawn["seed_spread"].axes[0].get_xticks()) == 3
    for name in drawn:
        png = work / "runs" / "hpo-search" / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    v2 = load_study(storage, f"{study.study_name}-v2").trials
    warm = [t for t in v2 if ATTR_WARM_START_OF in t.user_attrs]
    assert [t.user_attrs[ATTR_WARM_START_OF]["number"] for t in warm] == [c.trial for c in ranked[:3]]
    assert all(set(t.params) == {"learning_rate", "max_grad_norm"} and 1e-4 <= t.params["learning_rate"] <= 1e-2
               for t in warm)


def check_custom_loop_hpo(block: str, work: Path, out: str, tiny_models: dict[str, str]) -> None:
    from shardadopt import checkpoint
    from shardadopt.hpo.durability import ATTR_CHECKPOINT_DIR

    root = work / "runs" / "custom-loop-hpo"
    study = load_study(f"journal://{root}/optuna-journal.log", "custom-loop")
    trials = study.trials
    assert len(trials) == int(option(block, "--n-trials")), trials
    assert [t.state.name for t in trials[:2]] == ["COMPLETE", "COMPLETE"]  # MedianPruner(n_startup_trials=2)
    for t in trials:
        assert t.state.name in ("COMPLETE", "PRUNED"), (t.number, t.state.name, t.user_attrs)
        reported = sorted(t.intermediate_values)
        assert reported == list(range(1, len(reported) + 1)), reported
        last = checkpoint.latest(root / t.user_attrs[ATTR_CHECKPOINT_DIR])  # trial_checkpoint_dir's
        assert last is not None and checkpoint.read_info(last).step == reported[-1]
        if t.state.name == "COMPLETE":
            assert reported[-1] == 4 and t.value == t.intermediate_values[4]
    assert f"best: #{study.best_trial.number}" in out, out[-3000:]


def check_lora_sft(block: str, work: Path, out: str, tiny_models: dict[str, str]) -> None:
    adapter = work / "runs" / "lora-sft" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8, config
    assert (adapter / "adapter_model.safetensors").is_file()
    assert "outputs equal the sharded model's" in out, out[-3000:]


def check_grpo(block: str, work: Path, out: str, tiny_models: dict[str, str]) -> None:
    rewards = re.search(r"rewards per step: \[(.*)\]", out)
    assert rewards and len(rewards.group(1).split(",")) == 4, out[-3000:]
    assert "the 2 tensor-parallel ranks sampled the same completions" in out, out[-3000:]


def check_long_context(block: str, work: Path, out: str, tiny_models: dict[str, str]) -> None:
    steps, seq = int(option(block, "--steps")), int(option(block, "--seq-len"))
    losses = [float(x) for x in re.findall(r"step \d+ loss (\S+) grad_norm", out)]
    assert len(losses) == steps and all(0 < x < 100 for x in losses), out[-3000:]
    assert f"each rank's forward saw {seq // 2} of {seq} positions (cp_size=2)" in out, out[-3000:]


CHECKS = {"accelerate_loop.py": check_accelerate_loop, "trainer_finetune.py": check_trainer_finetune,
          "hpo_search.py": check_hpo_search, "custom_loop_hpo.py": check_custom_loop_hpo,
          "lora_sft.py": check_lora_sft, "grpo.py": check_grpo, "long_context.py": check_long_context}
