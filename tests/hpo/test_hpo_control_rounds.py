"""The HPO control plane's rounds: two hops on any world size, not a ring, and the same table on every rank.

A control round (``shardadopt.hpo.channel.Channel.exchange``) gathers every rank's row on rank 0 and broadcasts the
table back. It was one gloo all-reduce, a ring of ``2 (world - 1)`` hops one after the other: 0.56 s for the table
at 64 ranks on 2 loaded cores, paid several times between a fault and the next trial (``benchmarks/fence_scale.py``).
Counted here on a 4-rank pool through a search whose middle trial fails on the last rank while the others block
in a training all-reduce (the fence breaks them out, the world is rebuilt): every round of every trial is one
gather and one broadcast on the control group and no all-reduce, and every rank got the same table, which holds
every rank's own row.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.multiproc


class InjectedFault(RuntimeError):
    pass


def _counted_search() -> dict:
    import optuna
    import torch
    import torch.distributed as dist

    from shardadopt import fence
    from shardadopt.hpo import channel, optimize

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    rank, world = dist.get_rank(), dist.get_world_size()
    calls: dict[str, int] = {"allreduce": 0, "gather": 0, "broadcast": 0}
    tables: list[list[list[int]]] = []
    rows: list[list[int]] = []
    # the control group is a gloo backend used through its own methods: count them on its class
    group_class = type(channel.control_group(channel.control_timeout()))
    real = {name: getattr(group_class, name) for name in calls}
    exchange = channel.Channel.exchange

    def counting(name):
        def call(self, *args, **kwargs):
            if self is channel.control_group(channel.control_timeout()):
                calls[name] += 1
            return real[name](self, *args, **kwargs)

        return call

    def recorded(self, op, status=channel.STATUS_OK, length=0, aux=0):
        table = exchange(self, op, status, length, aux)
        tables.append(table)
        rows.append([op, status, length, aux])
        return table

    def objective(trial):
        x = trial.suggest_float("x", 0, 1)
        total = torch.ones(1)
        dist.all_reduce(total)
        if trial.number == 1:
            if rank == world - 1:
                raise InjectedFault("injected on the last rank")
            dist.all_reduce(total)  # blocked: the last rank never comes; the fence breaks it
        return x

    for name in calls:
        setattr(group_class, name, counting(name))
    channel.Channel.exchange = recorded
    before = fence.generation()
    try:
        study = optuna.create_study() if rank == 0 else None
        optimize(study, objective, n_trials=3, catch=(RuntimeError,))
    finally:
        for name in calls:
            setattr(group_class, name, real[name])
        channel.Channel.exchange = exchange
    states = [t.state.name for t in study.trials] if rank == 0 else None
    return {"calls": calls, "tables": tables, "rows": rows, "rebuilt": fence.generation() - before, "states": states}


def test_a_control_round_is_a_gather_and_a_broadcast_and_every_rank_gets_the_table(pool4):
    results = pool4.run(_counted_search, timeout=240)
    assert results[0]["states"] == ["COMPLETE", "FAIL", "COMPLETE"], results[0]["states"]
    assert [r["rebuilt"] for r in results] == [1] * 4, [r["rebuilt"] for r in results]
    rounds = len(results[0]["tables"])
    assert rounds >= 3 * 3, rounds  # per trial at least: the command, a suggest, the end, the finish
    for rank, result in enumerate(results):
        assert result["tables"] == results[0]["tables"], f"rank {rank} saw other tables than rank 0"
        assert [table[rank] for table in result["tables"]] == result["rows"], f"rank {rank}'s own rows"
        calls = result["calls"]
        assert calls["allreduce"] == 0, calls  # no ring of 2 (world - 1) hops in any round
        assert calls["gather"] == rounds, calls  # one gather per round ...
        assert calls["broadcast"] >= rounds, calls  # ... and one broadcast (payloads add theirs)
