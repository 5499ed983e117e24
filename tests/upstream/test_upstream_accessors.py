"""shardadopt.upstream: every accessor against the installed upstream, and no private upstream name outside it.

Each accessor has a test named after it, checked against a public reference where upstream has one, so a rename or a
changed meaning upstream fails exactly that test. The distributed ones run together on one 2-rank gloo pool.
``test_no_private_upstream_names_outside_upstream_module`` reads the syntax tree of every module in shardadopt/,
benchmarks/, tools/ and tests/ and lists, file:line, each private upstream name used outside shardadopt/upstream/:
a name the installed upstream packages define, whatever shardadopt calls its own functions (see that section).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import pathlib
import random
import re
import sys
import textwrap
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
from packaging.version import Version

from shardadopt import upstream
from shardadopt.upstream.probing import Undecided
from shardadopt.upstream.versions import installed_version

REPO = pathlib.Path(__file__).resolve().parents[2]


def _transformers_at_least(version: str) -> bool:
    return installed_version("transformers") >= Version(version)


# -- accelerate ------------------------------------------------------------------------------------------------------

@pytest.fixture
def accelerator():
    """A CPU Accelerator with one model, optimizer, scheduler and dataloader prepared, and a registered object."""
    from accelerate import Accelerator

    upstream.reset_accelerate_state()
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    loader = torch.utils.data.DataLoader(torch.arange(8.0).reshape(4, 2), batch_size=2)
    acc.prepared = acc.prepare(model, optimizer, scheduler, loader)
    acc.raw = (model, optimizer, scheduler, loader)
    acc.register_for_checkpointing(acc.raw[0])
    yield acc
    upstream.reset_accelerate_state()


def test_accelerator_models(accelerator):
    models = upstream.accelerator_models(accelerator)
    assert models == [accelerator.prepared[0]]
    extra = torch.nn.Linear(1, 1)
    models.append(extra)  # adopt_model registers a model this way: it must be the Accelerator's own list
    assert upstream.accelerator_models(accelerator)[-1] is extra


def test_accelerator_optimizers(accelerator):
    [prepared] = upstream.accelerator_optimizers(accelerator)
    assert prepared is accelerator.prepared[1] and prepared.optimizer is accelerator.raw[1]


def test_accelerator_schedulers(accelerator):
    [prepared] = upstream.accelerator_schedulers(accelerator)
    assert prepared is accelerator.prepared[2] and prepared.scheduler is accelerator.raw[2]


def test_accelerator_dataloaders(accelerator):
    assert upstream.accelerator_dataloaders(accelerator) == [accelerator.prepared[3]]


def test_accelerator_custom_objects(accelerator):
    assert upstream.accelerator_custom_objects(accelerator) == [accelerator.raw[0]]


def test_accelerator_save_state_pre_hooks(accelerator):
    def hook(models, weights, output_dir):
        pass

    handle = accelerator.register_save_state_pre_hook(hook)
    assert hook in upstream.accelerator_save_state_pre_hooks(accelerator).values()
    handle.remove()
    assert hook not in upstream.accelerator_save_state_pre_hooks(accelerator).values()


def test_accelerator_load_state_pre_hooks(accelerator):
    def hook(models, input_dir):
        pass

    handle = accelerator.register_load_state_pre_hook(hook)
    assert hook in upstream.accelerator_load_state_pre_hooks(accelerator).values()
    handle.remove()
    assert hook not in upstream.accelerator_load_state_pre_hooks(accelerator).values()


def test_is_accelerate_prepared(accelerator):
    assert upstream.is_accelerate_prepared(accelerator.prepared[3])
    assert not upstream.is_accelerate_prepared(accelerator.raw[3])


def test_reset_accelerate_state():
    from accelerate import Accelerator

    upstream.reset_accelerate_state()
    assert Accelerator(cpu=True).mixed_precision == "no"
    # Without a reset accelerate refuses a second configuration of its process-wide state.
    upstream.reset_accelerate_state()
    assert Accelerator(cpu=True, mixed_precision="bf16").mixed_precision == "bf16"
    upstream.reset_accelerate_state()


def test_reset_accelerator_state():
    from accelerate import Accelerator
    from accelerate.state import PartialState

    upstream.reset_accelerate_state()
    Accelerator(cpu=True)
    process = PartialState().num_processes
    upstream.reset_accelerator_state()
    # the accelerator state takes a new configuration, the process state is kept
    assert Accelerator(cpu=True, mixed_precision="bf16").mixed_precision == "bf16"
    assert PartialState().initialized and PartialState().num_processes == process
    upstream.reset_accelerate_state()


def test_missing_name_raises_upstream_changed():
    with pytest.raises(upstream.UpstreamChanged, match=r"accelerator_models: object\._models does not exist in "
                                                       rf"accelerate {installed_version('accelerate')}"):
        upstream.accelerator_models(object())


# -- peft ------------------------------------------------------------------------------------------------------------

def test_peft_lora_in_out_features():
    from peft import LoraConfig, get_peft_model

    method = upstream.upstream_method(upstream.PEFT_LORA_IN_OUT_FEATURES, "test")
    assert method.__qualname__ == upstream.PEFT_LORA_IN_OUT_FEATURES.qualname
    layer = get_peft_model(torch.nn.Sequential(torch.nn.Linear(3, 5)), LoraConfig(r=2, target_modules=["0"]))
    lora = layer.base_model.model[0]
    assert method(lora, lora.get_base_layer()) == (3, 5) == (lora.in_features, lora.out_features)


def test_peft_in_out_features():
    function = upstream.peft_in_out_features()
    assert function(torch.nn.Linear(3, 5)) == (3, 5)


# -- transformers ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", upstream.TRAINER_TARGETS, ids=lambda t: t.qualname)
def test_trainer_targets(target):
    method = upstream.upstream_method(target, "test")
    assert callable(method) and method.__qualname__ == target.qualname


def test_save_model_internal_call():
    from transformers import Trainer

    assert upstream.SAVE_MODEL_INTERNAL_CALL in inspect.signature(Trainer.save_model).parameters


@pytest.fixture
def trainer(tiny_models, tmp_path):
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    class PushSpy(TrainerCallback):
        def on_push_begin(self, args, state, control, **kwargs):
            raise LookupError("push began")  # stops before any hub traffic

    upstream.reset_accelerate_state()
    args = TrainingArguments(output_dir=str(tmp_path / "run"), report_to=[], use_cpu=True,
                             hub_strategy="every_save", hub_always_push=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen3"], dtype=torch.float32)
    yield Trainer(model=model, args=args, callbacks=[PushSpy()])
    upstream.reset_accelerate_state()


def test_trainer_output_dir(trainer):
    assert upstream.trainer_output_dir(trainer, None) == trainer.args.output_dir


def test_trainer_save_rng_state(trainer, tmp_path):
    torch.manual_seed(1234)
    random.seed(5)
    upstream.trainer_save_rng_state(trainer, str(tmp_path))
    [saved] = [f for f in os.listdir(tmp_path) if f.startswith("rng_state")]
    states = torch.load(tmp_path / saved, weights_only=False)
    assert torch.equal(states["cpu"], torch.random.get_rng_state()) and states["python"] == random.getstate()


def test_trainer_save_scaler(trainer, tmp_path):
    from transformers.trainer import SCALER_NAME

    scaler = torch.amp.GradScaler("cpu", init_scale=128.0)
    trainer.accelerator.scaler = scaler
    upstream.trainer_save_scaler(trainer, str(tmp_path))
    assert torch.load(tmp_path / SCALER_NAME, weights_only=False)["scale"] == scaler.state_dict()["scale"]


def test_trainer_push_from_checkpoint(trainer, tmp_path):
    with pytest.raises(LookupError, match="push began"):
        upstream.trainer_push_from_checkpoint(trainer, str(tmp_path))


def test_from_config_constructor(tiny_models):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen3"], dtype=torch.float32)
    build = upstream.from_config_constructor(type(model))
    with torch.device("meta"):
        built = build(AutoConfig.from_pretrained(tiny_models["qwen3"]))
    assert type(built) is type(model)
    assert {n: p.shape for n, p in built.named_parameters()} == {n: p.shape for n, p in model.named_parameters()}
    assert upstream.from_config_constructor(torch.nn.Linear) is None


def _experts():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=8, moe_intermediate_size=4, num_experts=3, num_experts_per_tok=2)
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(config)
    for param in experts.parameters():
        torch.nn.init.normal_(param)
    return experts


def test_experts_is_expert_parallel():
    experts = _experts()
    flag = upstream.experts_is_expert_parallel(experts)
    # transformers 5.18 started marking experts modules (False unless sharded by expert); earlier ones never do.
    assert flag is (False if _transformers_at_least("5.18") else None)


def test_set_experts_expert_parallel():
    from shardadopt.parallel.moe import is_expert_parallel

    experts = _experts()
    upstream.set_experts_expert_parallel(experts, True)
    assert upstream.experts_is_expert_parallel(experts) is True and is_expert_parallel(experts)


def test_experts_apply_gate():
    experts = _experts()
    projected = torch.randn(5, 8)
    gate, up = projected.chunk(2, dim=-1)
    torch.testing.assert_close(upstream.experts_apply_gate(experts, projected), experts.act_fn(gate) * up)


def _grouped_operands():
    torch.manual_seed(0)
    hidden = torch.randn(6, 4)
    weight = torch.randn(3, 5, 4)  # (experts, out, in)
    offsets = torch.tensor([2, 2, 6], dtype=torch.int32)  # expert 1 gets no rows
    return hidden, weight, offsets


def test_moe_grouped_linear():
    hidden, weight, offsets = _grouped_operands()
    starts = [0, *offsets.tolist()[:-1]]
    reference = torch.cat([hidden[s:e] @ weight[g].T for g, (s, e) in enumerate(zip(starts, offsets.tolist()))])
    out = upstream.moe_grouped_linear()(hidden, weight, offsets)
    torch.testing.assert_close(out, reference)


def test_moe_can_use_grouped_mm():
    hidden, weight, offsets = _grouped_operands()
    assert isinstance(upstream.moe_can_use_grouped_mm(hidden, weight.transpose(1, 2), offsets), bool)


def test_moe_grouped_linear_name():
    """The constant the EP sentinel probe looks for in upstream's ``grouped_mm_experts_forward``."""
    from transformers.integrations import moe

    from shardadopt.upstream.probing import calls, source_tree

    assert calls(source_tree(moe.grouped_mm_experts_forward), upstream.MOE_GROUPED_LINEAR)


# -- torch, one process ----------------------------------------------------------------------------------------------

def _foreach_clip_works(device: str) -> bool:
    """torch's public reference: ``clip_grads_with_norm_(foreach=True)`` refuses devices without foreach kernels."""
    param = torch.nn.Parameter(torch.ones(2, device=device))
    param.grad = torch.ones(2, device=device)
    try:
        torch.nn.utils.clip_grads_with_norm_([param], 1.0, torch.tensor(4.0, device=device), foreach=True)
    except RuntimeError:
        return False
    return True


def test_device_has_foreach_support():
    for device in ("cpu", "meta"):
        assert upstream.device_has_foreach_support(torch.device(device)) is _foreach_clip_works(device), device


def test_has_foreach_support():
    cpu = torch.device("cpu")
    plain, parameter = torch.ones(2), torch.nn.Parameter(torch.ones(2))
    assert upstream.has_foreach_support([plain, None], cpu) is upstream.device_has_foreach_support(cpu)
    assert upstream.has_foreach_support([plain, parameter], cpu) is False  # plain tensors only
    assert upstream.has_foreach_support([plain], torch.device("meta")) is False


def test_group_tensors_by_device_and_dtype():
    tensors = [torch.ones(2), torch.ones(2, dtype=torch.float64), torch.zeros(3)]
    grouped = upstream.group_tensors_by_device_and_dtype([tensors])
    reference: dict = {}
    for t in tensors:
        reference.setdefault((t.device, t.dtype), []).append(id(t))
    assert {key: [id(t) for t in lists[0]] for key, (lists, _) in grouped.items()} == reference


def test_foreach_mul_():
    tensors = [torch.arange(3.0), torch.ones(2)]
    expected = [t * 0.5 for t in tensors]
    upstream.foreach_mul_(tensors, torch.tensor(0.5))
    for t, e in zip(tensors, expected):
        torch.testing.assert_close(t, e)


def test_queue_backward_callback():
    """The callback runs once, after the backward accumulated every leaf's gradient (queued from the first hook)."""
    first, second = torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)
    seen = []

    def hook(param):
        seen.append("hook")
        if len(seen) == 1:
            upstream.queue_backward_callback(lambda: seen.append(
                ("callback", first.grad is not None and second.grad is not None)))

    first.register_post_accumulate_grad_hook(hook)
    second.register_post_accumulate_grad_hook(hook)
    ((first * 2).sum() + (second * 3).sum()).backward()
    assert seen == ["hook", "hook", ("callback", True)]


def test_current_graph_task_id():
    """Each backward has an id of its own, seen from its hooks; -1 outside a backward."""
    param = torch.ones(2, requires_grad=True)
    ids = []
    param.register_post_accumulate_grad_hook(lambda p: ids.append(upstream.current_graph_task_id()))
    (param * 2).sum().backward()
    (param * 3).sum().backward()
    assert len(ids) == 2 and ids[0] != ids[1] and min(ids) >= 0 and upstream.current_graph_task_id() == -1


def test_collective_op_namespaces():
    """Each namespace holds torch's collective ops (an all-reduce, or the autograd all-to-all)."""
    import torch.distributed.tensor  # noqa: F401  (registers the c10d and functional collective ops)

    for namespace in upstream.COLLECTIVE_OP_NAMESPACES:
        ops = getattr(torch.ops, namespace)
        assert any(hasattr(ops, name) for name in ("allreduce_", "all_reduce", "all_to_all_single")), namespace
        op = getattr(ops, next(n for n in ("allreduce_", "all_reduce", "all_to_all_single") if hasattr(ops, n)))
        assert op.default.namespace == namespace


def test_torch_dispatch_mode():
    """A subclass sees the ops dispatched while it is entered."""
    seen = []

    class Recording(upstream.torch_dispatch_mode()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Recording():
        torch.ones(2) + torch.ones(2)
    assert "aten.add.Tensor" in seen


def test_pytree_flatten():
    """The leaves in order, and a spec that rebuilds the nesting."""
    tree = ([1, torch.ones(2)], {"a": (2, None)})
    leaves, spec = upstream.pytree_flatten(tree)
    assert leaves[0] == 1 and leaves[2:] == [2, None] and leaves[1] is tree[0][1]
    assert spec.unflatten(leaves) == tree


def test_foreach_norm():
    tensors = [torch.arange(3.0), -torch.ones(2)]
    for p in (1.0, 2.0, float("inf")):
        norms = upstream.foreach_norm(tensors, p, dtype=torch.float64)
        for n, t in zip(norms, tensors):
            torch.testing.assert_close(n, torch.linalg.vector_norm(t, p, dtype=torch.float64))


def test_strided_shard_type():
    from torch.distributed.tensor.placement_types import Placement

    strided = upstream.strided_shard_type()
    assert issubclass(strided, Placement) and strided(0, split_factor=2).dim == 0


def test_compute_local_shape_and_global_offset():
    from torch.distributed.tensor import Replicate, Shard

    full = torch.arange(5 * 4).reshape(5, 4)
    for coordinate in ([0, 0], [1, 1]):
        shape, offset = upstream.compute_local_shape_and_global_offset(full.shape, (2, 2), coordinate,
                                                                         [Shard(0), Replicate()])
        piece = full.chunk(2, dim=0)[coordinate[0]]  # torch's Shard layout: chunk
        assert tuple(shape) == tuple(piece.shape) and tuple(offset) == (int(piece[0, 0]) // 4, 0)


def test_c10d_store_factory(monkeypatch):
    """What init_process_group's env:// rendezvous gets: rank 0 hosts a TCPStore that a plain client reaches."""
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    store = upstream.c10d_store_factory()("127.0.0.1", 0, 0, 1, timedelta(seconds=30))
    assert isinstance(store, torch.distributed.TCPStore)
    torch.distributed.TCPStore("127.0.0.1", store.port, is_master=False).set("k", "v")
    assert store.get("k") == b"v"


def test_redistribute_backward():
    """DTensor's redistribution backward (the torch-dtensor-redistribute-no-grad patch wraps it, its probe reads it)."""
    backward = upstream.upstream_method(upstream.REDISTRIBUTE_BACKWARD, "test")
    assert backward.__qualname__ == upstream.REDISTRIBUTE_BACKWARD.qualname
    assert "grad_output" in inspect.signature(backward).parameters


def test_local_shard_readers():
    """DTensor's own readers of the local shard exist (the transformers ones belong to the fixed shape only)."""
    from torch.distributed.tensor import DTensor

    assert {"to_local", "_local_tensor"} <= upstream.LOCAL_SHARD_READERS
    assert callable(DTensor.to_local)


def test_agent_store_checks():
    """The factory chooses the agent's store by calling one of them (the torchrun-restart patch's probe reads it)."""
    import torch.distributed.rendezvous  # noqa: F401  (the module, not torch.distributed's function of that name)

    module = sys.modules["torch.distributed.rendezvous"]
    source = inspect.getsource(upstream.c10d_store_factory())
    assert [name for name in upstream.AGENT_STORE_CHECKS if f"{name}(" in source]
    assert all(callable(getattr(module, name)) for name in upstream.AGENT_STORE_CHECKS if hasattr(module, name))


def test_accelerator_type():
    current = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    assert upstream.accelerator_type() == (current.type if current is not None else "cpu")


def test_module_backward_hooks():
    module = torch.nn.Linear(2, 2)
    seen = []
    module.register_full_backward_hook(lambda m, grad_in, grad_out: seen.append(1))
    hooks = upstream.module_backward_hooks(module)
    assert len(hooks) == 1
    module(torch.ones(1, 2, requires_grad=True)).sum().backward()
    assert seen == [1]
    hooks.clear()  # tp.fix_tp_grad_accumulation deletes upstream's hook this way
    module(torch.ones(1, 2, requires_grad=True)).sum().backward()
    assert seen == [1]


def test_module_forward_pre_hooks():
    module = torch.nn.Linear(2, 2)
    seen = []
    module.register_forward_pre_hook(lambda m, args: seen.append(1))
    hooks = upstream.module_forward_pre_hooks(module)
    assert len(hooks) == 1
    module(torch.ones(1, 2))
    assert seen == [1]
    hooks.clear()  # tp.fix_tp_grad_accumulation deletes upstream's pre-hook (transformers 5.25+) this way
    module(torch.ones(1, 2))
    assert seen == [1]


def test_post_accumulate_grad_hooks():
    param = torch.nn.Parameter(torch.ones(2))
    assert upstream.post_accumulate_grad_hooks(param) == {}
    seen = []
    param.register_post_accumulate_grad_hook(lambda p: seen.append(1))
    hooks = upstream.post_accumulate_grad_hooks(param)
    (param * 2).sum().backward()
    assert len(hooks) == 1 and seen == [1]
    hooks.clear()
    (param * 2).sum().backward()
    assert seen == [1]


def test_compiled_original():
    module = torch.nn.Linear(2, 2)
    assert upstream.compiled_original(torch.compile(module)) is module
    assert upstream.compiled_original(module) is None


def test_per_step_accessors_import_their_module_once(monkeypatch):
    """gradnorm and moe call these on every step: the module is imported once, the attribute read each call."""
    tensors = [torch.ones(2)]
    upstream.has_foreach_support(tensors, torch.device("cpu"))
    imports = []
    monkeypatch.setattr(importlib, "import_module", lambda name, *a: imports.append(name) or sys.modules[name])
    for _ in range(3):
        upstream.has_foreach_support(tensors, torch.device("cpu"))
        upstream.group_tensors_by_device_and_dtype([tensors])
    assert imports == []


def test_module_initializing(tmp_path, monkeypatch):
    (tmp_path / "half_imported.py").write_text(
        "import sys\nfrom shardadopt import upstream\nDURING = upstream.module_initializing(sys.modules[__name__])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("half_imported")
    try:
        assert module.DURING is True and upstream.module_initializing(module) is False
    finally:
        sys.modules.pop("half_imported", None)


def test_thread_frame():
    import threading

    entered, release = threading.Event(), threading.Event()

    def blocked_in_here():
        entered.set()
        release.wait(30)

    thread = threading.Thread(target=blocked_in_here)
    thread.start()
    try:
        assert entered.wait(30)
        frame = upstream.thread_frame(thread.ident)
        while frame is not None and frame.f_code.co_name != "blocked_in_here":
            frame = frame.f_back
        assert frame is not None and frame.f_code.co_filename == __file__
        assert upstream.thread_frame(threading.get_ident()).f_back.f_code.co_name == "test_thread_frame"  # its caller
        assert upstream.thread_frame(-1) is None
    finally:
        release.set()
        thread.join()


# -- optuna ----------------------------------------------------------------------------------------------------------

def test_study_storage_and_trial_id():
    import optuna

    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(storage=storage)
    other = optuna.create_study(storage=storage)
    trial = study.ask()
    other.ask()
    assert upstream.study_storage(study) is storage
    trial_id = upstream.trial_id(trial)
    assert storage.get_trial(trial_id).number == trial.number == 0
    assert upstream.trial_id(study.trials[0]) == trial_id  # a FrozenTrial carries the same id
    assert upstream.trial_id(other.trials[0]) != trial_id, "ids are unique across the studies of a storage"


def test_stale_trial_callback_keyword_reaches_the_storage_without_a_deprecation():
    import warnings

    import optuna

    def callback(study, trial):
        return None

    keyword = upstream.stale_trial_callback_keyword()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # optuna's deprecations are FutureWarnings
        storage = optuna.storages.RDBStorage("sqlite://", heartbeat_interval=60, **{keyword: callback})
        getter = getattr(storage, "get_heartbeat_stale_trial_callback", None) or storage.get_failed_trial_callback
        assert getter() is callback, keyword


def test_dcp_metadata_names_only_the_allowed_globals(tmp_path):
    """A ``.metadata`` this torch writes names only classes of ``DCP_METADATA_MODULE``, ``DCP_METADATA_GLOBALS`` and
    torch dtypes (what the restricted reader allows), and ``DCP_READ_METADATA`` is the method that reads it."""
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(3, 2), "step": 4, "nested": {"b": torch.zeros(2, dtype=torch.bfloat16)}},
             checkpoint_id=str(tmp_path))
    seen = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    with open(tmp_path / ".metadata", "rb") as stream:
        Recording(stream).load()
    outside = {(module, name) for module, name in seen
               if module != upstream.DCP_METADATA_MODULE and (module, name) not in upstream.DCP_METADATA_GLOBALS
               and not (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))}
    assert seen and not outside, outside
    assert callable(upstream.upstream_method(upstream.DCP_READ_METADATA, "test"))


def test_array_reconstructor_loads_a_numpy_rng_state_under_weights_only(tmp_path):
    import numpy as np
    import torch

    state = np.random.default_rng(3).bit_generator.state, np.random.RandomState(3).get_state()
    torch.save(state, tmp_path / "rng.pt")
    allowed = [upstream.array_reconstructor(), np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    with torch.serialization.safe_globals(allowed):
        loaded = torch.load(tmp_path / "rng.pt", weights_only=True)
    assert np.array_equal(loaded[1][1], state[1][1]) and loaded[0] == state[0]


def test_peft_tp_plan_attribute_gates_the_sizing_from_peft_0_22():
    """peft 0.22's ``_get_in_out_features`` sizes by the local shard only for a layer without transformers' TP plan
    attribute; 0.21.2 has no such attribute and sizes every TP base by its shard."""
    peft = pytest.importorskip("peft")
    from packaging.version import Version

    sizing = inspect.getsource(upstream.peft_in_out_features())
    assert (upstream.PEFT_TP_PLAN_ATTRIBUTE in sizing) == (Version(peft.__version__) >= Version("0.22")), sizing


# -- torch and transformers on two ranks -----------------------------------------------------------------------------

def distributed_checks(path: str) -> dict[str, str | None]:
    """Every accessor that needs a process group or a load-time-sharded model: accessor -> failure (None: ok)."""
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[str, str | None] = {}

    def check(name, condition):
        try:
            ok = condition()
        except Exception as exc:  # noqa: BLE001  (reported per accessor)
            results[name] = f"{type(exc).__name__}: {exc}"
        else:
            results[name] = None if ok else "unexpected value"

    def store_is_shared():
        store = upstream.default_store()
        store.add("test-upstream-accessors", 1)
        dist.barrier()
        return store.add("test-upstream-accessors", 0) == world

    check("default_store", store_is_shared)
    check("default_group", lambda: upstream.default_group() is dist.group.WORLD)
    check("registered_process_groups", lambda: dist.group.WORLD in upstream.registered_process_groups()
          and dist.new_group([0, 1]) in upstream.registered_process_groups())
    counter = {}

    def counter_names_the_next_group():
        counter["start"] = upstream.process_group_counter()
        return dist.new_group([0, 1]).group_name == str(counter["start"]) \
            and upstream.process_group_counter() == counter["start"] + 1

    def set_counter_names_the_next_group():
        upstream.set_process_group_counter(counter["start"] + 10)
        return dist.new_group([0, 1]).group_name == str(counter["start"] + 10)

    check("process_group_counter", counter_names_the_next_group)
    check("set_process_group_counter", set_counter_names_the_next_group)
    # RankPool leaves init_process_group's timeout at torch's default.
    check("group_timeout", lambda: upstream.group_timeout(upstream.default_group(), torch.device("cpu"))
          == default_pg_timeout)
    # gloo runs collectives on CPU tensors (and CUDA ones on a CUDA build).
    check("backend_device_types", lambda: "cpu" in upstream.backend_device_types(None)
          and set(upstream.backend_device_types(None)) <= {"cpu", "cuda"})

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(6.0 * world).reshape(3 * world, 2)

    def local_is_the_shard():
        sharded = distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()
        local = upstream.dtensor_local(sharded)
        return torch.equal(local, full.chunk(world)[rank]) and local.grad_fn is None

    check("dtensor_local", local_is_the_shard)

    def cache_forgets_meshes():
        # meshes compare equal by layout: without the clear, the cached output spec carries the first mesh
        (distribute_tensor(full, mesh, [Shard(0)]) * 2).full_tensor()
        equal = init_device_mesh("cpu", (world,))
        upstream.clear_sharding_propagation_caches()
        return equal == mesh and (distribute_tensor(full, equal, [Shard(0)]) * 2).device_mesh is equal

    check("clear_sharding_propagation_caches", cache_forgets_meshes)

    def one_group_on_the_mesh():
        module = torch.nn.Linear(2, 2)
        fully_shard(module, mesh=mesh)
        [group] = upstream.fsdp_param_groups(module)
        return group.mesh_info.mesh == mesh

    check("fsdp_param_groups", one_group_on_the_mesh)

    def syncs_unless_no_sync():
        module = torch.nn.Linear(2, 2)
        fully_shard(module, mesh=mesh)
        [group] = upstream.fsdp_param_groups(module)
        syncing = upstream.fsdp_group_syncs_gradients(group)
        module.set_requires_gradient_sync(False)
        return syncing is True and upstream.fsdp_group_syncs_gradients(group) is False

    check("fsdp_group_syncs_gradients", syncs_unless_no_sync)

    def lazy_init_keeps_the_root():
        # a unit run before its root's first forward takes the root role, and the root's forward then raises;
        # initialised first, the root keeps it
        outer = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        fully_shard(outer[0], mesh=mesh)
        fully_shard(outer, mesh=mesh)
        upstream.fsdp_lazy_init(outer)
        with torch.no_grad():
            outer[0](torch.ones(1, 2))
            return outer(torch.ones(1, 2)).shape == (1, 2)

    check("fsdp_lazy_init", lazy_init_keeps_the_root)

    def functional_all_reduce_waited():
        import torch.distributed._functional_collectives  # noqa: F401  (registers the ops)

        issued = torch.ops._c10d_functional.all_reduce(torch.ones(2), "sum", dist.group.WORLD.group_name)
        return torch.equal(upstream.wait_functional_collective(issued), torch.full((2,), float(world)))

    check("wait_functional_collective", functional_all_reduce_waited)

    def managed_as_registered_now():
        module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, bias=False))
        fully_shard(module[1], mesh=mesh)
        fully_shard(module, mesh=mesh)
        first = upstream.fsdp_managed_parameters(module) == [module[0].weight, module[0].bias]
        module[1].weight = torch.nn.Parameter(module[1].weight.detach().clone())  # replaced after fully_shard
        return first and upstream.fsdp_managed_parameters(module[1]) == [module[1].weight]

    check("fsdp_managed_parameters", managed_as_registered_now)

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 distributed_config=DistributedConfig(tp_size=world))

    def mesh_covers_world():
        found = upstream.model_device_mesh(model)
        return isinstance(found, DeviceMesh) and found.size() == world

    check("model_device_mesh", mesh_covers_world)

    def manager_meshes():
        manager = upstream.model_mesh_manager(model)
        if manager is None:  # the mesh manager came in 5.19
            return not _transformers_at_least("5.19")
        dense, expert = upstream.mesh_manager_meshes(manager)
        return (upstream.is_mesh_manager(manager) and isinstance(dense, DeviceMesh)
                and isinstance(expert, DeviceMesh) and dense.size() == world)

    check("model_mesh_manager", manager_meshes)

    def sizes_read_back():
        upstream.set_model_sharding_sizes(model, 3, 5)
        fsdp_property = isinstance(getattr(type(model), "fsdp_size", None), property)
        return model.tp_size == 3 and (not fsdp_property or model.fsdp_size == 5)

    check("set_model_sharding_sizes", sizes_read_back)

    def hf_meshes():
        meshes = [upstream.module_hf_device_mesh(m) for m in model.modules()]
        if not all(m is None or isinstance(m, DeviceMesh) for m in meshes):
            return False
        # 5.15 records the mesh on the modules its tensor parallelism shards; later releases on none.
        return any(m is not None for m in meshes) is not _transformers_at_least("5.16")

    check("module_hf_device_mesh", hf_meshes)
    return results


DISTRIBUTED_ACCESSORS = ("default_store", "default_group", "registered_process_groups", "process_group_counter",
                         "set_process_group_counter", "group_timeout",
                         "backend_device_types", "dtensor_local", "clear_sharding_propagation_caches",
                         "fsdp_param_groups", "fsdp_group_syncs_gradients", "fsdp_lazy_init",
                         "wait_functional_collective",
                         "fsdp_managed_parameters",
                         "model_device_mesh", "model_mesh_manager",
                         "set_model_sharding_sizes",
                         "module_hf_device_mesh")


@pytest.fixture(scope="module")
def distributed_results(pool2, tiny_models):
    return pool2.run(distributed_checks, tiny_models["qwen3"])


@pytest.mark.parametrize("accessor", DISTRIBUTED_ACCESSORS)
def test_distributed_accessor(distributed_results, accessor):
    failures = {rank: r[accessor] for rank, r in enumerate(distributed_results) if r[accessor] is not None}
    assert not failures, f"shardadopt.upstream.{accessor}: {failures}"


def test_every_accessor_is_tested():
    """A new accessor needs a test here: each public function and constant of shardadopt.upstream is used above
    (the Trainer targets through TRAINER_TARGETS, the model attribute names through the accessors that use them)."""
    source = pathlib.Path(__file__).read_text()
    covered = {*(n for n in vars(upstream) if n.startswith("TRAINER_")), "MODEL_DEVICE_MESH_ATTRIBUTE",
               "MODEL_SHARDING_SIZE_ATTRIBUTES"}
    public = [n for n, v in vars(upstream).items() if not n.startswith("_") and n not in covered and (
        n.isupper() and n != "TYPE_CHECKING" or inspect.isfunction(v) and v.__module__ == upstream.__name__)]
    untested = [n for n in public if f"upstream.{n}" not in source]
    assert not untested, f"accessors without a test in {pathlib.Path(__file__).name}: {untested}"


def test_class_plan_attributes():
    from transformers import LlamaForCausalLM

    assert getattr(LlamaForCausalLM, upstream.CLASS_TP_PLAN_ATTRIBUTE).get("lm_head") == "colwise_gather_output"
    assert "lm_head.weight" in getattr(LlamaForCausalLM, upstream.CLASS_TIED_WEIGHTS_ATTRIBUTE)


# -- patch targets and the private hooks their probes read ----------------------------------------------------------

@pytest.mark.parametrize("target", [upstream.PARALLELISM_CONFIG_VALIDATE_ACCELERATOR,
                                    upstream.TRAINER_REPORT_TO_HP_SEARCH, upstream.GENERATION_SAMPLE],
                         ids=lambda t: t.qualname)
def test_patch_targets(target):
    method = upstream.upstream_method(target, "test")
    assert callable(method) and method.__qualname__ == target.qualname


@pytest.mark.parametrize("target", [upstream.DISTILLATION_COMPUTE_LOSS, upstream.DISTILLATION_PREPARE_INPUTS,
                                    upstream.DISTILLATION_TRAIN_SAMPLER, upstream.GRPO_PREPARE_INPUTS,
                                    upstream.GRPO_SCORE, upstream.RLOO_PREPARE_INPUTS, upstream.RLOO_SCORE],
                         ids=lambda t: t.qualname)
def test_trl_patch_targets(target):
    pytest.importorskip("trl")
    method = upstream.upstream_method(target, "test")
    assert callable(method) and method.__qualname__ == target.qualname


def _local_tensor_parallel_layers() -> bool:
    """transformers 5.15's local-tensor TP layers, with forward hooks (5.16 replaced them with DTensor layers)."""
    return not _transformers_at_least("5.16")


@pytest.mark.parametrize("target", [upstream.ROUTER_PARALLEL_PREPARE_OUTPUT, upstream.EMBEDDING_PARALLEL_PREPARE_INPUT,
                                    upstream.ROWWISE_PARALLEL_PREPARE_INPUT, upstream.ROWWISE_PARALLEL_PREPARE_OUTPUT],
                         ids=lambda t: t.qualname)
def test_tensor_parallel_targets(target):
    assert target.module == upstream.TENSOR_PARALLEL_MODULE
    if _local_tensor_parallel_layers():
        assert upstream.upstream_method(target, "test").__qualname__ == target.qualname
    else:
        with pytest.raises(Undecided, match="does not exist in this release"):
            upstream.upstream_method(target, "test")


def _tensor_parallel_layer(name: str) -> type | None:
    module = importlib.import_module(upstream.TENSOR_PARALLEL_MODULE)
    with warnings.catch_warnings():  # some releases re-export their layers from here with a FutureWarning
        warnings.simplefilter("ignore", FutureWarning)
        return getattr(module, name, None)


def test_generation_prepare_multimodal_encoder():
    """generate's image encoding before the prefill: from transformers 5.18 on, taking the model kwargs."""
    target = upstream.GENERATION_PREPARE_MULTIMODAL_ENCODER
    if not _transformers_at_least("5.18"):
        with pytest.raises(Undecided):
            upstream.upstream_method(target, "test")
        return
    method = upstream.upstream_method(target, "test")
    assert method.__qualname__ == target.qualname
    assert list(inspect.signature(method).parameters) == ["self", "model_kwargs"]


def test_tp_layer_input_hook():
    assert upstream.tp_layer_input_hook(None) is None
    for target in (upstream.EMBEDDING_PARALLEL_PREPARE_INPUT, upstream.ROWWISE_PARALLEL_PREPARE_INPUT):
        hook = upstream.tp_layer_input_hook(_tensor_parallel_layer(target.qualname.split(".")[0]))
        if _local_tensor_parallel_layers():
            assert hook is not None and hook.__qualname__ == target.qualname
        else:
            assert hook is None


def test_tp_layer_output_hook():
    assert upstream.tp_layer_output_hook(None) is None
    for target in (upstream.ROUTER_PARALLEL_PREPARE_OUTPUT, upstream.ROWWISE_PARALLEL_PREPARE_OUTPUT):
        layer = _tensor_parallel_layer(target.qualname.split(".")[0])
        hook = upstream.tp_layer_output_hook(layer)
        if _local_tensor_parallel_layers():
            assert hook is not None and hook.__qualname__ == target.qualname
            assert callable(upstream.tp_layer_output_hook(layer()))  # bound to the instance
        else:
            assert hook is None


def test_validate_parallelism_config():
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils.dataclasses import DistributedType

    def accelerator(processes: int) -> SimpleNamespace:
        return SimpleNamespace(multi_device=True, is_fsdp2=False, num_processes=processes, is_main_process=True,
                               distributed_type=DistributedType.MULTI_GPU)

    assert upstream.validate_parallelism_config(ParallelismConfig(tp_size=2), accelerator(2)) is None
    with pytest.raises(ValueError, match="does not match num_processes"):
        upstream.validate_parallelism_config(ParallelismConfig(tp_size=2), accelerator(3))


# -- no private upstream name outside shardadopt/upstream/ --------------------------------------------------------
#
# A private name (``_x``, not a dunder) that an installed upstream package defines is upstream's wherever code reaches
# it through an object (``obj._x``, ``getattr(obj, "_x")``), names it in a string (``Target(.., "Trainer._x")``) or
# imports it, whatever shardadopt calls its own functions: patch wrappers are named after the upstream method they
# wrap, so ``_validate_accelerator`` is shardadopt's wrapper and accelerate's method at once. Telling the two apart:
# - the upstream names are read from the installed packages' sources (``upstream_private_names``), so they follow the
#   installed releases (a name one release defines and another does not is flagged where it is defined);
# - a name reached through shardadopt's own object (``self``/``cls`` in a method, an attribute shardadopt set on one,
#   a module or name imported from shardadopt) is shardadopt's when shardadopt defines it, even if upstream defines
#   one like it (shardadopt's ``self._lock`` is not torch's ``_lock``);
# - a name upstream does not define is shardadopt's only where shardadopt defines it (:class:`OwnNames`); any other
#   private name (an attribute upstream sets from C, say) is upstream's.
# Plain calls of shardadopt's functions by name (``_validate_accelerator(...)``) and their definitions are not uses.

SCANNED = ("shardadopt", "benchmarks", "tools", "tests")
# A test that must name one (to inject a fault where upstream's kernel sits, to rename what a probe reads, to assert
# what upstream offers no getter for) says why in a comment on that line or the one above.
TEST_EXCUSE = "# upstream-private:"
# Where shardadopt's own private names are defined (benchmarks call helpers of test modules).
OWN_DEFINITIONS = SCANNED + ("examples",)
UPSTREAM_PACKAGES = ("torch", "transformers", "accelerate", "optuna", "peft", "trl")
ACCESSOR_MODULE = "shardadopt/upstream/"  # one module per upstream library
FIX = "add an accessor or a Target constant in the shardadopt/upstream/ module of its library and use that"
_AFFIX_METHODS = {"startswith", "endswith", "removeprefix", "removesuffix"}
_SELF = ("self", "cls")
# Calls whose second argument names an attribute of their first: the string is reached through that object.
_ATTRIBUTE_CALLS = {"getattr", "setattr", "hasattr", "delattr", "getattr_static", "__setattr__", "__getattribute__"}
# What upstream source defines, at the start of a line: ``def _x`` / ``class _x``, or an assignment (annotated or not)
# to ``_x`` or ``<obj>._x``. Text, not syntax trees: one pass over the ~6,000 .py/.pyi files of the six packages takes
# seconds where parsing them takes minutes; a comment or docstring line shaped like a definition can only add a name,
# which errs toward flagging.
_UPSTREAM_DEFINITION = re.compile(rb"^[ \t]*(?:async[ \t]+)?(?:def|class)[ \t]+(_\w+)"
                                  rb"|^[ \t]*(?:\w+\.)*(_\w+)[ \t]*(?::[^=\n]*)?=(?!=)", re.MULTILINE)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def upstream_private_names(packages: Iterable[str] = UPSTREAM_PACKAGES) -> frozenset[str]:
    """The private names the installed ``packages`` define in their .py and .pyi sources (``.pyi`` stubs name what
    torch defines in C), as ``_UPSTREAM_DEFINITION`` finds them; a package that is not installed adds none."""
    names: set[str] = set()
    for package in packages:
        spec = importlib.util.find_spec(package)
        for root in (spec.submodule_search_locations or []) if spec is not None else []:
            for path in sorted(pathlib.Path(root).rglob("*.py*")):
                if path.suffix in (".py", ".pyi"):
                    names.update((m[1] or m[2]).decode() for m in _UPSTREAM_DEFINITION.finditer(path.read_bytes()))
    return frozenset(filter(_private, names))


@dataclass(frozen=True)
class OwnNames:
    """Private names shardadopt defines. ``names``: functions, classes, methods, assigned names and aliases, which
    code may reach through any object; ``attributes``: instance attributes (``self._x = ...``), shardadopt's own
    only when reached through ``self``/``cls``: elsewhere ``obj._x`` may well be upstream's (``study._storage``,
    ``trial._trial_id`` while shardadopt's heartbeat has a ``self._storage`` of its own)."""

    names: frozenset[str]
    attributes: frozenset[str]

    def __or__(self, other: OwnNames) -> OwnNames:
        return OwnNames(self.names | other.names, self.attributes | other.attributes)


def own_private_names(trees: Iterable[ast.AST]) -> OwnNames:
    """The private names shardadopt defines, split as :class:`OwnNames` describes."""
    names: set[str] = set()
    attributes: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for part in ast.walk(target):
                        if isinstance(part, ast.Name):
                            names.add(part.id)
                        elif (isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name)
                              and part.value.id in _SELF):
                            attributes.add(part.attr)
            elif isinstance(node, ast.alias) and node.asname:
                names.add(node.asname)
            elif (isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[0], ast.Name)
                  and node.args[0].id == "self" and isinstance(node.args[1], ast.Constant)
                  and isinstance(node.args[1].value, str)):  # object.__setattr__(self, "_x", ...)
                attributes.add(node.args[1].value)
    return OwnNames(frozenset(filter(_private, names)), frozenset(filter(_private, attributes)))


def _called(node: ast.AST) -> str | None:
    """The name a call calls (``f`` in ``f(...)`` and ``obj.f(...)``); None for anything but a call."""
    if not isinstance(node, ast.Call):
        return None
    return node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)


# Who an attribute is reached through (see the comment that opens this section).
_OWN_OBJECT, _SHARDADOPT_NAME, _UPSTREAM_NAME, _OTHER_MODULE, _ANY_OBJECT, _NO_OBJECT = range(6)


def private_upstream_uses(tree: ast.AST, own: OwnNames, upstream_names: frozenset[str]) -> list[tuple[int, str]]:
    """(line, name) for each private upstream name in ``tree``, as the comment that opens this section tells them
    from shardadopt's own: ``obj._x`` (``obj`` a parameter, a local, an attribute chain, an upstream module),
    ``getattr(obj, "_x")``, imports of ``_x`` or of a private upstream module, and strings naming one
    (``Target(.., "Trainer._x")``)."""
    # Names this file binds to modules and objects: upstream's (``import torch.distributed as dist``, ``from
    # transformers import Trainer``), shardadopt's, and other modules (``os._exit``, ``sys._getframe``: the standard
    # library's business).
    bound: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                root = alias.name.split(".")[0]
                bound[alias.asname or root] = (_UPSTREAM_NAME if root in UPSTREAM_PACKAGES else
                                               _SHARDADOPT_NAME if root == "shardadopt" else _OTHER_MODULE)
        elif isinstance(node, ast.ImportFrom):
            root = (node.module or "").split(".")[0]
            if root in UPSTREAM_PACKAGES or root == "shardadopt" or node.level:
                kind = _UPSTREAM_NAME if root in UPSTREAM_PACKAGES else _SHARDADOPT_NAME
                bound.update((a.asname or a.name, kind) for a in node.names)
    # ``self`` and ``cls`` inside a method (a function whose first parameter is one of them: ``self = cls.__new__(cls)``
    # in a classmethod too), not a loop variable that happens to be called ``cls``.
    own_receivers: set[int] = set()
    for node in ast.walk(tree):
        if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and node.args.args
                and node.args.args[0].arg in _SELF):
            own_receivers.update(id(n) for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in _SELF)

    def receiver(obj: ast.AST) -> int:
        chain = []
        while isinstance(obj, ast.Attribute):
            chain.append(obj.attr)
            obj = obj.value
        if not isinstance(obj, ast.Name):
            return _ANY_OBJECT
        if id(obj) in own_receivers and all(a in own.names or a in own.attributes for a in chain):
            return _OWN_OBJECT  # self, or self._inner where shardadopt set _inner
        kind = bound.get(obj.id, _ANY_OBJECT)
        return _ANY_OBJECT if kind == _SHARDADOPT_NAME and chain else kind

    def foreign(name: str, through: int) -> bool:
        if not _private(name) or name.startswith("_shardadopt") or through == _OTHER_MODULE:
            return False
        if through == _UPSTREAM_NAME:
            return True
        mine = name in own.names or through in (_OWN_OBJECT, _NO_OBJECT) and name in own.attributes
        return not mine or through not in (_OWN_OBJECT, _SHARDADOPT_NAME) and name in upstream_names

    skipped: set[int] = set()  # docstrings, f-string pieces, str.startswith("_x") affixes
    attribute_strings: dict[int, ast.AST] = {}  # getattr(obj, "_x"): the string's receiver
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)):
            skipped.add(id(body[0].value))
        if isinstance(node, ast.JoinedStr):
            skipped.update(id(v) for v in node.values)
        if _called(node) in _AFFIX_METHODS:
            skipped.update(id(a) for a in node.args)
        if _called(node) in _ATTRIBUTE_CALLS and len(node.args) >= 2:
            attribute_strings[id(node.args[1])] = node.args[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and foreign(node.attr, receiver(node.value)):
            found.append((node.lineno, node.attr))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for module in modules:
                parts = module.split(".")
                if parts[0] in UPSTREAM_PACKAGES and any(_private(p) for p in parts):
                    found.append((node.lineno, f"import of {module}"))
            if isinstance(node, ast.ImportFrom) and not node.level and not (node.module or "").startswith("shardadopt"):
                through = _UPSTREAM_NAME if (node.module or "").split(".")[0] in UPSTREAM_PACKAGES else _NO_OBJECT
                found.extend((node.lineno, a.name) for a in node.names if foreign(a.name, through))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skipped
              and all(p.isidentifier() for p in node.value.split("."))):
            through = receiver(attribute_strings[id(node)]) if id(node) in attribute_strings else _NO_OBJECT
            found.extend((node.lineno, repr(node.value)) for p in node.value.split(".") if foreign(p, through))
    return sorted(set(found))


def _python_files(folders: Iterable[str]) -> list[pathlib.Path]:
    return [p for folder in folders for p in sorted((REPO / folder).rglob("*.py"))]


@pytest.fixture(scope="module")
def own_names() -> OwnNames:
    return own_private_names(ast.parse(p.read_text()) for p in _python_files(OWN_DEFINITIONS))


@pytest.fixture(scope="module")
def upstream_names() -> frozenset[str]:
    return upstream_private_names()


def test_no_private_upstream_names_outside_upstream_module(own_names, upstream_names):
    offending = []
    for path in _python_files(SCANNED):
        relative = path.relative_to(REPO).as_posix()
        if (relative.startswith(ACCESSOR_MODULE)
                or relative == pathlib.Path(__file__).resolve().relative_to(REPO).as_posix()):
            continue
        source = path.read_text()
        lines = [""] + source.splitlines()
        offending += [f"{relative}:{line}: {name}"
                      for line, name in private_upstream_uses(ast.parse(source), own_names, upstream_names)
                      if not (relative.startswith("tests/") and TEST_EXCUSE in lines[line] + lines[line - 1])]
    assert not offending, f"private upstream names outside {ACCESSOR_MODULE} ({FIX}):\n" + "\n".join(offending)


@pytest.mark.parametrize("source", [
    "models = accelerator._models\n",
    "multi = study._is_multi_objective()\n",
    "mesh = getattr(model, '_device_mesh', None)\n",
    "from torch.distributed.tensor._utils import compute\n",
    "from torch.distributed.tensor.placement_types import _StridedShard\n",
    "import torch.distributed._composable.fsdp\n",
    "target = Target('transformers.trainer', 'Trainer._save_checkpoint')\n",
    # shardadopt has a ``_world()`` of its own; torch's ``_world`` is still torch's
    "import torch.distributed as dist\ngroups = dist.distributed_c10d._world.pg_map\n",
    "from transformers import Trainer\nTrainer._get_output_dir\n",
    # objects that arrive as parameters: shardadopt's heartbeat keeps a ``self._storage``, Optuna's study has one too
    "def record(study, trial):\n    study._storage.set_trial_user_attr(trial._trial_id, 'k', 1)\n",
    "def heartbeat(trial):\n    return trial.study._storage\n",
    # upstream's names that shardadopt's patch wrappers are named after
    "def probe(config, accelerator):\n    config._validate_accelerator(accelerator)\n",
    "def _validate_accelerator(wrapped, instance, args, kwargs):\n    pass\n"
    "wrappers = {Target('accelerate.parallelism_config', 'ParallelismConfig._validate_accelerator'): 1}\n",
    "def probe(router):\n    return hasattr(router, '_prepare_output_fn')\n",
    "for cls in layers:\n    hook = inspect.getattr_static(cls, '_prepare_input_fn', None)\n",
    "hasattr(getattr(tensor_parallel, 'RouterParallel', None), '_prepare_output_fn')\n",
])
def test_private_names_are_found(own_names, upstream_names, source):
    """The check above catches each kind of use even with every private name shardadopt defines taken as its own."""
    assert private_upstream_uses(ast.parse(source), own_names, upstream_names)


def test_upstream_private_names_are_read_from_sources(upstream_names):
    """Names each upstream package defines (a method, a module-level function, an instance attribute, a C function
    in a stub), and none that only shardadopt defines."""
    assert {"_validate_accelerator", "_report_to_hp_search", "_get_default_group", "_local_tensor",
            "_foreach_norm", "_is_multi_objective"} <= upstream_names
    assert "_shardadopt_patched" not in upstream_names and "_is_multi_cpu" not in upstream_names


def test_own_private_names_are_not_found(own_names, upstream_names):
    """shardadopt's own private names, among them ones upstream defines too, reached through shardadopt's objects."""
    source = textwrap.dedent("""\
        from shardadopt import upstream
        class _View:
            def __init__(self, a):
                object.__setattr__(self, '_inner', a)
                self._lock = None
            def get(self):
                return self._inner, getattr(self, '_shardadopt_mark', None), self._lock
            @classmethod
            def _started(cls):
                self = cls.__new__(cls)
                self._setup()
            def _setup(self):
                upstream._setup()
        ok = name.endswith('_size') and f'_run_{name}'
        """)
    tree = ast.parse(source)
    assert {"_lock", "_setup"} <= upstream_names  # torch's and transformers' names too
    assert private_upstream_uses(tree, own_names | own_private_names([tree]), upstream_names) == []


def test_trainer_replicated_sync():
    import inspect

    sync = upstream.trainer_replicated_sync()
    if sync is None:
        pytest.skip(f"transformers {installed_version('transformers')}'s Trainer has no replicated-parameter sync")
    # the attribute leave_out_of_trainer_replicated_sync sets is the one the sync checks before hooking a parameter
    param = torch.nn.Parameter(torch.zeros(1))
    upstream.leave_out_of_trainer_replicated_sync(param)
    flags = [name for name in vars(param) if name in inspect.getsource(sync)]
    assert flags, f"the Trainer's sync reads none of {sorted(vars(param))}: {inspect.getsource(sync)[:400]}"


def test_experts_implementation(tiny_models):
    from transformers import AutoConfig, AutoModelForCausalLM

    assert upstream.experts_implementation(object()) is None
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_models["qwen3moe"]))
    assert upstream.experts_implementation(model.config) not in (None, "deepgemm_megamoe")


def test_model_no_split_modules():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    assert upstream.model_no_split_modules(torch.nn.Linear(1, 1)) is None
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
            text_config={"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                         "num_key_value_heads": 1, "intermediate_size": 16, "vocab_size": 32},
            vision_config={"depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 16,
                           "out_hidden_size": 16}))
    blocks = upstream.model_no_split_modules(model.model.visual)
    assert blocks and type(model.model.visual.blocks[0]).__name__ in blocks, blocks


def test_context_parallel_names():
    """torch's ring attention: the dispatcher hooks torch-cp-cpu-flash-attention wraps, its handler table and
    templated ring functions, the strategy helpers, and the SDPA kernels they name."""
    import importlib

    assert upstream.CP_ATTENTION_MODULE.endswith("._attention")
    importlib.import_module(upstream.CP_SHARDING_RULES_MODULE)
    for target in (upstream.CP_ENABLE_DISPATCHER, upstream.CP_DISABLE_DISPATCHER):
        assert upstream.upstream_method(target, "test").__name__ == target.qualname
    kernels = upstream.sdpa_flash_kernels()
    assert kernels["cuda"] in upstream.cp_custom_ops()
    assert callable(upstream.cp_templated_ring_attention())
    assert callable(upstream.cp_templated_ring_attention_backward())
    assert upstream.cp_load_balanced() is True  # torch's default outside a context: head-tail chunks
    assert callable(upstream.cp_register_sharding_rules())
    assert isinstance(upstream.cp_single_dim_strategies(), bool)
    if upstream.cp_single_dim_strategies():
        assert upstream.sharding_placeholder(2).dim == 2
    else:  # torch 2.13: whole OpStrategy functions, expanded over the mesh by upstream's helper
        assert callable(upstream.expand_to_full_mesh_op_strategy)
    handlers = upstream.dtensor_custom_op_handlers()
    upstream.set_dtensor_custom_op_handlers(handlers)
    assert upstream.dtensor_custom_op_handlers() is handlers
    assert upstream.dtensor_op_dispatcher() is not None
    context = upstream.cp_strategy_context(kernels["cpu"], lambda *args: None)
    context.__enter__()
    context.__exit__(None, None, None)


def test_attach_context_parallel_hooks():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    upstream.attach_context_parallel_hooks(model)
    assert upstream.module_forward_pre_hooks(model.model.layers[0].self_attn)


# -- maybe_distribute_model: one binding for the patches that wrap it --------------------------------------------------

def test_maybe_distribute_model():
    """``upstream.MAYBE_DISTRIBUTE_MODEL`` is the classmethod ``from_pretrained`` calls as ``(model,
    distributed_config, <mesh>)``, the mesh parameter named ``device_mesh`` before 5.18 and ``mesh_manager`` from
    5.18 on, and ``upstream.bind_maybe_distribute_model`` gives a wrapper the three arguments by meaning, passed
    positionally or by keyword, through the stack of shardadopt's own wrappers on it."""
    import wrapt

    import shardadopt

    shardadopt.enable()
    try:
        from transformers import modeling_utils
        from transformers.distributed.mixin import DistributedMixin

        assert upstream.upstream_method(upstream.MAYBE_DISTRIBUTE_MODEL, "test")
        method = DistributedMixin.maybe_distribute_model  # bound to the class, as a wrapper's ``wrapped`` is
        names = list(inspect.signature(method).parameters)
        third = "mesh_manager" if _transformers_at_least("5.18") else "device_mesh"
        assert names == ["model", "distributed_config", third], names
        assert re.search(rf"maybe_distribute_model\(model, distributed_config, {third}\)",
                         inspect.getsource(modeling_utils)), "from_pretrained no longer calls it positionally"

        seen = []

        def record(wrapped, instance, args, kwargs):  # outside every patch's wrapper; upstream is not called
            seen.append(upstream.bind_maybe_distribute_model(wrapped, args, kwargs))
            return args[0] if args else kwargs["model"]

        class Recorded(DistributedMixin):
            maybe_distribute_model = wrapt.FunctionWrapper(DistributedMixin.__dict__["maybe_distribute_model"],
                                                           record)

        model, config, mesh = object(), SimpleNamespace(tp_size=2), object()
        assert Recorded.maybe_distribute_model(model, config, mesh) is model
        Recorded.maybe_distribute_model(model, distributed_config=config, **{third: mesh})
        Recorded.maybe_distribute_model(model=model, distributed_config=config, **{third: None})
        assert [(c.model, c.distributed_config, c.mesh, c.shards) for c in seen] == [
            (model, config, mesh, True), (model, config, mesh, True), (model, config, None, False)]
        with pytest.raises(TypeError):
            upstream.bind_maybe_distribute_model(method, (model, config), {"mesh": mesh})
        stand_in = lambda *args, **kwargs: None  # noqa: E731  (a test's stand-in for upstream: upstream's order)
        assert upstream.bind_maybe_distribute_model(stand_in, (model,), {"distributed_config": config, third: mesh}
                                                    ) == upstream.DistributeArguments(model, config, mesh)
        # the real stack, called as from_pretrained calls it for a load that shards nothing: the model comes back
        assert DistributedMixin.maybe_distribute_model(model, None, None) is model
    finally:
        shardadopt.disable()
