"""The ``shardadopt`` command: ``doctor``, ``selftest`` and ``hpo``."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from typing import Any


def doctor(as_json: bool = False) -> int:
    """Print versions, backends and each patch's state for this installation; non-zero when something is broken.

    Broken means: a dependency missing or outside the supported range, an upstream module that fails to import,
    a patch that is ``unsupported``, or an optional integration (peft, trl) installed below its minimum or failing
    to import. An optional package that is not installed is not an error. A release newer than the tested range is
    not an error either: one line says so and names the patches that could not decide.
    """
    import shardadopt
    from shardadopt.patches import process_registry
    from shardadopt.patching import states
    from shardadopt.upstream import versions
    from shardadopt.upstream.versions import installed_version

    rows = versions.report()
    integrations = versions.integrations()
    backends = _backends()
    behaviour = _torch_behaviour(backends)
    process_registry().enable()  # not shardadopt.enable(): its untested-release warning is printed below
    import_errors = {}
    try:
        absent = {name for name in versions.OPTIONAL if installed_version(name) is None}  # e.g. no peft: pending
        for module in sorted({m for p in process_registry().patches() for m in p.modules
                              if m.split(".")[0] not in absent}):
            try:
                importlib.import_module(module)  # lets every patch's probe look at the real upstream
            except Exception as exc:
                import_errors[module] = f"{type(exc).__name__}: {exc}"
        statuses = shardadopt.status()
        patches = [s.as_dict() for s in statuses]
    finally:
        shardadopt.disable()
    broken = (any(not r["ok"] for r in rows + integrations) or bool(import_errors)
              or any(s.state == "unsupported" and not states.integration_absent(s) for s in statuses))
    untested = states.untested_summary(statuses)
    if as_json:
        print(json.dumps({"shardadopt": shardadopt.__version__, "versions": rows, "integrations": integrations,
                          "untested": untested, "backends": backends,
                          "torch_behaviour": behaviour, "import_errors": import_errors, "patches": patches,
                          "ok": not broken}, indent=2))
        return 1 if broken else 0
    print(f"shardadopt {shardadopt.__version__}")
    for row in rows:
        mark = "ok " if row["ok"] else "BAD"
        tested = f" (tested up to {row['tested']})" if row["tested"] else ""
        print(f"  {mark} {row['name']:<13} {row['installed'] or 'not installed':<16} supported {row['supported']}"
              f"{tested}")
    print("optional integrations:")
    for row in integrations:
        mark = "BAD" if not row["ok"] else "ok "
        state = f"{row['state']}: {row['reason']}" if row["reason"] else row["state"]
        print(f"  {mark} {row['name']:<13} {row['installed'] or 'not installed':<16} supported {row['supported']:<16} "
              f"{state}")
    print("backends: " + ", ".join(f"{name}={'yes' if ok else 'no'}" for name, ok in backends.items()))
    if behaviour:
        print("torch behaviour (workarounds stay on either way):")
    for row in behaviour:
        state = "fixed in this torch" if row["fixed"] else "still there" if not row["reason"] else "probe failed"
        print(f"  {row['name']:<42} {state:<20} {row['workaround']}")
        if row["reason"]:
            print(f"  {'':<42} {'':<20} (the probed call raised {row['reason']}; the workaround stays on)")
    for module, error in import_errors.items():
        print(f"  BAD import {module}: {error}")
    print(f"patches ({len(patches)}):")
    for p in patches:
        print(f"  {p['id']:<32} {p['state']:<12} {p['reason']}")
    if not patches:
        print("  (none registered)")
    if untested:
        print(untested)
    print("status: " + ("BROKEN: see the BAD/unsupported lines above" if broken else "ok"))
    return 1 if broken else 0


def _backends() -> dict[str, bool]:
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return {"torch.distributed": False}
    return {"gloo": dist.is_available() and dist.is_gloo_available(),
            "nccl": dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available(),
            "cuda": torch.cuda.is_available()}


def _torch_behaviour(backends: dict[str, bool]) -> list[dict[str, Any]]:
    if not backends.get("gloo"):  # torch itself is missing (or has no torch.distributed): nothing to probe
        return []
    from shardadopt.upstream import torchprobe

    return torchprobe.report(("cpu", "cuda") if backends.get("cuda") else ("cpu",))


def selftest(nproc: int, device: str, only: Sequence[str] | None, timeout: float, backend: str | None = None) -> int:
    from shardadopt.selftest import run_selftest
    from shardadopt.testing.pool import default_backend

    backend = backend or default_backend(device)
    if device == "cpu" and backend != "gloo":
        print(f"selftest --device cpu runs on gloo, not {backend}", file=sys.stderr)
        return 2
    if device == "cuda":
        import torch

        found = torch.cuda.device_count()
        if found == 0:
            print("selftest --device cuda: no CUDA device here; pass --device cpu", file=sys.stderr)
            return 2
        if backend == "nccl" and found < nproc:  # NCCL refuses two ranks on one GPU
            print(f"selftest --device cuda needs {nproc} GPUs on nccl, found {found}; pass --nproc {found}, "
                  f"--backend gloo (ranks share the GPUs) or --device cpu", file=sys.stderr)
            return 2
        if backend == "gloo":
            backend = _gloo_on_cuda_or_alternative(nproc, found)
            if backend is None:
                return 2
    print(f"shardadopt selftest: {nproc} ranks on {device} ({backend})")
    outcomes = run_selftest(nproc=nproc, device=device, only=only, timeout=timeout, backend=backend)
    failed = sum(not o.ok for o in outcomes)
    skipped = sum(o.skipped for o in outcomes)
    print(f"{len(outcomes) - failed - skipped} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


def _gloo_on_cuda_or_alternative(nproc: int, gpus: int) -> str | None:
    """``"gloo"`` when gloo's collectives work on CUDA tensors here (asked of two subprocesses), else ``"nccl"``
    when there is a GPU per rank, else None after saying why and what to do."""
    import torch

    from shardadopt.selftest.device_check import gloo_collectives_problem

    problem = gloo_collectives_problem("cuda", nproc)
    if problem is None:
        return "gloo"
    why = (f"gloo collectives on CUDA tensors do not work with torch {torch.__version__} here "
           f"(distribute_tensor(...).full_tensor() on {nproc} ranks):\n{problem}")
    if gpus >= nproc:
        print(f"{why}\nrunning the scenarios on nccl instead ({gpus} GPUs for {nproc} ranks)", file=sys.stderr)
        return "nccl"
    print(f"selftest --device cuda --backend gloo refused: {why}\nrun --backend nccl --nproc {gpus} (one rank per "
          f"GPU), --device cpu, or a supported torch release (see `shardadopt doctor`)", file=sys.stderr)
    return None


def _parser() -> argparse.ArgumentParser:
    import shardadopt

    parser = argparse.ArgumentParser(prog="shardadopt", description=__doc__)
    parser.add_argument("--version", action="version", version=f"shardadopt {shardadopt.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    doc = sub.add_parser("doctor", help="versions, backends and the state of every patch")
    doc.add_argument("--json", action="store_true", help="machine-readable output")
    doc.add_argument("--model", metavar="PATH_OR_TYPE",
                     help="what the architecture matrix knows about this checkpoint or model type, and the patches "
                          "acting on its layout")
    doc.add_argument("--layout", metavar="SIZES", help="with --model: e.g. fsdp=2, tp=2, ep=2,fsdp=2, fsdp=2,tp=2 "
                                                       "(default: every layout)")
    doc.add_argument("--check", action="store_true",
                     help="with --model: run the sweep's check here, on a tiny model of the same config")
    test = sub.add_parser("selftest", help="run every capability on worker processes against one process")
    test.add_argument("--nproc", type=int, default=2, help="number of ranks (default 2)")
    test.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    test.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                      help="process group backend (default: gloo on cpu, nccl on cuda; gloo on cuda lets ranks share "
                           "a GPU)")
    test.add_argument("--only", nargs="+", metavar="SCENARIO", help="run only these scenarios")
    test.add_argument("--timeout", type=float, default=300.0, help="seconds per scenario before it fails")
    from shardadopt.hpo.report import add_commands

    add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "doctor" and args.model:
        from shardadopt.commands.coverage import LayoutError, parse_layout, report

        try:
            return report(args.model, parse_layout(args.layout) if args.layout else None, check=args.check)
        except (LayoutError, FileNotFoundError) as exc:
            print(f"shardadopt doctor: {exc}", file=sys.stderr)
            return 2
    if args.command == "doctor":
        if args.layout or args.check:
            print("shardadopt doctor: --layout and --check need --model", file=sys.stderr)
            return 2
        return doctor(as_json=args.json)
    if args.command == "hpo":
        from shardadopt.hpo.report import run
        from shardadopt.hpo.storage import StorageError

        try:
            return run(args)
        except (StorageError, ValueError, ImportError) as exc:  # ImportError: an optional extra is missing
            print(f"shardadopt hpo: {exc}", file=sys.stderr)
            return 2
    try:
        return selftest(args.nproc, args.device, args.only, args.timeout, args.backend)
    except ValueError as exc:
        print(f"shardadopt selftest: {exc}", file=sys.stderr)
        return 2


def entry(argv: Any = None) -> None:
    """The ``shardadopt`` console script: :func:`main`, its return value the exit status."""
    sys.exit(main(argv))


if __name__ == "__main__":
    entry()
