"""Publication of checkpoints and exports in one process: a re-save of the same name killed between its two renames
loses nothing, and an export into a directory that holds an older export leaves only the new weights.

A killed publication runs in a child process (it SIGKILLs itself at the instant under test); the rest runs here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from shardadopt import checkpoint

STEPS_BEFORE = 1  # the step of the checkpoint the killed re-save replaces


def _build(path: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train(model, optimizer, steps: int) -> None:
    from shardadopt.testing import token_batch

    for step in range(steps):
        ids = token_batch(step, 2)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _params(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _resave_killed_between_renames(path: str, directory: str) -> None:
    """Child: a complete checkpoint at STEPS_BEFORE, one more step, then a re-save of the same name that dies when
    the old checkpoint was moved aside and the new one is about to take its place (rank 0, here the only rank)."""
    model, optimizer = _build(path)
    _train(model, optimizer, STEPS_BEFORE)
    checkpoint.save(directory, model, optimizer, step=STEPS_BEFORE)
    torch.save(_params(model), f"{directory}.params.pt")
    _train(model, optimizer, 1)
    rename = os.rename

    def die_before_the_second_rename(src, dst):
        if os.fspath(dst) == directory:  # the first rename moved the old checkpoint aside
            os.kill(os.getpid(), signal.SIGKILL)
        return rename(src, dst)

    os.rename = die_before_the_second_rename
    checkpoint.save(directory, model, optimizer, step=STEPS_BEFORE + 1)


class _Unsaveable:
    def state_dict(self):
        raise RuntimeError("the scheduler cannot be saved")


def test_resave_killed_between_its_renames_keeps_the_previous_checkpoint(tiny_models, tmp_path):
    """The kill leaves the only copy of the previous checkpoint moved aside: a save that then fails still leaves it
    loadable under its name, a resume finds and loads it exactly, and the next save replaces it as usual."""
    root = tmp_path / "run"
    directory = str(root / "latest")
    code = f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import test_checkpoint_publish as t; " \
           f"t._resave_killed_between_renames({tiny_models['llama']!r}, {directory!r})"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr
    assert not os.path.exists(directory), "the kill should land between the two renames"
    model, optimizer = _build(tiny_models["llama"])

    with pytest.raises(RuntimeError, match="cannot be saved"):
        checkpoint.save(directory, model, optimizer, _Unsaveable(), step=STEPS_BEFORE + 1)
    assert checkpoint.read_info(directory).step == STEPS_BEFORE

    assert checkpoint.latest(root) == directory
    checkpoint.load(directory, model, optimizer)
    saved = torch.load(f"{directory}.params.pt")
    assert all(torch.equal(p, saved[name]) for name, p in model.named_parameters())

    _train(model, optimizer, 1)
    checkpoint.save(directory, model, optimizer, step=STEPS_BEFORE + 1)
    assert checkpoint.read_info(directory).step == STEPS_BEFORE + 1
    assert sorted(os.listdir(root)) == ["latest", "latest.params.pt"]


def test_readers_find_a_checkpoint_moved_aside_by_a_killed_resave_and_leave_it_there(tmp_path):
    """What the kill leaves (the previous checkpoint only at its aside name), found by a resume's ``latest`` and
    ``read_info`` of its name, without renaming anything (a reader must not race a save)."""
    root = tmp_path / "run"
    aside = root / ".latest.partial.old"
    aside.mkdir(parents=True)
    (aside / checkpoint.MARKER).write_text('{"format": 1, "complete": true, "step": 3, "world_size": 1}')
    assert checkpoint.latest(root) == str(aside)
    info = checkpoint.read_info(root / "latest")
    assert (info.step, info.directory) == (3, str(aside))
    assert sorted(os.listdir(root)) == [".latest.partial.old"]


@pytest.mark.parametrize("first, second", [("5GB", "20KB"), ("20KB", "5GB"), ("20KB", "40KB")])
def test_export_over_an_older_export_keeps_only_the_new_weights(tiny_models, tmp_path, first, second):
    """``save_full`` twice into one directory with other shard sizes (single file <-> sharded): only the second
    export's weight files remain, and plain ``from_pretrained`` loads the second export's weights."""
    from transformers import AutoModelForCausalLM

    model, optimizer = _build(tiny_models["llama"])
    out = tmp_path / "export"
    checkpoint.save_full(model, out, max_shard_size=first)
    _train(model, optimizer, 1)
    written = checkpoint.save_full(model, out, max_shard_size=second)
    weights = sorted(name for name in os.listdir(out) if name.startswith("model"))
    index = ["model.safetensors.index.json"] if len(written) > 1 else []
    assert weights == sorted([os.path.basename(f) for f in written] + index), weights
    plain = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for name, value in model.named_parameters():
        assert torch.equal(plain.get_parameter(name), value.detach()), name
