"""Property: any file of a checkpoint truncated, bit-flipped, replaced by another save's or removed, on any rank, is
``DamagedCheckpointError`` naming that file on every rank, and nothing else (no rank returns, none hangs).

hypothesis draws the file (every file of the checkpoint, its completion marker and each rank's own files included),
the damage and where in the file it lands, for the checkpoints ``shardadopt.checkpoint.save``, the Trainer and
``Accelerator.save_state`` write of an FSDP-sharded tiny qwen3 on 2 gloo ranks
(``shardadopt.selftest.checkpoint_damage``). The one exception is the marker removed: the directory is then not a
complete checkpoint, ``IncompleteCheckpointError`` on every rank, as for a save that never finished; the marker
replaced by the other save's names a file that differs from it and counts the others. A replacement with identical
bytes (a file both saves wrote alike) is no damage: the load must then succeed on every rank. Each example's load
must end within the pool's timeout (a hang fails it, and the module).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardadopt.checkpoint import MARKER
from shardadopt.selftest import checkpoint_damage as scenario
from shardadopt.testing import RankPool

pytestmark = pytest.mark.multiproc

BOUND = 30.0
EXAMPLES = {"plain": 24, "trainer": 10, "accelerate": 10}


@pytest.fixture(scope="module")
def saved(tiny_models, tmp_path_factory, pool2):
    root = str(tmp_path_factory.mktemp("damage"))
    pool2.run(scenario.save_all, tiny_models["qwen3"], root, timeout=300)
    return root


def check(kind: str, saved: str, model: str, pool2: RankPool, scratch: str, data: st.DataObject) -> None:
    original, other = scenario.checkpoints(saved, kind)
    name = data.draw(st.sampled_from(scenario.files(original)), label="file")
    mode = data.draw(st.sampled_from(scenario.MODES), label="mode")
    where = data.draw(st.floats(0.0, 0.999), label="where")
    directory = scenario.copy(original, os.path.join(scratch, os.path.basename(original)))
    changed = scenario.damage(directory, name, mode, where, other)
    outcomes = pool2.run(scenario.load_outcome, model, kind, directory, timeout=120)
    expected = (None if not changed else "IncompleteCheckpointError" if (name, mode) == (MARKER, "remove")
                else "DamagedCheckpointError")
    for rank, outcome in enumerate(outcomes):
        assert outcome["raised"] == expected, (rank, name, mode, outcome)
        assert outcome["seconds"] < BOUND, (rank, outcome)
        if expected == "DamagedCheckpointError" and (name, mode) == (MARKER, "replace"):
            # another save's marker: the files differ from it, the error names the first and counts the others
            assert outcome["file"] in scenario.files(original) and "other files differ" in outcome["message"], \
                (rank, outcome)
        elif expected == "DamagedCheckpointError":
            assert outcome["file"] == name and name in outcome["message"] and directory in outcome["message"], \
                (rank, outcome)
    assert len({o.get("message") for o in outcomes}) == 1, outcomes


@pytest.mark.parametrize("kind", scenario.PATHS)
def test_any_damaged_file_is_one_error_on_every_rank(kind, tiny_models, saved, pool2, tmp_path):
    @settings(max_examples=EXAMPLES[kind], deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(data=st.data())
    def run(data):
        check(kind, saved, tiny_models["qwen3"], pool2, str(tmp_path), data)

    run()
