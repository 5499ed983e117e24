"""The CUDA paths of shardadopt on the GPUs of one machine, one PASS/FAIL/SKIP line per item; exits 1 on any failure.

The prepared command for a session with GPUs (from a checkout; one GPU or several, about 5-8 minutes):

    PYTHONPATH=$PWD python benchmarks/gpu_check.py 2>&1 | tee gpu_check.txt     # --nproc: the GPUs present

    python benchmarks/gpu_check.py --nproc 2 --dry-run  # the same code paths on gloo/CPU (CI; CUDA-only items skip)
    python benchmarks/gpu_check.py --only fence-fault fence-hang   # some items; --list names them

Items (each with its own timeout; a failed item never stops the next):

- ``environment``: torch, transformers, the GPU, NCCL; the torch behaviours shardadopt works around, probed on
  this device (``shardadopt.upstream.torchprobe``: informational, the workarounds stay on either way).
- ``grouped-mm-sentinel``: ``benchmarks/gpu_grouped_mm_sentinel.py`` (F2 on the real CUDA grouped GEMM kernel).
- ``fused-adamw-mesh``: fused AdamW on CUDA parameters on two device meshes plus plain and strided ones, split by
  mesh (``shardadopt.split_param_groups_by_mesh``; strided shards made contiguous as Trainer's path does) against
  single-tensor AdamW on the same values.
- ``checkpoint-cuda-rng``: an FSDP2 model on the GPU whose batches and dropout draw on the CUDA RNG: save at step
  2 (``shardadopt.checkpoint``), load into fresh objects under another seed: steps 3-4 and the parameters must
  equal the uninterrupted run bit for bit, which needs the CUDA RNG state restored; ``full_state_dict`` gathers
  the CUDA shards to the CPU.
- ``hpo-gloo-beside-nccl``: ``shardadopt.hpo.optimize`` with pruning whose objective all-reduces CUDA tensors on
  the NCCL default group while control messages use their own gloo group; study equal to plain Optuna.
- ``fence-fault`` / ``fence-hang``: ``shardadopt.fence.fenced`` around a loop of all-reduces on ``--nproc``
  ranks (NCCL on cuda), the last rank raising / hanging at step 1: every rank must be out within the bound (30 s
  after the fault; ``2 * hang_timeout + 5`` s after the hang) with its own error or ``HangError`` on that rank and
  ``PeerFailedError`` on the others, and on NCCL every rank must have broken its group with
  ``ProcessGroup.abort()``.
- ``bf16-parity``: the examples' accelerate loop on a tiny llama in bf16, ``fsdp_size=--nproc``, against one process
  in bf16 on the same global batches: losses and grad norms within 2 %, every parameter element within 2 LR per
  step plus one bf16 ulp of its value.
- ``cp-ring-attention``: context parallelism through torch's ring attention with the CUDA SDPA kernels on an adopted
  model: the accelerate loop of docs/long-context.md (``maybe_context_parallel``, shifted labels, global position
  ids) on a tiny Llama loaded with ``fsdp_size=N`` and ``ParallelismConfig(cp_size=N)``, ``N = --nproc`` (NCCL, a
  GPU per rank; on one GPU 2 ranks share it over gloo, after the check that gloo collectives work on CUDA tensors),
  against one process on the whole sequence on the same device: fp32 with the memory-efficient kernel (losses and
  grad norms within 1e-4, parameters within LR / 2) and bf16 with the flash kernel (within 2 %), each kernel forced
  with ``sdpa_kernel``; every forward must see 1/N of the positions. The dry run checks fp32 with the CPU flash
  kernel (the patch ``torch-cp-cpu-flash-attention``).
- ``selftest``: every ``shardadopt selftest`` scenario on ``--nproc`` ranks (at least 2): NCCL with a GPU per
  rank (fsdp, tp, ep+fsdp; 2-D and the 4-rank layouts at 4), else the ranks share the GPU over gloo after the
  selftest checked that gloo collectives work on CUDA tensors on this torch (it refuses with the reason if not).

Items 3-5 run on one rank of a real process group (NCCL on cuda, gloo on cpu), the fence items on ``--nproc``
ranks of their own pool, the rest in subprocesses. This is
a script, not a selftest mode: the grouped-GEMM check and the torch probes look at kernels and torch itself, not at
a capability users turn on, and one file keeps the whole GPU session to one command.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # this checkout's shardadopt, also for the ranks (RankPool passes sys.path on)


# -- rank functions (run on the one rank of the pool; module level so the pool can pickle them) -----------------

def _device(device: str):
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")


def fused_adamw_rank(device: str, steps: int = 3) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from shardadopt import split_param_groups_by_mesh
    from shardadopt.parallel.optimizer_ready import make_shards_contiguous

    dev = _device(device)
    world = torch.distributed.get_world_size()
    meshes = {"fsdp": init_device_mesh(device, (world,), mesh_dim_names=("fsdp",)),
              "ep": init_device_mesh(device, (world,), mesh_dim_names=("ep",))}
    gen = torch.Generator().manual_seed(0)
    values = {name: torch.randn(shape, generator=gen) for name, shape in
              (("sharded", (8, 4)), ("replicated", (4,)), ("expert", (6, 4)), ("plain", (6,)), ("strided", (5, 6)))}
    model = torch.nn.Module()
    model.sharded = torch.nn.Parameter(distribute_tensor(values["sharded"].to(dev), meshes["fsdp"], [Shard(0)]))
    model.replicated = torch.nn.Parameter(distribute_tensor(values["replicated"].to(dev), meshes["fsdp"],
                                                            [Replicate()]))
    model.expert = torch.nn.Parameter(distribute_tensor(values["expert"].to(dev), meshes["ep"], [Shard(0)]))
    model.plain = torch.nn.Parameter(values["plain"].to(dev))
    wide = torch.cat([values["strided"], values["strided"]], dim=1).to(dev)
    model.strided = torch.nn.Parameter(wide[:, 6:])  # a column shard left as a view (transformers 5.15 TP)
    compacted = make_shards_contiguous(model)
    optimizer = split_param_groups_by_mesh(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    references = {name: torch.nn.Parameter(value.to(dev)) for name, value in values.items()}
    reference_opt = torch.optim.AdamW(references.values(), lr=1e-2, foreach=False)
    for step in range(steps):
        for name, param in model.named_parameters():
            grad = (references[name].detach() * (step + 2)).sin()
            references[name].grad = grad.clone()
            param.grad = distribute_tensor(grad, param.device_mesh, param.placements) if isinstance(
                param, DTensor) else grad.clone()
        optimizer.step()
        reference_opt.step()
    bad = []
    for name, param in model.named_parameters():
        got = (param.full_tensor() if isinstance(param, DTensor) else param).detach()
        if got.device != dev or not torch.allclose(got, references[name].detach(), rtol=1e-5, atol=1e-6):
            diff = (got.cpu() - references[name].detach().cpu()).abs().max()
            bad.append(f"{name} on {got.device}: max |diff| {diff:.2e}")
    return {"problem": f"fused AdamW differs from single-tensor AdamW: {bad}" if bad else None,
            "detail": f"fused AdamW split by mesh on {dev}, {steps} steps, strided shards compacted: {compacted}"}


def checkpoint_rank(device: str, root: str) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardadopt import checkpoint
    from shardadopt.testing import full

    dev = _device(device)

    def build():
        torch.manual_seed(0)  # the same initial weights every time; what follows comes from the checkpoint
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Dropout(0.2),
                                    torch.nn.Linear(32, 16)).to(dev)
        mesh = init_device_mesh(device, (torch.distributed.get_world_size(),))
        for layer in (model[0], model[3], model):
            fully_shard(layer, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, **({"fused": True} if device == "cuda" else {}))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
        return model, optimizer, scheduler

    def train(model, optimizer, scheduler, steps: int) -> list[float]:
        losses = []
        for _ in range(steps):
            batch = torch.randn(8, 16, device=dev)  # on the device's RNG, as is the dropout mask
            loss = model(batch).pow(2).mean()
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    model, optimizer, scheduler = build()
    torch.manual_seed(1)
    train(model, optimizer, scheduler, 2)
    directory = checkpoint.save(os.path.join(root, "step-2"), model, optimizer, scheduler, step=2)
    expected = train(model, optimizer, scheduler, 2)
    expected_params = {n: full(p).detach().cpu() for n, p in model.named_parameters()}
    gathered = checkpoint.full_state_dict(model)

    fresh = build()
    torch.manual_seed(12345)  # another seed: the continuation must come from the checkpoint's RNG states
    info = checkpoint.load(directory, *fresh)
    resumed = train(*fresh, 2)
    params = {n: full(p).detach().cpu() for n, p in fresh[0].named_parameters()}
    rng_file = torch.load(os.path.join(directory, f"rng_state_{torch.distributed.get_rank()}.pt"),
                          weights_only=False)
    problems = []
    if device == "cuda" and "cuda" not in rng_file:
        problems.append("the checkpoint holds no CUDA RNG state")
    if not info.rng_restored:
        problems.append("load did not restore the RNG states")
    if resumed != expected:
        problems.append(f"resumed losses {resumed} != uninterrupted {expected}")
    differ = [n for n, p in expected_params.items() if not torch.equal(params[n], p)]
    if differ:
        problems.append(f"parameters differ after resuming: {differ}")
    cpu = all(t.device.type == "cpu" for t in gathered.values())
    if not cpu or set(gathered) != set(fresh[0].state_dict()):
        devices = sorted({str(t.device) for t in gathered.values()})
        problems.append(f"full_state_dict gave {sorted(gathered)} on {devices}")
    return {"problem": "; ".join(problems) or None,
            "detail": f"FSDP2 on {dev}: save at step 2, resume under another seed: steps 3-4 and params exact, "
                      f"RNG saved: {sorted(k for k in rng_file if k in ('cpu', 'cuda'))}"}


def hpo_rank(device: str) -> dict[str, Any]:
    import torch.distributed as dist

    from shardadopt.hpo import channel
    from shardadopt.selftest.hpo import hpo_rank as run
    from shardadopt.selftest.scenario import Context

    result = run(Context(models={}, nproc=dist.get_world_size(), device=device))
    return {"result": result, "default": dist.get_backend(),
            # the control group is a gloo backend outside torch's registry (dist.get_backend does not know it)
            "control": sorted({group.name() for group in channel.control_groups()})}


FENCE_HANG_TIMEOUT = 5.0  # seconds without progress that make a hang; the bound is 2 * this + 5 s
FENCE_STEPS = 4


def fence_rank(device: str, fault: str) -> dict[str, Any]:
    """A fenced training loop of all-reduces where the last rank raises (``fault="raise"``) or hangs
    (``fault="hang"``) at step 1: when each rank got out, what it raised, and how many groups it aborted."""
    import torch
    import torch.distributed as dist

    from shardadopt.fence import fenced

    rank, world = dist.get_rank(), dist.get_world_size()
    aborted = []
    original_abort = dist.ProcessGroup.abort

    def counted_abort(group, *args, **kwargs):  # the fence's NCCL break: ProcessGroup.abort()
        aborted.append(dist.get_backend(group))
        return original_abort(group, *args, **kwargs)

    dist.ProcessGroup.abort = counted_abort
    faulty = rank == world - 1
    started = time.time()
    fault_at = raised = None
    try:
        with fenced(f"gpu-check {fault}", hang_timeout=FENCE_HANG_TIMEOUT):
            for step in range(FENCE_STEPS):
                if faulty and step == 1:
                    fault_at = time.time()
                    if fault == "raise":
                        raise RuntimeError("injected fault mid-step")
                    time.sleep(10**6)  # a rank that stops making progress; the fence interrupts it
                torch.nn.Linear(4, 4)(torch.ones(1, 4))  # progress (a forward call), then the step's collective
                value = torch.ones(1024, device=_device(device)) * (rank + 1)
                dist.all_reduce(value)
                total = value[0].item()  # waits for it: NCCL's all_reduce only enqueues
                if total != world * (world + 1) / 2:
                    raise RuntimeError(f"all_reduce gave {total}, expected {world * (world + 1) / 2}")
    except BaseException as exc:  # noqa: BLE001  (HangError and the peers' PeerFailedError are what we look for)
        raised = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]}"
    finally:
        dist.ProcessGroup.abort = original_abort
    return {"rank": rank, "out": time.time(), "started": started, "fault_at": fault_at, "raised": raised,
            "aborted": aborted, "backend": dist.get_backend()}


BF16_RTOL = 2e-2  # losses and grad norms: a few bf16 ulps (2^-8) of reduction-order difference
# Parameters, element by element: Adam moves an element by at most about LR per step, and a gradient element that
# nearly cancels can change sign with bf16 reduction order (seen on CPU: 1.7 LR after 5 steps), so no per-element
# tolerance below 2 * LR * steps is safe; plus one bf16 ulp (2^-7) of the value. A systematic error shows in the
# losses and grad norms, which must agree within BF16_RTOL.
BF16_PARAM_STEPS_OF_LR = 2.0
BF16_PARAM_RTOL = 2.0**-7


def bf16_rank(path: str, device: str) -> dict[str, Any]:
    import torch.distributed as dist

    from shardadopt.selftest.accelerate import train_rank

    world = dist.get_world_size()
    return train_rank(path, {"fsdp_size": world}, world, cpu=device == "cpu", dtype="bfloat16")


CP_SEQ, CP_STEPS, CP_LR, CP_MAX_NORM = 64, 3, 1e-3, 1e9
# (model dtype, the SDPA kernel forced on CUDA, rtol of losses and grad norms against one process). On CPU the flash
# kernel is the only one ring attention runs (the patch adds it), whatever the dtype.
CP_CASES = (("float32", "EFFICIENT_ATTENTION", 1e-4), ("bfloat16", "FLASH_ATTENTION", 2e-2))


def cp_train(path: str, device: str, dtype: str, kernel: str) -> dict[str, Any]:
    """The accelerate loop of docs/long-context.md, ``CP_STEPS`` steps on one sequence of ``CP_SEQ`` tokens per step
    (the same on every rank): inside a process group, on a model loaded with ``fsdp_size`` = the world and
    ``ParallelismConfig(cp_size=world)``; outside one, one process on the whole sequence. The SDPA ``kernel`` is
    forced on CUDA. Losses, grad norms, the positions each forward saw, the parameters after training (rank 0)."""
    import contextlib

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from accelerate import ParallelismConfig
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import AutoModelForCausalLM

    import shardadopt
    from shardadopt.testing import full
    from shardadopt.testing.accelerator import fresh_accelerator

    dev = _device(device)
    sharded = dist.is_available() and dist.is_initialized()
    cp = dist.get_world_size() if sharded else 1
    shardadopt.enable()
    try:
        torch.manual_seed(0)
        kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype), "attn_implementation": "sdpa"}
        if sharded:
            from transformers.distributed import DistributedConfig

            kwargs["distributed_config"] = DistributedConfig(fsdp_size=cp)
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        optimizer = torch.optim.AdamW(model.parameters(), lr=CP_LR, weight_decay=0.0, foreach=False)
        accelerator = None
        if sharded:
            accelerator = fresh_accelerator(cpu=device == "cpu", parallelism_config=ParallelismConfig(cp_size=cp))
            model, optimizer = accelerator.prepare(model, optimizer)
        else:
            model = model.to(dev)
        seen: list[int] = []
        model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True)
        generator = torch.Generator().manual_seed(7)
        vocab = model.config.vocab_size
        def forced():  # a fresh context each step (sdpa_kernel's is single-use)
            return sdpa_kernel(getattr(SDPBackend, kernel)) if device == "cuda" else contextlib.nullcontext()

        losses, norms = [], []
        for _ in range(CP_STEPS):
            input_ids = torch.randint(0, vocab, (1, CP_SEQ), generator=generator).to(dev)
            labels = input_ids.clone()
            shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
            position_ids = torch.arange(CP_SEQ, device=dev).unsqueeze(0)
            buffers = [input_ids, labels, shift_labels, position_ids]
            split = (accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1, 1, 1],
                                                        no_restore_buffers=set(buffers))
                     if sharded else contextlib.nullcontext())
            with forced(), split:
                loss = model(input_ids=input_ids, labels=labels, shift_labels=shift_labels,
                             position_ids=position_ids).loss
                (accelerator.backward(loss) if sharded else loss.backward())
            if sharded:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), CP_MAX_NORM)))
                losses.append(float(accelerator.reduce(loss.detach().float(), "mean")))
            else:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CP_MAX_NORM)))
                losses.append(float(loss.detach()))
            optimizer.step()
            optimizer.zero_grad()
        params = {n: full(p).detach().float().cpu() for n, p in model.named_parameters()}
        return {"losses": losses, "norms": norms, "seen": seen,
                "params": params if not sharded or dist.get_rank() == 0 else None}
    except Exception as exc:  # noqa: BLE001  (reported as the item's failure)
        return {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"}
    finally:
        shardadopt.disable()


# -- items (run in the launcher) -----------------------------------------------------------------------------------

@dataclass
class Item:
    name: str
    run: Callable[[argparse.Namespace, dict[str, Any]], tuple[str, str]]  # -> (PASS/FAIL/SKIP, detail)


def _pool(args: argparse.Namespace, state: dict[str, Any]):
    from shardadopt.testing import RankPool

    if state.get("pool") is None:
        state["pool"] = RankPool(1, device=args.device, env={"HF_HUB_DISABLE_PROGRESS_BARS": "1"})
    return state["pool"]


def _fence_case(args: argparse.Namespace, state: dict[str, Any], fault: str) -> tuple[str, str]:
    """``fence_rank`` on ``--nproc`` ranks of their own pool (the fence breaks its groups, so it is closed after)."""
    from shardadopt.testing import RankPool

    if args.nproc < 2:
        return "SKIP", "a fence needs 2 ranks or more (--nproc)"
    with RankPool(args.nproc, device=args.device) as pool:
        results = pool.run(fence_rank, args.device, fault, timeout=_seconds(args, state))
    fault_at = results[-1]["fault_at"]
    bound = 30.0 if fault == "raise" else 2 * FENCE_HANG_TIMEOUT + 5 + 5  # + 5 s: a loaded machine's slack
    late = [r["rank"] for r in results if r["out"] - fault_at > bound]
    expected = {"raise": ("RuntimeError", "PeerFailedError"), "hang": ("HangError", "PeerFailedError")}[fault]
    wrong = [r["rank"] for r in results
             if not (r["raised"] or "").startswith(expected[0] if r["rank"] == args.nproc - 1 else expected[1])]
    nccl = results[0]["backend"] == "nccl"
    unaborted = [r["rank"] for r in results if nccl and "nccl" not in r["aborted"]]
    problems = []
    if late:
        problems.append(f"rank(s) {late} out later than {bound:.0f}s after the {fault}")
    if wrong:
        problems.append("unexpected errors: " + "; ".join(f"rank {r['rank']}: {r['raised']}" for r in results))
    if unaborted:
        problems.append(f"rank(s) {unaborted} never called ProcessGroup.abort() on an NCCL group")
    slowest = max(r["out"] for r in results) - fault_at
    detail = (f"last of {args.nproc} ranks out {slowest:.1f}s after the {fault} (bound {bound:.0f}s) on "
              f"{results[0]['backend']}; ProcessGroup.abort() calls per rank: {[len(r['aborted']) for r in results]}; "
              f"rank {args.nproc - 1}: {results[-1]['raised']}; rank 0: {results[0]['raised']}")
    return ("FAIL", "; ".join(problems) + "\n" + detail) if problems else ("PASS", detail)


def bf16_parity(args: argparse.Namespace, state: dict[str, Any]) -> tuple[str, str]:
    """The examples' accelerate loop on a bf16 model sharded fsdp_size=N against one process in bf16."""
    import torch

    from shardadopt.selftest.accelerate import LR, STEPS, train_reference, whole_tensor
    from shardadopt.testing import RankPool, tiny_checkpoints

    if args.nproc < 2:
        return "SKIP", "parity needs 2 ranks or more (--nproc)"
    with tempfile.TemporaryDirectory(prefix="shardadopt-gpu-check-") as root:
        path = tiny_checkpoints(root)["llama"]
        expected = train_reference(path, args.nproc, dtype="bfloat16")
        with RankPool(args.nproc, device=args.device, env={"HF_HUB_DISABLE_PROGRESS_BARS": "1"}) as pool:
            result = pool.run(bf16_rank, path, args.device, timeout=_seconds(args, state))[0]
    if "error" in result:
        return "FAIL", f"the accelerate loop failed: {result['error']}"
    problems = [f"per-step {what} {result[what]} != one process {expected[what]}" for what in ("losses", "norms")
                if not torch.allclose(torch.tensor(result[what]), torch.tensor(expected[what]), rtol=BF16_RTOL)]
    worst = 0.0  # the largest parameter difference as a fraction of its tolerance
    for name, want in expected["params"].items():
        got = whole_tensor([r[name] for r in result["params"]], want.shape).float()
        bound = BF16_PARAM_STEPS_OF_LR * LR * STEPS + BF16_PARAM_RTOL * want.float().abs()
        worst = max(worst, float(((got - want.float()).abs() / bound).max()) if got.shape == want.shape else 1e9)
    if worst > 1:
        problems.append(f"parameters differ from one process by up to {worst:.1f}x the bf16 tolerance")
    detail = (f"llama bf16, fsdp_size={args.nproc} on {args.device}: losses {[f'{x:.4f}' for x in result['losses']]}"
              f" vs one process {[f'{x:.4f}' for x in expected['losses']]}, params within {worst:.2f}x the bf16 "
              f"tolerance ({BF16_PARAM_STEPS_OF_LR:g} LR per step + {BF16_PARAM_RTOL:g} |p|)")
    return ("FAIL", "; ".join(problems) + "\n" + detail) if problems else ("PASS", detail)


def cp_ring_attention(args: argparse.Namespace, state: dict[str, Any]) -> tuple[str, str]:
    """Ring attention with the device's SDPA kernels on an adopted model (fsdp_size = cp_size = N) against one
    process on the whole sequence, per dtype (``CP_CASES``)."""
    import torch

    from shardadopt.testing import RankPool, tiny_checkpoints

    nproc, backend, shared = args.nproc, None, ""
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        from shardadopt.selftest.device_check import gloo_collectives_problem

        problem = gloo_collectives_problem("cuda", timeout=_seconds(args, state))
        if problem:
            return "SKIP", f"one GPU, and gloo cannot carry CUDA tensors here for ranks sharing it: {problem}"
        nproc, backend, shared = 2, "gloo", " (2 ranks sharing one GPU over gloo)"
    if nproc < 2:
        return "SKIP", "context parallelism needs 2 ranks or more (--nproc)"
    if CP_SEQ % (2 * nproc):
        return "SKIP", f"the check's {CP_SEQ} tokens do not split into 2 x {nproc} chunks"
    problems, details = [], []
    with tempfile.TemporaryDirectory(prefix="shardadopt-gpu-check-") as root:
        path = tiny_checkpoints(root, ["llama"])["llama"]
        with RankPool(nproc, device=args.device, backend=backend,
                      env={"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}) as pool:
            # on CPU both dtypes run the one flash kernel through the same ring code: fp32 alone says it all
            for dtype, kernel, rtol in CP_CASES if args.device == "cuda" else CP_CASES[:1]:
                kernel_name = kernel.lower() if args.device == "cuda" else "cpu flash"
                expected = cp_train(path, args.device, dtype, kernel)
                results = pool.run(cp_train, path, args.device, dtype, kernel, timeout=_seconds(args, state))
                errors = [r["error"] for r in (expected, *results) if "error" in r]
                if errors:
                    problems.append(f"{dtype} ({kernel_name}): {errors[0]}")
                    continue
                got = results[0]
                if any(r["seen"] != [CP_SEQ // nproc] * CP_STEPS for r in results):
                    problems.append(f"{dtype}: the forwards saw {[r['seen'] for r in results]} positions, not "
                                    f"{CP_SEQ // nproc} each")
                for what in ("losses", "norms"):
                    if not torch.allclose(torch.tensor(got[what]), torch.tensor(expected[what]), rtol=rtol):
                        problems.append(f"{dtype} ({kernel_name}): per-step {what} {got[what]} != one process "
                                        f"{expected[what]}")
                worst = max(float((got["params"][n] - p).abs().max()) for n, p in expected["params"].items())
                if dtype == "float32" and worst >= 0.5 * CP_LR:
                    problems.append(f"float32: parameters differ from one process by up to {worst:.2e} (>= LR / 2)")
                details.append(f"{dtype} {kernel_name}: losses {[f'{x:.4f}' for x in got['losses']]} vs one process "
                               f"{[f'{x:.4f}' for x in expected['losses']]}, params within {worst:.1e}")
    detail = (f"llama fsdp_size={nproc} x cp_size={nproc} on {args.device}{shared}, {CP_SEQ} tokens "
              f"({CP_SEQ // nproc} per forward), {CP_STEPS} steps:\n" + "\n".join(details))
    return ("FAIL", "; ".join(problems) + "\n" + detail) if problems else ("PASS", detail)


def fence_fault(args: argparse.Namespace, state: dict[str, Any]) -> tuple[str, str]:
    return _fence_case(args, state, "raise")


def fence_hang(args: argparse.Namespace, state: dict[str, Any]) -> tuple[str, str]:
    return _fence_case(args, state, "hang")


def _seconds(args: argparse.Namespace, state: dict[str, Any]) -> float:
    """This item's timeout: ``--timeout``, cut to what is left of ``--budget``."""
    return max(min(args.timeout, state["deadline"] - time.monotonic()), 1.0)


def _on_rank(args: argparse.Namespace, state: dict[str, Any], fn, *fn_args) -> Any:
    from shardadopt.testing import RankError, RankTimeout

    try:
        return _pool(args, state).run(fn, *fn_args, timeout=_seconds(args, state))[0]
    except (RankError, RankTimeout):
        state["pool"] = None  # the pool shut itself down; the next item starts a fresh one
        raise


def environment(args: argparse.Namespace, state: dict[str, Any]) -> tuple[str, str]:
    import torch
    import torch.distributed as dist
    import transformers

    from shardadopt.upstream import torchprobe

    parts = [f"torch {torch.__version__}", f"transformers {transformers.__version__}"]
    if args.device == "cuda":
        if not torch.cuda.is_available():
            return "FAIL", "no CUDA device (run with --device cpu for the dry run)"
        nccl = dist.is_nccl_available()
        nccl_version = ".".join(map(str, torch.cuda.nccl.version())) if nccl else "no"
        parts += [f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()} "
                  f"(sm{''.join(map(str, torch.cuda.get_device_capability()))})",
                  f"CUDA {torch.version.cuda}", f"NCCL {nccl_version}"]
        if not nccl:
            return "FAIL", ", ".join(parts)
    devices = ("cpu", "cuda") if args.device == "cuda" else ("cpu",)
    probes = [f"{row['name']}: {'fixed' if row['fixed'] else 'still there'}"
              + (f" (the probed call raised {row['reason']}; the workaround stays on)" if row["reason"] else "")
              for row in torchprobe.report(devices)]
    return "PASS", ", ".join(parts) + "\n" + "\n".join(probes)


def grouped_mm_sentinel(args: argparse.Namespace, state: dict[str, Any]) -> tuple[str, str]:
    if args.device != "cuda":
        return "SKIP", "the real grouped GEMM kernel needs CUDA"
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_grouped_mm_sentinel.py"),
                          "--steps", "3"], capture_output=True, text=True, timeout=_seconds(args, state), env=_env())
    return ("PASS" if out.returncode == 0 else "FAIL"), (out.stdout + out.stderr).strip()


def fused_adamw_mesh(args: argparse.Namespace, state: dict[str, Any]) -> tuple[str, str]:
    result = _on_rank(args, state, fused_adamw_rank, args.device)
    return ("FAIL", result["problem"]) if result["problem"] else ("PASS", result["detail"])


def checkpoint_cuda_rng(args: argparse.Namespace, state: dict[str, Any]) -> tuple[str, str]:
    with tempfile.TemporaryDirectory(prefix="shardadopt-gpu-check-") as root:
        result = _on_rank(args, state, checkpoint_rank, args.device, root)
    return ("FAIL", result["problem"]) if result["problem"] else ("PASS", result["detail"])


def hpo_gloo_beside_nccl(args: argparse.Namespace, state: dict[str, Any]) -> tuple[str, str]:
    from shardadopt.selftest.hpo import compare_studies, hpo_reference
    from shardadopt.selftest.scenario import Context

    result = _on_rank(args, state, hpo_rank, args.device)
    expected_default = "nccl" if args.device == "cuda" else "gloo"
    problem = compare_studies(result["result"], hpo_reference(Context(models={}, nproc=1, device=args.device)))
    if result["default"] != expected_default or result["control"] != ["gloo"]:
        problem = f"default group {result['default']!r}, control group(s) {result['control']}"
    detail = f"training collectives on {result['default']}, control on {'+'.join(result['control'])}: study as Optuna"
    return ("FAIL", problem) if problem else ("PASS", detail)


def selftest_ranks(args: argparse.Namespace, state: dict[str, Any]) -> tuple[str, str]:
    import torch

    left = max(state["deadline"] - time.monotonic(), 1.0)
    nproc = max(args.nproc, 2)
    command = [sys.executable, "-m", "shardadopt", "selftest", "--nproc", str(nproc), "--device", args.device,
               "--timeout", f"{min(args.timeout, left):.0f}", *(["--only", *args.scenarios] if args.scenarios else [])]
    if args.device == "cuda" and torch.cuda.device_count() < nproc:
        command += ["--backend", "gloo"]  # ranks share the GPU; the selftest checks first that gloo can
    out = subprocess.run(command, capture_output=True, text=True, timeout=left, env=_env())
    status = "PASS" if out.returncode == 0 else "FAIL"
    return status, " ".join(command[1:]) + "\n" + (out.stdout + out.stderr).strip()


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}


ITEMS = [Item("environment", environment), Item("grouped-mm-sentinel", grouped_mm_sentinel),
         Item("fused-adamw-mesh", fused_adamw_mesh), Item("checkpoint-cuda-rng", checkpoint_cuda_rng),
         Item("hpo-gloo-beside-nccl", hpo_gloo_beside_nccl), Item("fence-fault", fence_fault),
         Item("fence-hang", fence_hang), Item("bf16-parity", bf16_parity), Item("cp-ring-attention", cp_ring_attention),
         Item("selftest", selftest_ranks)]


def _row(status: str, name: str, seconds: float, detail: str) -> str:
    first, *rest = detail.strip().splitlines() or [""]
    return "\n".join([f"{status:<4}  {name:<22} {seconds:6.1f}s  {first}", *("      " + line for line in rest)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--dry-run", action="store_true", help="the same code paths on CPU/gloo (--device cpu)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks for the multi-rank items (default: the GPUs present, 2 on cpu)")
    parser.add_argument("--only", nargs="+", metavar="ITEM", help="run only these items")
    parser.add_argument("--timeout", type=float, default=150.0,
                        help="seconds per item (per scenario in the selftest item; default 150)")
    parser.add_argument("--budget", type=float, default=450.0,
                        help="seconds for all items together; items past it fail as out of time (default 450)")
    parser.add_argument("--scenarios", nargs="+", metavar="SCENARIO",
                        help="the selftest item runs only these scenarios (default: all)")
    parser.add_argument("--list", action="store_true", help="print the item names and exit")
    args = parser.parse_args(argv)
    names = [item.name for item in ITEMS]
    if args.list:
        print("\n".join(names))
        return 0
    unknown = sorted(set(args.only or ()) - set(names))
    if unknown:
        parser.error(f"unknown item(s) {unknown}; known: {names}")
    if args.dry_run:
        args.device = "cpu"
    if args.nproc is None:
        import torch

        args.nproc = max(torch.cuda.device_count(), 1) if args.device == "cuda" else 2
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    state: dict[str, Any] = {"deadline": time.monotonic() + args.budget}
    counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
    start_all = time.monotonic()
    try:
        for item in ITEMS:
            if args.only and item.name not in args.only:
                continue
            start = time.monotonic()
            try:
                if start > state["deadline"] - 5:
                    raise subprocess.TimeoutExpired(item.name, 0)
                status, detail = item.run(args, state)
            except subprocess.TimeoutExpired as exc:
                status, detail = "FAIL", (f"no answer within {exc.timeout:.0f}s" if exc.timeout else
                                          f"out of time: --budget {args.budget:.0f}s spent before this item")
            except Exception:
                status, detail = "FAIL", traceback.format_exc()
            counts[status] += 1
            print(_row(status, item.name, time.monotonic() - start, detail), flush=True)
    finally:
        if state.get("pool") is not None:
            state["pool"].close()
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped "
          f"in {time.monotonic() - start_all:.0f}s ({args.device})")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
