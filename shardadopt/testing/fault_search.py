"""A search in ``shardadopt.hpo.optimize`` whose DDP training fails on one rank at a chosen point.

The objective trains a small model with DDP on the default gloo group (gradients all-reduced in backward, the loss
all-reduced after each step); one rank raises :class:`InjectedFault` at one of ``POINTS``, in user shape.
:func:`reference` is the same training in one process on the global batch, what the next trial must reproduce.
Shared by the HPO and fence tests and ``benchmarks/hpo_recovery.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

STEPS = 4
BATCH = 4  # per rank
CONTROL_TIMEOUT = 600.0  # seconds; what the peers of a failed rank waited before the fence
POINTS = ("model_init", "data", "forward", "backward", "optimizer", "user")


def regression_data(world: int):
    """``STEPS`` global batches of ``world * BATCH`` rows: inputs ``x`` and targets ``y`` of a fixed linear map."""
    import torch

    g = torch.Generator().manual_seed(7)
    x = torch.randn(STEPS, world * BATCH, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1
    return x, y


def small_model():
    """The model every trial trains, seeded."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def reference(lr: float, world: int) -> list[float]:
    """One process, the whole global batch per step: what DDP over ``world`` ranks must reproduce."""
    import torch

    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = regression_data(world)
    losses = []
    for step in range(STEPS):
        loss = torch.nn.functional.mse_loss(model(x[step]), y[step])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


class InjectedFault(Exception):
    """The error a faulting rank raises."""


def ddp_losses(lr: float, point: str | None = None, at: int = -1,
               act: Callable[[str, int], None] | None = None) -> list[float]:
    """DDP training on every rank with SGD at ``lr``; on this rank, ``act(where, step)`` at ``point`` (one of
    ``POINTS``) in step ``at`` (``model_init``: before the model is wrapped, while the other ranks wait in DDP's
    first collective; ``user``: after the step, while the other ranks go on into the next step's collectives).
    ``act`` raises (a fault) or stops making progress (a hang).

    Args:
        lr: the learning rate.
        point: where this rank calls ``act``; None: nowhere.
        at: the step (from 0) at which it does.
        act: what it calls there, with a description of the place and the step.

    Returns:
        The loss per step, averaged over ranks.
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    state = {"step": 0}

    def reach(where: str) -> None:
        assert act is not None
        act(where, state["step"])

    if point == "model_init":
        reach("model_init")
    x, y = regression_data(world)

    class Shard(torch.utils.data.Dataset):
        def __len__(self):
            return STEPS * BATCH

        def __getitem__(self, i):
            step, j = divmod(i, BATCH)
            if point == "data" and step == at:
                reach("dataset __getitem__")
            return x[step, rank * BATCH + j], y[step, rank * BATCH + j]

    model = DistributedDataParallel(small_model())
    if point == "forward":
        model.module[0].register_forward_hook(lambda *a: reach("a forward hook") if state["step"] == at else None)
    if point == "backward":
        model.module[0].weight.register_hook(lambda g: reach("a gradient hook") if state["step"] == at else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    if point == "optimizer":
        optimizer.register_step_pre_hook(lambda *a: reach("an optimizer pre-hook") if state["step"] == at else None)
    losses = []
    for step, (xb, yb) in enumerate(torch.utils.data.DataLoader(Shard(), batch_size=BATCH)):
        state["step"] = step
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        if point == "user" and step == at:
            reach("user code")
    return losses


def suggest_lr(trial) -> float:
    """The trial's learning rate, from the range every search here samples."""
    return trial.suggest_float("lr", 0.01, 0.2)


def train(trial, fault: dict | None, marks: dict) -> list[float]:
    """:func:`ddp_losses` at the trial's learning rate; raises :class:`InjectedFault` on ``fault["rank"]`` in trial
    ``fault["trial"]`` at ``fault["point"]`` (one of ``POINTS``) and ``fault["step"]``. Returns the loss per step,
    averaged over ranks."""
    import torch.distributed as dist

    rank = dist.get_rank()
    lr = suggest_lr(trial)
    here = fault is not None and fault["rank"] == rank and fault["trial"] == trial.number
    if not here:
        return ddp_losses(lr)

    def fail(where: str, step: int) -> None:
        marks["fault_at"] = time.time()
        raise InjectedFault(f"injected on rank {rank} in {where} at step {step}")

    return ddp_losses(lr, fault["point"], fault["step"], fail)


def search(fault: dict | None, catch: tuple, n_trials: int = 2) -> dict:
    """On every rank: the study; what this rank trained per trial, when it faulted and when it left each trial."""
    import optuna
    import torch.distributed as dist

    from shardadopt.hpo import ControlOptions, optimize

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1)) if dist.get_rank() == 0 else None
    marks: dict = {"trials": [], "started": []}

    def objective(trial):
        marks["started"].append((trial.number, time.time()))
        losses = train(trial, fault, marks)
        marks["trials"].append((trial.number, trial.params["lr"], losses))
        return losses[-1]

    error = None
    try:
        optimize(study, objective, n_trials=n_trials, catch=catch, control=ControlOptions(timeout=CONTROL_TIMEOUT))
    except BaseException as exc:  # noqa: BLE001
        error = {"type": type(exc).__name__, "message": str(exc), "origin": getattr(exc, "shardadopt_rank", None),
                 "at": time.time()}
    table = None
    if study is not None:
        table = [(t.number, t.state.name, t.params, dict(t.user_attrs)) for t in study.trials]
    return {"table": table, "error": error, **marks}
