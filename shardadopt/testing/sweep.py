"""The architecture sweep's check: the ordinary accelerate loop on a tiny model of one type, sharded at load time
with one layout, against one process on the same global batches. Two tasks: causal LMs train on token rows;
image-text-to-text models on samples of one real image and text each (``shardadopt/testing/vlm.py`` builds them).

Used by ``tools/arch_sweep.py`` (every type, every layout, recorded per transformers release), its CI sample
(``tests/project/test_arch_sweep.py``) and ``shardadopt doctor --model ... --check``. All types of one layout run in one
process group (:class:`~shardadopt.testing.pool.RankPool`); a type whose ranks raise apart or hang costs that
pool (restarted for the next type), never the sweep.

The two runs are in ``shardadopt/testing/sweep_run.py``; the verdicts and the tolerances they hold the runs to,
and why, in ``shardadopt/testing/sweep_compare.py``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from shardadopt.testing.archs import CAUSAL_LM
from shardadopt.testing.sweep_compare import FAILS, NOT_TESTABLE, Cell, compare, reorder_noise
from shardadopt.testing.sweep_run import SEED, RandomForward, check_rank, error_text, reference, sample_count

# layout -> (ranks, plan the type needs)
LAYOUTS: dict[str, tuple[int, str | None]] = {"fsdp": (2, None), "tp": (2, "tp"), "ep": (2, "ep"),
                                              "hsdp": (4, None), "2d": (4, "tp")}


def layout_sizes(layout: str) -> tuple[dict[str, Any], int] | str:
    """(DistributedConfig kwargs, data-parallel size) for ``layout`` on the installed transformers, or why it
    cannot be loaded there."""
    from shardadopt.testing.layouts import LayoutUnsupported, distributed_sizes, unloadable_reason

    try:
        sizes, dp = distributed_sizes(layout, LAYOUTS[layout][0])
    except LayoutUnsupported as exc:
        return str(exc)
    return unloadable_reason(sizes) or (sizes, dp)


def candidates(layout: str, task: str = CAUSAL_LM) -> list[str]:
    """The model types the sweep checks on ``layout`` for ``task``: every type (FSDP, HSDP) or those with the
    plan the layout shards by."""
    from shardadopt.testing.archs import causal_lm_types

    return causal_lm_types(LAYOUTS[layout][1], task)


def _cached(file: str, compute: Callable[..., Any], *args: Any) -> Any:
    import torch

    if os.path.exists(file):
        return torch.load(file)
    with torch.random.fork_rng():
        value = compute(*args)
    torch.save(value, file)
    return value


def sweep_layout(types: Iterable[str], layout: str, root: str | os.PathLike,
                 on_cell: Callable[[str, Cell], None], timeout: float = 300.0, log: str | None = None,
                 config_values: dict[str, Any] | None = None, pool: Any = None, task: str = CAUSAL_LM) -> None:
    """Check every type of ``types`` on ``layout`` in one process group; ``on_cell(type, cell)`` after each.

    Tiny checkpoints of ``task``'s class (shrunk from ``config_values``, a checkpoint's config, or each type's
    default config), their image-text samples and one-process references are made in this process and cached
    under ``root``. ``pool``: a
    :class:`~shardadopt.testing.pool.RankPool` of the layout's size to run on (default: one started here, and
    started again after a type whose ranks raised apart or hung).
    """
    from shardadopt.testing.archs import write_tiny
    from shardadopt.testing.pool import RankError, RankPool, RankTimeout
    from shardadopt.testing.vlm import write_batches

    types = list(types)
    sizes = layout_sizes(layout)
    if isinstance(sizes, str):
        for model_type in types:
            on_cell(model_type, Cell(NOT_TESTABLE, f"{layout}: {sizes}"))
        return
    sizes, dp = sizes
    nproc = LAYOUTS[layout][0]
    owned = pool is None
    try:
        for model_type in types:
            started = time.monotonic()
            try:
                path = write_tiny(model_type, root, values=config_values, task=task)
            except Exception as exc:
                on_cell(model_type, Cell(NOT_TESTABLE, f"no tiny config derives from the default config: "
                                                       f"{error_text(exc)}"))
                continue
            if task != CAUSAL_LM:
                try:
                    write_batches(path, model_type, sample_count(dp), SEED)
                except Exception as exc:
                    on_cell(model_type, Cell(NOT_TESTABLE, f"no image-text batch builds for the tiny model (its "
                                                           f"image processor and placeholder tokens): "
                                                           f"{error_text(exc)}"))
                    continue
            try:
                expected = _cached(os.path.join(path, f"reference-dp{dp}.pt"), reference, path, dp, 1, task)
            except RandomForward as exc:
                on_cell(model_type, Cell(NOT_TESTABLE, str(exc)))
                continue
            except Exception as exc:
                on_cell(model_type, Cell(NOT_TESTABLE, f"one process cannot train the tiny model here: "
                                                       f"{error_text(exc)}"))
                continue
            if pool is None:
                pool = RankPool(nproc, log=log)
            try:
                results = pool.run(check_rank, path, sizes, dp, task, timeout=timeout)
                cell = compare(results, expected)
                if cell.verdict == FAILS and cell.worst.get("grads", float("inf")) <= 1:
                    # only later steps differ: is that more than fp32 reordering moves this model?
                    noise = _cached(os.path.join(path, f"reorder-noise-dp{dp}.pt"), reorder_noise, path, dp, expected,
                                    task)
                    cell = compare(results, expected, noise)
            except (RankError, RankTimeout) as exc:  # ranks raised apart or hung: that pool is gone
                if not owned:
                    raise
                pool = None
                cell = Cell(FAILS, f"ranks raised apart or hung: {error_text(exc)}")
            cell.seconds = round(time.monotonic() - started, 1)
            on_cell(model_type, cell)
    finally:
        if owned and pool is not None:
            pool.close()
