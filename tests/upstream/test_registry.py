"""The patch contract: lazy, probe-gated, idempotent, reversible, switchable by environment."""

from __future__ import annotations

import importlib
import itertools
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import wrapt

import shardadopt
from shardadopt.patching.contract import Patch, Probe
from shardadopt.patching.registry import APPLIED, NOT_NEEDED, OFF, PENDING, UNSUPPORTED, Registry, Target

REPO = Path(__file__).resolve().parents[2]
_counter = itertools.count()

UPSTREAM_SOURCE = textwrap.dedent("""
    def compute(x):
        return x + 1

    class Engine:
        def step(self, x):
            return x * 2

        @staticmethod
        def helper(x):
            return x - 1
""")


@pytest.fixture
def upstream(tmp_path, monkeypatch):
    """A fresh fake upstream module name per test (written to disk, not imported yet)."""
    name = f"fake_upstream_{next(_counter)}"
    (tmp_path / f"{name}.py").write_text(UPSTREAM_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def add_ten(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs) + 10


def make_patch(module: str, pid: str = "fix-compute", needed: bool = True, requires=None, probe=None) -> Patch:
    return Patch(
        id=pid, summary="adds ten", upstream="example/upstream#1", requires=requires or {"wrapt": ">=2"},
        wrappers={Target(module, "compute"): add_ten, Target(module, "Engine.step"): add_ten,
                  Target(module, "Engine.helper"): add_ten},
        probe=probe or (lambda: Probe(needed, "upstream lacks it" if needed else "upstream has it")),
    )


def states(registry: Registry) -> dict[str, str]:
    return {s.id: s.state for s in registry.status()}


def test_enable_before_import_patches_on_import(upstream):
    registry = Registry([make_patch(upstream)])
    assert states(registry) == {"fix-compute": OFF}
    assert states_after(registry.enable()) == {"fix-compute": PENDING}
    assert upstream not in sys.modules, "enable() must not import upstream itself"
    module = importlib.import_module(upstream)
    assert states(registry) == {"fix-compute": APPLIED}
    assert module.compute(1) == 12
    assert module.Engine().step(3) == 16
    assert module.Engine.helper(5) == 14
    registry.disable()


def states_after(statuses) -> dict[str, str]:
    return {s.id: s.state for s in statuses}


def test_enable_after_import_patches_immediately(upstream):
    module = importlib.import_module(upstream)
    registry = Registry([make_patch(upstream)])
    assert states_after(registry.enable()) == {"fix-compute": APPLIED}
    assert module.compute(1) == 12
    registry.disable()


def test_enable_twice_is_a_no_op(upstream):
    module = importlib.import_module(upstream)
    registry = Registry([make_patch(upstream)])
    registry.enable()
    patched = (module.compute, module.Engine.__dict__["step"], module.Engine.__dict__["helper"])
    first = registry.status()
    registry.enable()
    assert registry.status() == first
    assert (module.compute, module.Engine.__dict__["step"], module.Engine.__dict__["helper"]) == patched
    assert patched[0] is module.compute
    assert module.compute(1) == 12, "a second enable() must not wrap twice"
    registry.disable()


def test_disable_restores_every_original_object(upstream):
    module = importlib.import_module(upstream)
    originals = (module.compute, module.Engine.__dict__["step"], module.Engine.__dict__["helper"])
    registry = Registry([make_patch(upstream)])
    registry.enable()
    assert module.compute is not originals[0]
    assert states_after(registry.disable()) == {"fix-compute": OFF}
    assert module.compute is originals[0]
    assert module.Engine.__dict__["step"] is originals[1]
    assert module.Engine.__dict__["helper"] is originals[2]
    assert isinstance(module.Engine.__dict__["helper"], staticmethod)
    # and enable() works again after disable()
    assert states_after(registry.enable()) == {"fix-compute": APPLIED}
    assert module.compute(1) == 12
    registry.disable()
    assert module.compute is originals[0]


def times_three(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs) * 3


def test_reverting_one_of_two_stacked_patches_keeps_the_other(upstream):
    module = importlib.import_module(upstream)
    original = module.compute
    inner = make_patch(upstream, "inner")
    outer = Patch(id="outer", summary="triples", upstream="example/upstream#2", requires={"wrapt": ">=2"},
                  wrappers={Target(upstream, "compute"): times_three}, probe=lambda: Probe(True, "needed"))
    registry = Registry([inner, outer])
    registry.enable()
    assert module.compute(1) == (1 + 1 + 10) * 3
    assert states_after(registry.enable(exclude=["inner"])) == {"inner": OFF, "outer": APPLIED}
    assert module.compute(1) == (1 + 1) * 3, "the outer patch must survive reverting the inner one"
    registry.enable()
    assert module.compute(1) == (1 + 1 + 10) * 3, "re-enabled, the inner patch goes back inside (stack order)"
    registry.disable()
    assert module.compute is original


def dependent(module: str, probe=None) -> Patch:
    """A patch that triples ``compute`` and only works on top of the one with id "fix-compute"."""
    return Patch(id="on-top", summary="triples", upstream="example/upstream#3", requires={"wrapt": ">=2"},
                 wrappers={Target(module, "compute"): times_three}, probe=probe or (lambda: Probe(True, "needed")),
                 depends_on=("fix-compute",))


def test_a_patch_waits_for_its_dependency_and_follows_it_off_and_back(upstream):
    registry = Registry([dependent(upstream), make_patch(upstream)])  # the dependent is registered first
    registry.enable()
    module = importlib.import_module(upstream)
    assert states(registry) == {"on-top": APPLIED, "fix-compute": APPLIED}
    assert module.compute(1) == (1 + 1 + 10) * 3, "the dependency applied first, the dependent around it"

    status = {s.id: s for s in registry.enable(exclude=["fix-compute"])}
    assert status["on-top"].state == UNSUPPORTED
    assert status["on-top"].reason.startswith("needs fix-compute, which is off (excluded"), status["on-top"].reason
    assert module.compute(1) == 2, "a dependent whose dependency went off is reverted too"

    assert states_after(registry.enable()) == {"on-top": APPLIED, "fix-compute": APPLIED}
    assert module.compute(1) == (1 + 1 + 10) * 3
    registry.disable()
    assert module.compute(1) == 2


@pytest.mark.parametrize("dependency_probe, state", [(lambda: Probe(False, "upstream has it"), APPLIED),
                                                      (lambda: 1 / 0, UNSUPPORTED)])
def test_a_dependency_not_needed_suffices_an_unsupported_one_blocks(upstream, dependency_probe, state):
    module = importlib.import_module(upstream)
    registry = Registry([make_patch(upstream, probe=dependency_probe), dependent(upstream)])
    status = {s.id: s for s in registry.enable()}
    assert status["on-top"].state == state, status["on-top"].reason
    if state == UNSUPPORTED:
        assert "needs fix-compute, which is unsupported (probe failed: ZeroDivisionError" in status["on-top"].reason
        assert module.compute(1) == 2
    registry.disable()


def test_enabling_again_leaves_a_blocked_patch_as_it_is(upstream, caplog):
    """A second ``enable()`` with the dependency still unsupported: the dependent stays unsupported, and no state
    change is logged (it used to go unsupported -> pending -> unsupported)."""
    importlib.import_module(upstream)
    registry = Registry([make_patch(upstream, probe=lambda: 1 / 0), dependent(upstream)])
    first = {s.id: (s.state, s.reason) for s in registry.enable()}
    assert first["on-top"][0] == UNSUPPORTED
    with caplog.at_level(logging.INFO, logger="shardadopt"):
        again = {s.id: (s.state, s.reason) for s in registry.enable()}
    assert again == first
    assert not [r for r in caplog.records if "on-top" in r.getMessage()], caplog.text
    registry.disable()


def test_an_unsupported_patch_is_a_warning_and_a_blocked_one_a_note(upstream, caplog):
    """A patch that could not decide leaves upstream's code running: logged at WARNING; its dependent, unsupported
    only because of it, at INFO (one warning per cause)."""
    importlib.import_module(upstream)
    registry = Registry([make_patch(upstream, probe=lambda: 1 / 0), dependent(upstream)])
    with caplog.at_level(logging.INFO, logger="shardadopt"):
        registry.enable()
    levels = {r.getMessage().split(":")[0]: r.levelno for r in caplog.records if "unsupported" in r.getMessage()}
    assert levels == {"fix-compute": logging.WARNING, "on-top": logging.INFO}, caplog.text
    registry.disable()


def test_unknown_dependency_is_refused(upstream):
    with pytest.raises(ValueError, match="depends on .'fix-compute'.. which is not another registered patch"):
        Registry([dependent(upstream)])


def test_patches_built_on_accelerate_adoption_declare_it():
    depends = {p.id: p.depends_on for p in shardadopt._registry().patches()}
    for pid in ("trainer-adopt-sharded-model", "accelerate-sharded-checkpoint"):
        assert depends[pid] == ("accelerate-adopt-sharded-model",), pid


def test_disable_before_import_leaves_module_untouched(upstream):
    registry = Registry([make_patch(upstream)])
    registry.enable()
    registry.disable()
    module = importlib.import_module(upstream)
    assert module.compute(1) == 2
    assert states(registry) == {"fix-compute": OFF}


def test_not_needed_touches_nothing(upstream):
    module = importlib.import_module(upstream)
    original = module.compute
    registry = Registry([make_patch(upstream, needed=False)])
    status = registry.enable()[0]
    assert (status.state, status.reason) == (NOT_NEEDED, "upstream has it")
    assert module.compute is original


def test_probe_that_raises_is_unsupported_not_a_crash(upstream):
    def broken_probe():
        raise AttributeError("upstream renamed things")

    registry = Registry([make_patch(upstream, probe=broken_probe)])
    registry.enable()
    module = importlib.import_module(upstream)  # must not raise
    status = registry.status()[0]
    assert status.state == UNSUPPORTED and "upstream renamed things" in status.reason
    assert module.compute(1) == 2


def test_missing_target_is_unsupported_and_rolled_back(upstream):
    module = importlib.import_module(upstream)
    original = module.compute
    patch = make_patch(upstream)
    patch.wrappers[Target(upstream, "Engine.vanished")] = add_ten
    registry = Registry([patch])
    status = registry.enable()[0]
    assert status.state == UNSUPPORTED and "Engine.vanished" in status.reason
    assert module.compute is original, "targets patched before the failure must be restored"


@pytest.mark.parametrize("requires, fragment", [
    ({"wrapt": "<1"}, "outside the range"),
    ({"surely-not-installed-dist": ">=1"}, "is not installed"),
])
def test_unsupported_version_is_reported_with_reason(upstream, requires, fragment):
    module = importlib.import_module(upstream)
    original = module.compute
    status = Registry([make_patch(upstream, requires=requires)]).enable()[0]
    assert status.state == UNSUPPORTED and fragment in status.reason
    assert module.compute is original


def test_env_var_switches_patches_off(upstream, monkeypatch):
    module = importlib.import_module(upstream)
    registry = Registry([make_patch(upstream, "a"), make_patch(upstream, "b", needed=False)])
    monkeypatch.setenv("SHARDADOPT_DISABLE", "a")
    assert states_after(registry.enable()) == {"a": OFF, "b": NOT_NEEDED}
    assert module.compute(1) == 2
    monkeypatch.setenv("SHARDADOPT_DISABLE", "all")
    assert states_after(registry.enable()) == {"a": OFF, "b": OFF}


def test_only_and_exclude_select_patches(upstream):
    module = importlib.import_module(upstream)
    registry = Registry([make_patch(upstream, "a"), make_patch(upstream, "b", needed=False)])
    assert states_after(registry.enable(only=["b"])) == {"a": OFF, "b": NOT_NEEDED}
    assert module.compute(1) == 2
    assert states_after(registry.enable(exclude=["b"])) == {"a": APPLIED, "b": OFF}
    assert module.compute(1) == 12
    # narrowing the selection reverts what is no longer selected
    assert states_after(registry.enable(only=["b"])) == {"a": OFF, "b": NOT_NEEDED}
    assert module.compute(1) == 2


@pytest.mark.parametrize("kwargs", [{"only": ["nope"]}, {"exclude": ["nope"]}])
def test_unknown_ids_name_the_valid_ones(upstream, kwargs):
    registry = Registry([make_patch(upstream, "a")])
    with pytest.raises(ValueError, match=r"unknown patch id.*'nope'.*valid ids: \['a'\]"):
        registry.enable(**kwargs)


def test_unknown_id_in_env_var(upstream, monkeypatch):
    monkeypatch.setenv("SHARDADOPT_DISABLE", "a,typo")
    with pytest.raises(ValueError, match=r"SHARDADOPT_DISABLE.*'typo'.*valid ids: \['a'\]"):
        Registry([make_patch(upstream, "a")]).enable()


def test_duplicate_ids_are_refused(upstream):
    with pytest.raises(ValueError, match="duplicate patch ids"):
        Registry([make_patch(upstream, "a"), make_patch(upstream, "a")])


def test_public_api_rejects_unknown_ids():
    with pytest.raises(ValueError, match="valid ids"):
        shardadopt.enable(only=["no-such-patch"])


def test_enable_imports_no_upstream():
    code = ("import sys, shardadopt; shardadopt.enable(); "
            "print(sorted(m for m in ('transformers', 'accelerate', 'optuna', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


def test_every_patch_targets_exist_in_installed_upstream():
    """Each registered patch resolves all its targets against what is installed (or reports why not)."""
    shardadopt.enable()
    try:
        for patch in shardadopt._registry().patches():
            for module in patch.modules:
                importlib.import_module(module)
        for status in shardadopt.status():
            assert status.state in {APPLIED, NOT_NEEDED}, f"{status.id}: {status.state}: {status.reason}"
    finally:
        shardadopt.disable()


def test_readme_lists_every_patch():
    readme = (REPO / "README.md").read_text()
    missing = [p.id for p in shardadopt._registry().patches() if f"`{p.id}`" not in readme]
    assert not missing, f"README.md's 'What it fixes' table lacks {missing}"


def test_patch_modules_are_named_after_their_ids():
    """One patch per module under shardadopt/patches/, the module named after the id ('-' -> '_')."""
    import pkgutil

    import shardadopt.patches as package

    found = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        own = [v for v in vars(module).values() if isinstance(v, Patch)]
        assert [name for name, v in vars(module).items() if isinstance(v, Patch)] == ["PATCH"], (
            f"{info.name} must define exactly one Patch, named PATCH")
        assert own[0].id.replace("-", "_") == info.name, f"{own[0].id} lives in {info.name}.py"
        found[own[0].id] = own[0]
    assert {p.id: p for p in shardadopt._registry().patches()} == found


def test_keeps_patch_state_restores_what_the_helper_changed():
    """A helper that enables shardadopt as users do leaves it as its caller had it: off again after a caller that
    had it off, on after a caller that had it on (the same patches, also when the helper disabled it)."""
    from shardadopt.testing.patching import enabled_patches, keeps_patch_state

    @keeps_patch_state
    def helper(on: bool) -> frozenset[str]:
        shardadopt.enable() if on else shardadopt.disable()
        return enabled_patches()

    shardadopt.disable()
    assert helper(True) and enabled_patches() == frozenset()
    with pytest.raises(ZeroDivisionError):
        keeps_patch_state(lambda: (shardadopt.enable(), 1 / 0))()
    assert enabled_patches() == frozenset()
    shardadopt.enable(exclude=["trainer-adopt-sharded-model"])
    try:
        before = enabled_patches()
        assert before and "trainer-adopt-sharded-model" not in before
        assert helper(False) == frozenset() and enabled_patches() == before
        assert helper(True) and enabled_patches()  # the caller's enable() stays on
    finally:
        shardadopt.disable()


def test_documented_subpackages_work_after_a_plain_import():
    """``shardadopt.checkpoint.latest(...)`` and every other dotted name the docs give users, after ``import
    shardadopt`` only (a fresh process, so nothing imported them before), and the import itself still loads no torch."""
    documented = sorted({name for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
                         for name in re.findall(r"\bshardadopt\.((?:[a-z_]+\.)+[A-Za-z_]+)", page.read_text())
                         if name.split(".")[0] != "testing"})  # the test harness (docs/development.md) is no user API
    assert "checkpoint.latest" in documented
    code = ("import functools, json, sys, shardadopt; shardadopt.enable(); heavy = 'torch' in sys.modules; "
            f"names = {documented!r}; missing = []\n"
            "for name in names:\n"
            "    try: functools.reduce(getattr, name.split('.'), shardadopt)\n"
            "    except AttributeError as error: missing.append(f'{name}: {error}')\n"
            "print(json.dumps([heavy, missing]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    heavy, missing = json.loads(out.stdout)
    assert not heavy, "import shardadopt + enable() imported torch"
    assert missing == []


# -- the contract: files, discovery, stacking ------------------------------------------------------------------------

def test_every_patch_has_its_fix_and_diffs():
    """Each patch's fix (``upstream-fixes/fixes/<id_>.py``) and at least one diff built from it
    (``upstream-fixes/<id>.diff`` or ``<id>@<release>.diff``) exist, and every fix and diff there belongs to a
    registered patch; the ``upstream`` field is the status in words, the files are derived from the id."""
    patches = shardadopt._registry().patches()
    ids = {p.id for p in patches}
    missing = {}
    for patch in patches:
        assert "upstream-fixes/" not in patch.upstream, f"{patch.id}: the files follow from the id, not upstream="
        diffs = [*REPO.glob(f"upstream-fixes/{patch.id}.diff"), *REPO.glob(f"upstream-fixes/{patch.id}@*.diff")]
        if not (REPO / patch.fix_file).is_file() or not diffs:
            missing[patch.id] = (patch.fix_file, patch.diff_files)
        assert patch.upstream_status == f"{patch.upstream}; upstream-fixes/{patch.id}[@<release>].diff"
    assert not missing, f"patches without their fix file or any diff: {missing}"
    orphans = sorted({f.name for f in (REPO / "upstream-fixes" / "fixes").glob("*.py")}
                     - {p.fix_file.rsplit("/", 1)[1] for p in patches})
    orphans += sorted(f.name for f in (REPO / "upstream-fixes").glob("*.diff")
                      if f.name.removesuffix(".diff").split("@")[0] not in ids)
    assert not orphans, f"fixes or diffs of no registered patch: {orphans}"
    status = {s.id: s.upstream for s in shardadopt.status()}
    assert status == {p.id: p.upstream_status for p in patches}


def test_every_file_a_patch_names_exists():
    """A patch module names files under ``upstream-fixes/`` in its docstring (``<id>@*.diff`` for a diff split by
    upstream release): each must match a file in the checkout."""
    missing = {}
    for module in sorted((REPO / "shardadopt" / "patches").glob("*.py")):
        for name in set(re.findall(r"upstream-fixes/[\w@*.+/-]+\.(?:diff|py)", module.read_text())):
            if not list(REPO.glob(name)):
                missing.setdefault(module.name, []).append(name)
    assert not missing, f"files named by patch modules that do not exist: {missing}"


@pytest.fixture
def extra_patch_modules(tmp_path, monkeypatch):
    """A folder added to ``shardadopt.patches``' search path; the modules written there are forgotten after."""
    import shardadopt.patches as package

    monkeypatch.setattr(package, "__path__", [*package.__path__, str(tmp_path)])
    yield tmp_path
    for name in [n for n in sys.modules if n.startswith("shardadopt.patches.") and
                 (tmp_path / f"{n.rsplit('.', 1)[1]}.py").exists()]:
        del sys.modules[name]


@pytest.mark.parametrize("name, source, error", [
    ("a_patch_misnamed", 'PATCH = Patch(id="another-name", summary="", upstream="", requires={}, wrappers={}, '
                         'probe=lambda: Probe(False, ""))', r"rename the module to another_name\.py"),
    ("helpers_only", "HELPER = 1", r"defines no PATCH = Patch"),
])
def test_discovery_refuses_a_module_that_breaks_the_contract(extra_patch_modules, name, source, error):
    from shardadopt.patches import discover

    (extra_patch_modules / f"{name}.py").write_text(
        f"from shardadopt.patching.contract import Patch, Probe\n{source}\n")
    with pytest.raises((TypeError, ValueError), match=error):
        discover()


def test_discovery_finds_a_new_module_without_a_list(extra_patch_modules):
    from shardadopt.patches import ALL_PATCHES, discover

    (extra_patch_modules / "zz_new_patch.py").write_text(
        "from shardadopt.patching.contract import Patch, Probe\n"
        'PATCH = Patch(id="zz-new-patch", summary="", upstream="", requires={}, wrappers={}, '
        'probe=lambda: Probe(False, ""))\n')
    assert [p.id for p in discover()] == [*(p.id for p in ALL_PATCHES), "zz-new-patch"]


def test_discovery_order_is_deterministic():
    """Patches are registered sorted by id and stacked in the same order in every process (whatever the hash seed
    or the file system's listing order)."""
    code = ("import json; from shardadopt.patches import ALL_PATCHES, process_registry; "
            "print(json.dumps([[p.id for p in ALL_PATCHES], process_registry().stack_order()]))")
    runs = [json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                      cwd=REPO, env={**os.environ, "PYTHONHASHSEED": seed}).stdout)
            for seed in ("1", "2")]
    assert runs[0] == runs[1]
    ids, order = runs[0]
    assert ids == sorted(ids) == [p.id for p in shardadopt._registry().patches()]
    assert sorted(order) == ids


def test_a_declared_wraps_around_decides_the_stack_whatever_applies_first(upstream):
    """On a shared target the patch that ``wraps_around`` another wraps outside it: registered first, applied
    first, or re-enabled last, the arithmetic shows the same stack; declared the other way round it is reversed."""
    module = importlib.import_module(upstream)

    def outer(wraps_around: tuple[str, ...] = ("fix-compute",)) -> Patch:  # "a-..." sorts before "fix-compute"
        return Patch(id="a-triples", summary="triples", upstream="example/upstream#2", requires={"wrapt": ">=2"},
                     wrappers={Target(upstream, "compute"): times_three}, probe=lambda: Probe(True, "needed"),
                     wraps_around=wraps_around)

    registry = Registry([outer(), make_patch(upstream)])
    assert registry.stack_order() == ["fix-compute", "a-triples"]
    registry.enable(only=["a-triples"])  # the outer one applies first ...
    registry.enable()  # ... the inner one later, and still lands inside
    assert module.compute(1) == (1 + 1 + 10) * 3
    registry.enable(exclude=["a-triples"])
    registry.enable()
    assert module.compute(1) == (1 + 1 + 10) * 3
    registry.disable()

    inner_first = make_patch(upstream)
    inner_first.wraps_around = ("a-triples",)
    reversed_registry = Registry([outer(()), inner_first])
    reversed_registry.enable()
    assert module.compute(1) == (1 + 1) * 3 + 10
    reversed_registry.disable()
    assert module.compute(1) == 2


@pytest.mark.parametrize("declared, error", [
    ({"a": ("nope",)}, "wraps_around 'nope', which is not another registered patch"),
    ({"a": ("b",), "b": ("a",)}, "in a cycle"),
])
def test_impossible_wraps_around_is_refused(upstream, declared, error):
    patches = [make_patch(upstream, "a"), make_patch(upstream, "b")]
    for patch in patches:
        patch.wraps_around = declared.get(patch.id, ())
    with pytest.raises(ValueError, match=error):
        Registry(patches)


def test_wraps_around_needs_a_shared_target(upstream):
    elsewhere = Patch(id="elsewhere", summary="", upstream="", requires={"wrapt": ">=2"},
                      wrappers={Target(upstream, "Engine.step"): times_three}, probe=lambda: Probe(True, ""))
    alone = Patch(id="alone", summary="", upstream="", requires={"wrapt": ">=2"},
                  wrappers={Target(upstream, "compute"): times_three}, probe=lambda: Probe(True, ""),
                  wraps_around=("elsewhere",))
    with pytest.raises(ValueError, match="wrap no target in common"):
        Registry([elsewhere, alone])


# Every upstream attribute that several shipped patches wrap, and the patches on it. A patch joining one: read the
# wrappers, declare ``wraps_around`` where the order changes what a call does, then add it here.
SHARED_TARGETS = {
    "DistributedMixin.maybe_distribute_model": {
        "transformers-sharding-sizes", "transformers-sharded-clean-exit", "transformers-tp-partial-grad",
        "transformers-fsdp-plan-unmatched-units", "transformers-tp-tied-lm-head", "transformers-tp-heads-refused"},
    "Accelerator.prepare_model": {"accelerate-cpu-parallelism-config", "accelerate-adopt-sharded-model"},
    "Trainer.call_model_init": {"trainer-sharded-checkpoint", "trainer-model-init-parallelism"},
    "WeightConverter.convert": {"transformers-fused-weight-sharding", "transformers-sharded-transpose-check"},
    "DistillationTrainer.__init__": {"trl-distillation-data-parallel", "trl-distillation-plain-tp-head"},
}
# (outer, inner) where the order matters: the heads refusal checks the plans the load applies, after the patches
# that complete them; the accelerator rebuilt for a model_init model sees save_only_model as Trainer(model=) does.
ORDER_MATTERS = [("transformers-tp-tied-lm-head", "transformers-tp-heads-refused"),
                 ("transformers-fsdp-plan-unmatched-units", "transformers-tp-heads-refused"),
                 ("trainer-model-init-parallelism", "trainer-sharded-checkpoint")]


def test_shared_targets_stack_in_the_declared_order():
    """The shipped patches that share a target are the ones listed above; where their order matters it is declared
    (``wraps_around``), and on the installed upstream each shared attribute is wrapped in stack order, the
    registry's, innermost first."""
    from collections import defaultdict

    from shardadopt.patching.registry import _resolve

    registry = shardadopt._registry()
    shared = defaultdict(set)
    for patch in registry.patches():
        for target in patch.targets:
            shared[target].add(patch.id)
    shared = {target: ids for target, ids in shared.items() if len(ids) > 1}
    assert {t.qualname: ids for t, ids in shared.items()} == SHARED_TARGETS
    order = registry.stack_order()
    for outer, inner in ORDER_MATTERS:
        assert order.index(inner) < order.index(outer), f"{outer} must wrap around {inner}"
    shardadopt.enable()
    try:
        for target, ids in shared.items():
            try:
                importlib.import_module(target.module)
            except ImportError:  # an optional integration (trl) not installed
                continue
            applied = {s.id for s in shardadopt.status() if s.state == APPLIED}
            stacked = registry.stacked(target)
            assert stacked == [pid for pid in order if pid in ids & applied], target
            value, layers = _resolve(target)[2], 0
            while isinstance(value, wrapt.FunctionWrapper):
                value, layers = value.__wrapped__, layers + 1
            assert layers == len(stacked), f"{target}: {layers} wrappers on it, the registry stacked {stacked}"
    finally:
        shardadopt.disable()
