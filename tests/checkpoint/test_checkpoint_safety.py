"""A checkpoint from elsewhere runs nothing when it is loaded, and a damaged one is one error on every rank.

On 2 gloo ranks with an FSDP-sharded tiny qwen3, checkpoints written by ``shardadopt.checkpoint.save``, the Trainer
and ``Accelerator.save_state`` (``shardadopt.selftest.checkpoint_damage``). Tampered: each file the issue's table
names (``rng_state_1.pt``, ``schedulers.pt``, ``extra.pt``, ``state/.metadata``; the Trainer's and accelerate's own
files) replaced by a pickle that runs ``touch``, the marker resealed as an attacker would: the command must not run,
and every rank raises ``UntrustedCheckpointError`` naming the file. Damaged: the table's cases (garbage in one
rank's RNG file, a truncated scheduler file, one rank's truncated shard), and two directories mixed: every rank
raises ``DamagedCheckpointError`` naming the file within ``BOUND`` seconds (no rank returns). ``extra`` holding a
user object loads only with ``trust_extra=True``.
"""

from __future__ import annotations

import os

import pytest

from shardadopt.selftest import checkpoint_damage as scenario

pytestmark = pytest.mark.multiproc

BOUND = 30.0
TAMPERED = {
    "plain": ["rng_state_1.pt", "schedulers.pt", "extra.pt", "state/.metadata"],
    "trainer": ["scheduler.pt", "rng_state_1.pth", "state/.metadata"],
    "accelerate": ["custom_checkpoint_0.pkl", "scheduler.bin", "random_states_1.pkl", "state/.metadata"],
}
# files upstream reads itself, with weights_only=True: the command must not run; upstream decides the error
UPSTREAM_READS = {"rng_state_1.pth", "scheduler.bin", "random_states_1.pkl"}


@pytest.fixture(scope="module")
def saved(tiny_models, tmp_path_factory, pool2):
    root = str(tmp_path_factory.mktemp("safety"))
    pool2.run(scenario.save_all, tiny_models["qwen3"], root, timeout=300)
    return root


def agreed(outcomes: list[dict], error: str, file: str) -> None:
    """Every rank raised ``error`` naming ``file``, within ``BOUND`` seconds."""
    for rank, outcome in enumerate(outcomes):
        assert outcome["raised"] == error, (rank, outcome)
        assert outcome["file"] == file and file in outcome["message"], (rank, outcome)
        assert outcome["seconds"] < BOUND, (rank, outcome)
    assert len({o["message"] for o in outcomes}) == 1, outcomes


@pytest.mark.parametrize("kind,name", [(k, n) for k, names in TAMPERED.items() for n in names])
def test_tampered_file_runs_nothing(kind, name, tiny_models, saved, pool2, tmp_path):
    directory = scenario.copy(scenario.checkpoints(saved, kind)[0], str(tmp_path / "checkpoint-2"))
    ran = tmp_path / "command-ran"
    scenario.tamper(directory, name, f"touch {ran}")
    outcomes = pool2.run(scenario.load_outcome, tiny_models["qwen3"], kind, directory, timeout=120)
    assert not ran.exists(), f"loading {name} ran its command"
    if name not in UPSTREAM_READS:
        agreed(outcomes, "UntrustedCheckpointError", name)


@pytest.mark.parametrize("legacy", [False, True], ids=["checksums", "previous-release"])
@pytest.mark.parametrize("name", ["rng_state_1.pt", "schedulers.pt", "state/__1_0.distcp"])
def test_damaged_file_is_one_error_on_every_rank(name, legacy, tiny_models, saved, pool2, tmp_path):
    """The issue's damaged cases: garbage in rank 1's RNG file, a truncated scheduler file, rank 1's shard
    truncated; found by the marker's checksums, or, in a checkpoint of the previous release (no checksums), when
    it is read (a shard: DCP does not say which file, the error names ``state/``)."""
    plain, other = scenario.checkpoints(saved, "plain")
    directory = scenario.copy(plain, str(tmp_path / "step-2"))
    if legacy:
        scenario.strip_checksums(directory)
    if name.startswith("rng"):
        with open(os.path.join(directory, name), "wb") as f:
            f.write(os.urandom(64))
    else:
        scenario.damage(directory, name, "truncate", 0.5, other)
    outcomes = pool2.run(scenario.load_outcome, tiny_models["qwen3"], "plain", directory, timeout=120)
    named = "state/" if legacy and name.startswith("state/") else name
    for outcome in outcomes:  # the file DCP could not read is named by the directory it is in
        outcome["file"] = named if outcome["file"] and outcome["file"].startswith(named) else outcome["file"]
    agreed(outcomes, "DamagedCheckpointError", named)


def test_shards_of_another_save_are_refused(tiny_models, saved, pool2, tmp_path):
    plain, other = scenario.checkpoints(saved, "plain")
    directory = scenario.copy(plain, str(tmp_path / "step-2"))
    assert scenario.damage(directory, "state/__1_0.distcp", "replace", 0.0, other)
    outcomes = pool2.run(scenario.load_outcome, tiny_models["qwen3"], "plain", directory, timeout=120)
    agreed(outcomes, "DamagedCheckpointError", "state/__1_0.distcp")
    assert "another save" in outcomes[0]["message"]


def test_damage_then_earlier_step_loads_in_the_same_processes(tiny_models, saved, pool2, tmp_path):
    """The agreed error leaves the process groups usable: the advice (an earlier step) works without a restart."""
    plain, other = scenario.checkpoints(saved, "plain")
    directory = scenario.copy(plain, str(tmp_path / "step-2"))
    scenario.damage(directory, "state/__0_0.distcp", "bitflip", 0.7, other)
    agreed(pool2.run(scenario.load_outcome, tiny_models["qwen3"], "plain", directory, timeout=120),
           "DamagedCheckpointError", "state/__0_0.distcp")
    for outcome in pool2.run(scenario.load_outcome, tiny_models["qwen3"], "plain", other, timeout=120):
        assert outcome["raised"] is None and outcome["extra"] == {"step": 1}, outcome


def save_user_extra(path: str, directory: str) -> None:
    import fractions

    from shardadopt import checkpoint

    model, optimizer, scheduler = scenario.scenario.build(path, scenario.FSDP)
    checkpoint.save(directory, model, optimizer, scheduler, extra={"ratio": fractions.Fraction(1, 3)})


def test_extra_with_user_objects_needs_the_opt_in(tiny_models, pool2, tmp_path):
    import fractions

    directory = str(tmp_path / "user-extra")
    pool2.run(save_user_extra, tiny_models["qwen3"], directory, timeout=120)
    refused = pool2.run(scenario.load_outcome, tiny_models["qwen3"], "plain", directory, timeout=120)
    agreed(refused, "UntrustedCheckpointError", "extra.pt")
    assert "trust_extra=True" in refused[0]["message"] and "fractions.Fraction" in refused[0]["message"]
    for outcome in pool2.run(scenario.load_outcome, tiny_models["qwen3"], "plain", directory, True, timeout=120):
        assert outcome["raised"] is None and outcome["extra"] == {"ratio": fractions.Fraction(1, 3)}, outcome
