"""A release newer than the tested range runs on the probes, is announced once, and is refused where a fix is missing.

Nothing is installed: ``installed_version`` answers transformers 5.99.0 / accelerate 1.99.0 (what pip would give a
user the day those are released) while the installed code stays what it is. Then:

- every patch's probe still decides, to the states it gets on the real release numbers (no version gate fires);
- ``enable()`` warns once, in one line, that those releases are newer than the tested range; ``shardadopt doctor``
  prints that line once and still exits 0;
- a patch whose probe cannot decide (what a new upstream layout gives) is named in that line and makes doctor fail;
- a Qwen3 loaded with ``tp_size=2`` that needs that fix (upstream's ``replicated_with_grad_allreduce`` hooks on
  ``q_norm``/``k_norm``) is refused at accelerate ``prepare`` and at ``Trainer.train()``, naming the patch; with the
  patch switched off explicitly the user accepts upstream's behaviour and ``prepare`` goes ahead.
"""

from __future__ import annotations

import importlib
import json
import tempfile
import warnings
from typing import Any

import pytest
from packaging.version import Version

import shardadopt
from shardadopt.cli import main
from shardadopt.patches.transformers_tp_replicated_grad_accumulation import PATCH as TP_PATCH
from shardadopt.patching import registry
from shardadopt.patching.registry import APPLIED, NOT_NEEDED, UNSUPPORTED
from shardadopt.upstream import versions

TP_ID = TP_PATCH.id

FAKE = {"transformers": "5.99.0", "accelerate": "1.99.0"}


def fake_newer_releases(monkeypatch: Any) -> None:
    """``installed_version`` reports ``FAKE`` (registry's version gate and versions' reports both read it)."""
    real = registry.installed_version

    def installed(name: str) -> Version | None:
        return Version(FAKE[name]) if name in FAKE else real(name)

    monkeypatch.setattr(registry, "installed_version", installed)
    monkeypatch.setattr(versions, "installed_version", installed)


def undecidable_tp_probe(monkeypatch: Any) -> None:
    """The replicated-grad probe finds neither upstream's broken shape nor the fixed one (a new upstream layout)."""
    from shardadopt.patches import transformers_tp_replicated_grad_accumulation as patch
    from shardadopt.upstream.probing import Undecided

    def probe():
        raise Undecided("ReplicatedWithGradAllReduce: a hook layout this shardadopt does not know")

    monkeypatch.setattr(patch.PATCH, "probe", probe)


def import_patched_modules() -> None:
    for patch in shardadopt._registry().patches():
        for module in patch.modules:
            importlib.import_module(module)


def enable_recording() -> tuple[dict[str, str], list[str]]:
    """``enable()``: every patch's state, and the shardadopt warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        states = {s.id: s.state for s in shardadopt.enable()}
    return states, [str(w.message) for w in caught if issubclass(w.category, shardadopt.UntestedUpstreamWarning)]


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(shardadopt, "_WARNED", set())
    yield
    shardadopt.disable()


def test_probes_decide_on_a_newer_release_and_enable_warns_once(monkeypatch):
    import_patched_modules()
    real_states, real_warnings = enable_recording()
    shardadopt.disable()
    assert real_warnings == [], "the tested releases must not warn"
    fake_newer_releases(monkeypatch)
    states, lines = enable_recording()
    assert states == real_states, "a newer release number alone must not change what the probes decide"
    assert set(states.values()) <= {APPLIED, NOT_NEEDED}, states
    (line,) = lines
    assert "\n" not in line
    assert "transformers 5.99.0, accelerate 1.99.0 are newer than the tested range" in line, line
    assert f"transformers {versions.TESTED['transformers']}" in line and "every probe decided" in line, line
    assert enable_recording()[1] == [], "said once per process"


def doctor(capsys, *args: str) -> tuple[int, str]:
    code = main(["doctor", *args])
    return code, capsys.readouterr().out


def test_doctor_on_a_newer_release_says_so_once_and_passes(monkeypatch, capsys):
    fake_newer_releases(monkeypatch)
    code, text = doctor(capsys)
    assert text.count("newer than the tested range") == 1, text
    assert "transformers  5.99.0" in text and "(tested up to 5.25)" in text
    assert code == 0 and "status: ok" in text
    code, out = doctor(capsys, "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] and "1.99.0" in report["untested"]
    assert {r["name"]: r["newer_than_tested"] for r in report["versions"]}["transformers"] is True


def test_an_undecided_probe_is_named_by_enable_and_doctor(monkeypatch, capsys):
    import_patched_modules()
    fake_newer_releases(monkeypatch)
    undecidable_tp_probe(monkeypatch)
    states, (line,) = enable_recording()
    assert states[TP_ID] == UNSUPPORTED
    assert f"could not decide or apply: {TP_ID}" in line and "refused at accelerate prepare / Trainer" in line
    shardadopt.disable()
    code, text = doctor(capsys)
    assert code == 1 and text.count(f"could not decide or apply: {TP_ID}") == 1, text
    assert "a hook layout this shardadopt does not know" in text


# -- the refusal (2 ranks, tp_size=2) -----------------------------------------------------------------------------

def prepare_or_train(path: str, via: str, exclude: list[str]) -> str:
    """On every rank: fake the newer release and the undecided probe, ``enable(exclude=...)``, load Qwen3 with
    ``tp_size=2`` and prepare it with accelerate (``via="accelerate"``) or train one Trainer step
    (``via="trainer"``); the error's type and message, or "ok"."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from shardadopt.selftest.trainer import TokenDataset
    from shardadopt.testing.accelerator import forget_accelerate_state

    with pytest.MonkeyPatch.context() as monkeypatch:
        fake_newer_releases(monkeypatch)
        undecidable_tp_probe(monkeypatch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", shardadopt.UntestedUpstreamWarning)
            shardadopt.enable(exclude=exclude)
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                         distributed_config=DistributedConfig(tp_size=2))
            forget_accelerate_state()
            if via == "accelerate":
                from accelerate import Accelerator

                Accelerator(cpu=True).prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
            else:
                from transformers import Trainer, TrainingArguments

                with tempfile.TemporaryDirectory(prefix="shardadopt-untested-") as out:
                    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=1,
                                             save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
                    Trainer(model=model, args=args, train_dataset=TokenDataset(4)).train()
            return "ok"
        except Exception as exc:  # the refusal under test, reported to the test process
            return f"{type(exc).__name__}: {exc}"
        finally:
            shardadopt.disable()


@pytest.mark.multiproc
@pytest.mark.parametrize("via", ["accelerate", "trainer"])
def test_a_model_needing_the_undecided_fix_is_refused(pool2, tiny_models, via):
    for message in pool2.run(prepare_or_train, tiny_models["qwen3"], via, [], timeout=180):
        assert message.startswith("UnfixedUpstreamError"), message
        assert TP_ID in message and "a hook layout this shardadopt does not know" in message, message
        assert "transformers 5.99.0" in message and f"shardadopt.enable(exclude=['{TP_ID}'])" in message, message


@pytest.mark.multiproc
def test_switching_the_undecided_patch_off_accepts_upstream(pool2, tiny_models):
    assert pool2.run(prepare_or_train, tiny_models["qwen3"], "accelerate", [TP_ID], timeout=180) == ["ok", "ok"]
