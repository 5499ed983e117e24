"""The HPO control plane's cost between a fault and the next trial: two hops per round on any world size, and the
control group kept across the rebuild.

A control round (``shardadopt.hpo.channel.Channel.exchange``) gathers every rank's row on rank 0 and broadcasts the
table back. It was one gloo all-reduce, a ring of ``2 (world - 1)`` hops one after the other: 0.56 s for the table
at 64 ranks on 2 loaded cores, paid several times between a fault and the next trial. And the rebuild created the
control group again, a second rendezvous and full mesh of connections next to the default group's, although the
break had left the control group's connections working (``benchmarks/fence_scale.py``).

Counted here on a 4-rank pool through a search whose middle trial fails on the last rank while the others block
in a training all-reduce (the fence breaks them out, the world is rebuilt): every round is one gather and one
broadcast on the control group and no all-reduce, every rank got the same table holding every rank's own row, and
the rebuild created no group but the default one: the trial after it runs its rounds on the same control group.
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
    calls = {"allreduce": 0, "gather": 0, "broadcast": 0}
    created: list[str] = []
    control_groups: list[int] = []  # id of the control group each trial's rounds ran on
    tables: list[list[list[int]]] = []
    rows: list[list[int]] = []
    methods = {name: getattr(dist.ProcessGroup, name) for name in calls}
    exchange, new_group, init = channel.Channel.exchange, dist.new_group, dist.init_process_group

    def control(group) -> bool:
        return any(group is g for groups in list(channel._GROUPS.values()) for g in groups.values())

    def counting(name):
        def call(self, *args, **kwargs):
            if control(self):
                calls[name] += 1
            return methods[name](self, *args, **kwargs)

        return call

    def recorded(self, op, status=channel.STATUS_OK, length=0, aux=0):
        table = exchange(self, op, status, length, aux)
        tables.append(table)
        rows.append([op, status, length, aux])
        if op == channel.OP_END:
            control_groups.append(id(self.group))
        return table

    def creating(real, what):
        def call(*args, **kwargs):
            created.append(what)
            return real(*args, **kwargs)

        return call

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
        setattr(dist.ProcessGroup, name, counting(name))
    channel.Channel.exchange = recorded
    dist.new_group, dist.init_process_group = creating(new_group, "new_group"), creating(init, "default group")
    before = fence.generation()
    try:
        study = optuna.create_study() if rank == 0 else None
        optimize(study, objective, n_trials=3, catch=(RuntimeError,))
    finally:
        for name, method in methods.items():
            setattr(dist.ProcessGroup, name, method)
        channel.Channel.exchange = exchange
        dist.new_group, dist.init_process_group = new_group, init
    states = [t.state.name for t in study.trials] if rank == 0 else None
    return {"calls": calls, "tables": tables, "rows": rows, "rebuilt": fence.generation() - before, "states": states,
            "created": created, "control groups": len(set(control_groups)), "trials": len(control_groups)}


def test_a_control_round_is_a_gather_and_a_broadcast_and_the_rebuild_keeps_the_control_group(pool4):
    results = pool4.run(_counted_search, timeout=240)
    assert results[0]["states"] == ["COMPLETE", "FAIL", "COMPLETE"], results[0]["states"]
    assert [r["rebuilt"] for r in results] == [1] * 4, [r["rebuilt"] for r in results]
    rounds = len(results[0]["tables"])
    assert rounds >= 3 * 3, rounds  # per trial at least: the command, a suggest, the end
    for rank, result in enumerate(results):
        assert result["tables"] == results[0]["tables"], f"rank {rank} saw other tables than rank 0"
        assert [table[rank] for table in result["tables"]] == result["rows"], f"rank {rank}'s own rows"
        calls = result["calls"]
        assert calls["allreduce"] == 0, calls  # no ring of 2 (world - 1) hops in any round
        assert calls["gather"] == rounds, calls  # one gather per round ...
        assert calls["broadcast"] >= rounds, calls  # ... and one broadcast (payloads add theirs)
        # the rebuild's one rendezvous is the default group's; every trial's rounds ran on one control group
        assert result["created"].count("default group") == 1, result["created"]
        assert "new_group" not in result["created"][result["created"].index("default group"):], result["created"]
        assert (result["trials"], result["control groups"]) == (3, 1), result
