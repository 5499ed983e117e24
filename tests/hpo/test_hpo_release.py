"""Before trusting a search for a release: warm starts across space versions, fresh-seed re-runs of the winners,
the pruning check and the plots, each through ``shardadopt hpo`` on a study a real search built (``optimize``
with a pruner, or ``Trainer.hyperparameter_search`` on a tiny model), on journal and PostgreSQL storage."""

from __future__ import annotations

import json
import random
import statistics
import sys
import uuid

import optuna
import pytest
from optuna.trial import TrialState

from shardadopt.cli import main
from shardadopt.hpo import DurabilityOptions, StudySpec, optimize
from shardadopt.hpo.pruning_check import ATTR_UNPRUNED, kendall, spearman
from shardadopt.hpo.reseed import (
    ATTR_RESEED_OF,
    ATTR_SEED,
    companion_name,
    configurations,
    fresh_seeds,
    load_companion,
    reseed,
)
from shardadopt.hpo.storage import resolve_storage
from shardadopt.hpo.warmstart import ATTR_WARM_START_OF
from shardadopt.testing.services import POSTGRES_URL, needs_postgres

optuna.logging.set_verbosity(optuna.logging.WARNING)

N_TRIALS, UNPRUNED, STEPS = 12, 6, 5


def space_v1(trial):
    return {"x": trial.suggest_float("x", -1.0, 1.0), "y": trial.suggest_int("y", 0, 8),
            "kind": trial.suggest_categorical("kind", ["a", "b"])}


def space_v2(trial):
    """v2 narrows x, drops y, adds z."""
    return {"x": trial.suggest_float("x", 0.0, 0.5), "kind": trial.suggest_categorical("kind", ["a", "b"]),
            "z": trial.suggest_float("z", 0.0, 1.0)}


def final_value(params, seed=None):
    """The 'trained' value: a bowl in x and y, plus noise that follows the training seed (the global RNG, which
    ``optimize`` seeds from a re-run's ``seed``; the search's own runs use seed 0 here)."""
    random.seed(0 if seed is None else seed)
    return (params["x"] - 0.3) ** 2 + 0.05 * params.get("y", 0) + (params["kind"] == "b") * 0.1 + \
        0.05 * random.random()


def objective(trial, space=space_v1, misleading=False):
    params = space(trial)
    seed = trial.user_attrs.get(ATTR_SEED)
    if seed is None:
        random.seed(0)
    noise = 0.05 * random.random()
    value = (params["x"] - 0.3) ** 2 + 0.05 * params.get("y", 0) + (params["kind"] == "b") * 0.1 + noise
    for step in range(STEPS):  # a learning curve; misleading: the early values rank trials backwards
        early = -value if misleading and step == 0 else value
        trial.report(early + 1.0 / (step + 1), step)
        if trial.should_prune():
            raise optuna.TrialPruned()
    return value


def search(url, name, n_trials=N_TRIALS, unpruned=UNPRUNED, misleading=False):
    spec = StudySpec(storage=url, study_name=name, direction="minimize",
                     sampler=optuna.samplers.RandomSampler(seed=1),
                     pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1))
    return optimize(spec, lambda t: objective(t, misleading=misleading), n_trials=n_trials,
                    durability=DurabilityOptions(hp_space=space_v1, unpruned_trials=unpruned, heartbeat_interval=None))


def hpo(capsys, *args):
    assert main(["hpo", *args, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module", params=["journal", pytest.param("postgres", marks=needs_postgres)])
def searched(request, tmp_path_factory):
    url = f"journal://{tmp_path_factory.mktemp('release')}/study.log" if request.param == "journal" else POSTGRES_URL
    name = f"release-{uuid.uuid4().hex[:8]}"
    search(url, name)
    yield url, name
    storage = resolve_storage(url, heartbeat_interval=None)
    for study_name in optuna.get_all_study_names(storage):
        if study_name.startswith(name):
            optuna.delete_study(study_name=study_name, storage=storage)


def run_reruns(url, name):
    """Reseed the top 3 twice each (``shardadopt.hpo.reseed.reseed``, idempotent) and run the companion as a job
    would: ``optimize`` on it."""
    reseed(resolve_storage(url, heartbeat_interval=None), name, top=3, seeds=2)
    return optimize(StudySpec(storage=url, study_name=companion_name(name), direction="minimize"), objective,
                    durability=DurabilityOptions(hp_space=space_v1, heartbeat_interval=None))


# -- pruning check ---------------------------------------------------------------------------------------------------

def test_unpruned_trials_run_to_the_end_and_the_check_trusts_a_faithful_rung(searched, capsys):
    url, name = searched
    trials = optuna.load_study(study_name=name, storage=resolve_storage(url)).trials
    unpruned = [t for t in trials if t.user_attrs.get(ATTR_UNPRUNED)]
    assert [t.number for t in unpruned] == list(range(UNPRUNED))
    assert all(t.state == TrialState.COMPLETE and sorted(t.intermediate_values) == list(range(STEPS))
               for t in unpruned)
    assert any(t.state == TrialState.PRUNED for t in trials[UNPRUNED:]), "the pruner prunes the others"

    check = hpo(capsys, "check-pruning", "--storage", url, "--study", name)
    assert check["verdict"] == "trust" and check["unpruned_only"] and check["rung"] == 0
    assert check["trials"] == [t.number for t in unpruned]
    at_rung = [t.intermediate_values[0] for t in unpruned]
    final = [t.value for t in unpruned]
    reference = statistics.correlation(*(_ranks(v) for v in (at_rung, final)))  # Pearson of the ranks
    assert check["spearman"] == pytest.approx(reference)
    best = min(unpruned, key=lambda t: t.value).number
    assert check["final_best"] == best and best in check["top_third"] and len(check["top_third"]) == 2


def test_the_check_distrusts_a_rung_that_ranks_backwards(searched, capsys):
    url, _ = searched
    name = f"misleading-{uuid.uuid4().hex[:8]}"
    search(url, name, n_trials=UNPRUNED, misleading=True)
    check = hpo(capsys, "check-pruning", "--storage", url, "--study", name)
    assert check["verdict"] == "distrust" and not check["best_in_top_third"]
    assert check["spearman"] == pytest.approx(-1.0) and check["kendall"] == pytest.approx(-1.0)
    later = hpo(capsys, "check-pruning", "--storage", url, "--study", name, "--rung", "2")
    assert later["verdict"] == "trust" and later["spearman"] == pytest.approx(1.0)
    optuna.delete_study(study_name=name, storage=resolve_storage(url))


def _ranks(values):
    order = sorted(range(len(values)), key=values.__getitem__)
    return [order.index(i) for i in range(len(values))]


def test_rank_correlations_with_ties_match_their_definitions():
    x, y = [1, 2, 2, 3, 5], [2, 1, 4, 4, 9]
    assert spearman(x, y) == pytest.approx(statistics.correlation([1, 2.5, 2.5, 4, 5], [2, 1, 3.5, 3.5, 5]))
    # tau-b by hand: 7 concordant, 1 discordant, 1 pair tied in x only, 1 in y only
    assert kendall(x, y) == pytest.approx((7 - 1) / ((7 + 1 + 1) * (7 + 1 + 1)) ** 0.5)


# -- reseed ------------------------------------------------------------------------------------------------------------

def test_reseed_is_idempotent_reruns_follow_their_seed_and_best_ranks_by_the_mean(searched, capsys):
    url, name = searched
    storage = resolve_storage(url)
    history = len(optuna.load_study(study_name=name, storage=storage).trials)
    first = hpo(capsys, "reseed", "--storage", url, "--study", name, "--top", "3", "--seeds", "2")
    def ours() -> list[str]:  # the database is shared with other test runs (CI runs two sets side by side)
        return sorted(study_name for study_name in optuna.get_all_study_names(storage) if study_name.startswith(name))

    already = ours()
    if first["enqueued"]:  # this storage's first reseed (the plot test may have run it already)
        assert len(first["enqueued"]) == 3 and all(len(s) == 2 for s in first["enqueued"].values())
    again = hpo(capsys, "reseed", "--storage", url, "--study", name, "--top", "3", "--seeds", "2")
    assert again["enqueued"] == {} and sum(len(s) for s in again["present"].values()) == 6
    assert ours() == already, "a second reseed creates no study"

    companion = run_reruns(url, name)  # runs the 6 waiting re-runs and nothing more
    assert len(companion.trials) == 6 and {t.state for t in companion.trials} == {TrialState.COMPLETE}
    main_study = optuna.load_study(study_name=name, storage=storage)
    assert len(main_study.trials) == history, "re-runs stay out of the search's history (its sampler's input)"
    for rerun in companion.trials:
        original = main_study.trials[rerun.user_attrs[ATTR_RESEED_OF]]
        assert rerun.params == original.params
        assert rerun.user_attrs[ATTR_SEED] in fresh_seeds(rerun.user_attrs["params_hash"], 2)
        assert rerun.value == pytest.approx(final_value(rerun.params, rerun.user_attrs[ATTR_SEED]))
    assert hpo(capsys, "reseed", "--storage", url, "--study", name, "--top", "3", "--seeds", "2")["enqueued"] == {}

    ranked = hpo(capsys, "best", "--storage", url, "--study", name, "--top", "5")
    with_reruns = [r for r in ranked if r["n_seeds"] > 1]
    assert len(with_reruns) == 3 and ranked[:3] == with_reruns
    for row in with_reruns:
        values = [main_study.trials[row["trial"]].value] + [companion.trials[n].value for n in row["reruns"]]
        assert row["n_seeds"] == 3 and row["mean"] == pytest.approx(statistics.mean(values))
        assert row["std"] == pytest.approx(statistics.stdev(values))
    assert [r["mean"] for r in with_reruns] == sorted(r["mean"] for r in with_reruns)
    status = hpo(capsys, "status", "--storage", url, "--study", name)
    assert status["best_configuration"] == ranked[0] and status["reseeded_configurations"] == with_reruns


# -- warm start --------------------------------------------------------------------------------------------------------

def test_warm_start_maps_onto_the_new_space_and_is_idempotent(searched, capsys):
    url, name = searched
    storage = resolve_storage(url)
    old = optuna.load_study(study_name=name, storage=storage)
    target = f"{name}-v2"
    args = ["warm-start", "--storage", url, "--from", name, "--to", target, "--top", "4",
            "--space", f"{__name__}:space_v2"]
    report = hpo(capsys, *args)
    ranked = [c.trial for c in configurations(old, load_companion(storage, name))[:4]]  # as `hpo best` ranks
    assert sorted(int(n) for n in report["enqueued"]) == sorted(ranked)  # clip: every one fits
    for number, params in report["enqueued"].items():
        source = old.trials[int(number)].params
        assert "y" not in params and params["kind"] == source["kind"]
        assert params["x"] == min(max(source["x"], 0.0), 0.5)
        notes = report["notes"][number]
        assert "y dropped (not in the new space)" in notes and "z is new: the sampler picks it" in notes
        assert any(n.startswith("x clipped") for n in notes) == (params["x"] != source["x"])
    assert hpo(capsys, *args) == {**report, "enqueued": {}, "notes": {}, "present": ranked}

    skipping = hpo(capsys, "warm-start", "--storage", url, "--from", name, "--to", f"{name}-v2skip", "--top", "4",
                   "--space", f"{__name__}:space_v2", "--out-of-range", "skip")
    outside = [n for n in ranked if not 0.0 <= old.trials[n].params["x"] <= 0.5]
    assert 0 < len(outside) < len(ranked), "the search's best straddle the new range: both cases are exercised"
    assert sorted(int(n) for n in skipping["skipped"]) == sorted(outside)
    assert all("outside the new range [0.0, 0.5]" in why for why in skipping["skipped"].values())
    assert main(["hpo", "warm-start", "--storage", url, "--from", name, "--to", f"{name}-v2skip", "--top", "4",
                 "--space", f"{__name__}:space_v2", "--out-of-range", "skip"]) == 0  # as people read it: each once
    said = capsys.readouterr().out.splitlines()
    inside = [n for n in ranked if n not in outside]
    assert said == [f"#{n} of {name} skipped: {skipping['skipped'][str(n)]}" for n in outside] + \
        [f"already warm-started into {name}-v2skip: " + ", ".join(f"#{n}" for n in inside)] * bool(inside)

    # the new study's job runs the warm-started trials first, with the sampler filling in z
    new = optimize(StudySpec(storage=url, study_name=target, sampler=optuna.samplers.RandomSampler(seed=2)),
                   lambda t: objective(t, space=space_v2), n_trials=5,
                   durability=DurabilityOptions(hp_space=space_v2, space_version="v2", heartbeat_interval=None))
    warm = [t for t in new.trials if ATTR_WARM_START_OF in t.user_attrs]
    assert len(warm) == 4 and all(t.state == TrialState.COMPLETE and "z" in t.params for t in warm)
    assert {t.user_attrs[ATTR_WARM_START_OF]["number"] for t in warm} == set(ranked)


def test_warm_start_as_a_durability_option_on_every_job(searched):
    url, name = searched
    target = f"{name}-v2opt"
    options = DurabilityOptions(hp_space=space_v2, space_version="v2", heartbeat_interval=None,
                                warm_start_from=name, warm_start_top=2)
    for _ in range(2):  # two jobs attach: the second finds the warm start done
        study = optimize(StudySpec(storage=url, study_name=target, direction="minimize"),
                         lambda t: objective(t, space=space_v2), n_trials=4, durability=options)
    warm = [t for t in study.trials if ATTR_WARM_START_OF in t.user_attrs]
    assert len(study.trials) == 8 and [t.number for t in warm] == [0, 1]
    with pytest.raises(ValueError, match="needs the study as a StudySpec"):
        optimize(optuna.create_study(), objective, n_trials=1, durability=options)


# -- plots -------------------------------------------------------------------------------------------------------------

def test_plots_draw_every_trial_and_the_seed_spread(searched, tmp_path, capsys):
    from shardadopt.hpo.plot import figures

    url, name = searched
    run_reruns(url, name)
    storage = resolve_storage(url)
    study = optuna.load_study(study_name=name, storage=storage)
    drawn, skipped = figures(study, load_companion(storage, name))
    assert skipped == {} and set(drawn) == {"history", "intermediate", "importances", "seed_spread"}

    lines = drawn["intermediate"].axes[0].get_lines()
    reported = [t for t in study.trials if t.intermediate_values]
    assert [line.get_gid() for line in lines] == [f"trial-{t.number}" for t in reported]  # one line per trial
    for line, trial in zip(lines, reported):
        assert list(line.get_ydata()) == [trial.intermediate_values[s] for s in sorted(trial.intermediate_values)]
        assert (line.get_linestyle() == "--") == (trial.state == TrialState.PRUNED)
    history = drawn["history"].axes[0]
    assert (history.get_xlabel(), history.get_ylabel()) == ("trial", "objective value")
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert len(history.collections[0].get_offsets()) == len(complete)
    assert list(history.get_lines()[0].get_ydata())[-1] == min(t.value for t in complete)
    assert {t.get_text() for t in drawn["importances"].axes[0].get_yticklabels()} == {"x", "y", "kind"}
    assert len(drawn["seed_spread"].axes[0].get_xticks()) == 3

    written = hpo(capsys, "plot", "--storage", url, "--study", name, "--out", str(tmp_path / "plots"))
    assert sorted(written["written"]) == sorted(drawn)
    for path in written["written"].values():
        with open(path, "rb") as handle:
            assert handle.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_names_the_extra(searched, tmp_path, capsys, monkeypatch):
    url, name = searched
    for module in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without the extra sees
    assert main(["hpo", "plot", "--storage", url, "--study", name, "--out", str(tmp_path)]) == 2
    assert "pip install 'shardadopt[plot]'" in capsys.readouterr().err


# -- a Trainer re-run trains with its seed ---------------------------------------------------------------------------

def test_trainer_rerun_trains_with_its_seed_like_a_fresh_run(searched, tiny_models, tmp_path):
    """A re-run of ``hyperparameter_search`` logs the losses of a fresh ``Trainer`` with ``seed=`` its seed (model
    initialisation and data order), not those of the search's own seed."""
    import shardadopt

    url, name = searched
    study = f"{name}-trainer"
    shardadopt.enable()
    try:
        losses = trainer_search(tiny_models["qwen3"], str(tmp_path / "search"), url, study, n_trials=2)
        reseed(resolve_storage(url, heartbeat_interval=None), study, top=1, seeds=1)
        reruns = trainer_search(tiny_models["qwen3"], str(tmp_path / "reruns"), url, companion_name(study),
                                n_trials=10)  # capped at the one waiting re-run
        companion = optuna.load_study(study_name=companion_name(study), storage=resolve_storage(url))
        (rerun,) = companion.trials
        seed, original = rerun.user_attrs[ATTR_SEED], rerun.user_attrs[ATTR_RESEED_OF]
        fresh = fresh_trainer_losses(tiny_models["qwen3"], str(tmp_path / "fresh"), rerun.params, seed)
    finally:
        shardadopt.disable()
    assert len(reruns) == 1 and reruns[0] == fresh
    assert losses[original] != fresh, "the search's own run (seed 0) trained differently"


def _loss_trainer(model_path, out, seed, recorder=None):
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from shardadopt.testing.models import token_dataset

    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=3, logging_steps=1,
                             report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, seed=seed)
    return Trainer(model_init=lambda trial=None: AutoModelForCausalLM.from_pretrained(model_path), args=args,
                   train_dataset=token_dataset(16), eval_dataset=token_dataset(4, 1000),
                   callbacks=[recorder] if recorder else [])


def trainer_search(model_path, out, url, study, n_trials):
    """Losses logged by each trial of a search (by trial number)."""
    from transformers import TrainerCallback

    losses: list[list[float]] = []  # one job runs the trials in order: index = trial number

    class Losses(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            losses.append([])

        def on_log(self, args, state, control, logs=None, **kwargs):
            if "loss" in (logs or {}):
                losses[-1].append(logs["loss"])

    def space(trial):
        return {"learning_rate": trial.suggest_float("learning_rate", 1e-3, 1e-1, log=True)}

    trainer = _loss_trainer(model_path, out, seed=0, recorder=Losses())
    trainer.hyperparameter_search(backend="optuna", hp_space=space, n_trials=n_trials, direction="minimize",
                                  storage=url, study_name=study, sampler=optuna.samplers.RandomSampler(seed=3),
                                  heartbeat_interval=None)
    return losses


def fresh_trainer_losses(model_path, out, params, seed):
    from transformers import TrainerCallback

    logged = []

    class Losses(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if "loss" in (logs or {}):
                logged.append(logs["loss"])

    trainer = _loss_trainer(model_path, out, seed, Losses())
    trainer.args.learning_rate = params["learning_rate"]
    trainer.train()
    return logged


def test_unpruned_trials_refuse_hyperband_which_samplers_recognise_by_type():
    with pytest.raises(ValueError, match="HyperbandPruner"):
        optimize(optuna.create_study(pruner=optuna.pruners.HyperbandPruner()), objective, n_trials=1,
                 durability=DurabilityOptions(unpruned_trials=2))
