"""Probes fail loudly: an upstream they cannot read is ``unsupported`` (and ``doctor`` exits 1), never ``not-needed``.

Each case replaces one upstream function a probe reads with a copy of the installed one that has one name changed (the
harmless rename that used to turn text-searching probes into ``not-needed``), or with a function of another shape,
and checks the registry then reports the patch ``unsupported`` with the probe's reason. The replacements are undone
after each test (``monkeypatch``); they run on both dependency sets.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import itertools
import json
import logging
import textwrap

import pytest

from shardadopt import cli, upstream
from shardadopt.patches import ALL_PATCHES
from shardadopt.patching.registry import APPLIED, NOT_NEEDED, UNSUPPORTED, Registry
from shardadopt.testing.patching import probe_state as state_of
from shardadopt.upstream.probing import Undecided

_files = itertools.count()


def renamed(owner, name: str, replacements: dict[str, str], tmp_path):
    """A copy of upstream ``owner.name`` with each ``old`` name replaced by ``new`` (in upstream's own globals)."""
    raw = inspect.getattr_static(owner, name)
    function = inspect.unwrap(raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw)
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    tree.body[0].decorator_list = []
    source = ast.unparse(tree)
    changed = source
    for old, new in replacements.items():
        changed = changed.replace(old, new)
    assert changed != source, f"none of {list(replacements)} occurs in {owner.__name__}.{name}"
    path = tmp_path / f"renamed_{next(_files)}.py"
    path.write_text(changed + "\n")
    namespace = dict(function.__globals__)
    exec(compile(changed, str(path), "exec"), namespace)  # noqa: S102  (a test double of upstream's own code)
    copy = namespace[function.__name__]
    return type(raw)(copy) if isinstance(raw, (staticmethod, classmethod)) else copy




def _owner(path: str):
    module, _, attribute = path.partition(":")
    owner = importlib.import_module(module)
    return getattr(owner, attribute) if attribute else owner


# (patch id, owner, function, renames): each rename hits the installed 5.15 and 5.24 sources.
RENAMES = [
    ("accelerate-adopt-sharded-model", "accelerate.accelerator:Accelerator", "prepare_model",
     {"MULTI_CPU": "MULTI_HOST"}),
    ("accelerate-sharded-checkpoint", "accelerate.accelerator:Accelerator", "get_state_dict",
     {"model.state_dict()": "model.local_state_dict()"}),
    # upstream-private: the names these probes read, renamed to simulate an upstream change
    ("trainer-adopt-sharded-model", "transformers.trainer:Trainer", "_prepare_for_training",
     {"self.create_optimizer()": "self.build_optimizer()"}),
    ("trainer-adopt-sharded-model", "transformers.trainer:Trainer", "__init__",
     {"place_model_on_device = False": "place_model_on_device = None"}),
    ("trainer-model-init-parallelism", "transformers.trainer:Trainer", "__init__",
     {"self.create_accelerator_and_postprocess()": "self.build_accelerator()"}),
    ("trainer-hpo-optuna", "transformers.integrations.integration_utils", "run_hp_search_optuna",
     {"FixedTrial": "FrozenTrial"}),
    ("transformers-ep-grouped-mm-sentinel", "transformers.integrations.moe", "grouped_mm_experts_forward",
     # upstream-private: as above
     {"_grouped_linear": "_grouped_gemm"}),
    ("transformers-sharding-sizes", "transformers.distributed.mixin:DistributedMixin", "maybe_distribute_model",
     # upstream-private: as above
     {"_device_mesh": "_mesh"}),
    ("transformers-reuse-device-mesh", "transformers.distributed.mixin:DistributedMixin", "prepare_distribute_model",
     {"initialize_distributed_mesh": "build_meshes", "initialize_fully_sharded_data_parallelism": "init_fsdp"}),
    # upstream-private: as above
    ("transformers-tp-sampling-agreement", "transformers.generation.utils:GenerationMixin", "_sample",
     {"multinomial": "categorical"}),
    ("transformers-sharded-transpose-check", "transformers.core_model_loading:Transpose", "convert",
     {"get_parameter": "get_submodule"}),
    ("transformers-tp-heads-refused", "transformers.distributed.mixin:DistributedMixin", "maybe_distribute_model",
     {"apply_tensor_parallelism(": "shard_tensors("}),
    ("trl-grpo-data-parallel", "trl.trainer.grpo_trainer:GRPOTrainer", "__init__",
     {"device_specific=True": "per_process=True"}),
    ("trl-rloo-data-parallel", "trl.trainer.rloo_trainer:RLOOTrainer", "__init__",
     {"device_specific=True": "per_process=True"}),
    ("trl-distillation-data-parallel", "trl.trainer.distillation_trainer:DistillationTrainer", "__init__",
     {"device_specific=True": "per_process=True"}),
    # upstream-private: as above
    ("trl-distillation-plain-tp-head", "trl.trainer.distillation_trainer:DistillationTrainer", "_compute_loss",
     {"get_output_embeddings": "get_lm_head"}),
]


@pytest.mark.parametrize("pid,owner,name,renames", RENAMES, ids=[f"{c[0]}:{c[2]}" for c in RENAMES])
def test_a_renamed_upstream_name_is_unsupported_not_not_needed(pid, owner, name, renames, tmp_path, monkeypatch):
    target = _owner(owner)
    before = state_of(pid)[0]
    assert before in (APPLIED, NOT_NEEDED)
    monkeypatch.setattr(target, name, renamed(target, name, renames, tmp_path))
    state, reason = state_of(pid)
    assert state == UNSUPPORTED, f"{pid} said {state} ({reason}) on a renamed {name}"
    assert "probe could not decide" in reason and "found neither" in reason, reason


def test_sampling_probe_finds_a_generate_that_shares_the_random_state(tmp_path, monkeypatch):
    """The fix's shape (upstream-fixes/transformers-tp-sampling-agreement.diff sets the group's random state in
    generate) reads as not-needed."""
    from transformers.generation.utils import GenerationMixin

    call = "self._validate_model_kwargs(model_kwargs.copy())"
    shared = renamed(GenerationMixin, "generate", {call: f"{call}\n    torch.set_rng_state(torch.get_rng_state())"},
                     tmp_path)
    monkeypatch.setattr(GenerationMixin, "generate", shared)
    state, reason = state_of("transformers-tp-sampling-agreement")
    assert state == NOT_NEEDED and "set_rng_state" in reason, reason


def test_tp_heads_probe_finds_a_load_that_checks_the_heads(tmp_path, monkeypatch):
    """The fix's shape (upstream-fixes/transformers-tp-heads-refused.diff checks the heads before applying tensor
    parallelism; upstream would likely reuse get_kv_heads_per_rank) reads as not-needed."""
    from transformers.distributed.mixin import DistributedMixin

    checked = renamed(DistributedMixin, "maybe_distribute_model",
                      {"apply_tensor_parallelism(": "get_kv_heads_per_rank and apply_tensor_parallelism("}, tmp_path)
    monkeypatch.setattr(DistributedMixin, "maybe_distribute_model", checked)
    state, reason = state_of("transformers-tp-heads-refused")
    assert state == NOT_NEEDED and "get_kv_heads_per_rank" in reason, reason


def _generate_encoder_method():
    """generate's image encoding before the prefill (transformers 5.18+); skips where there is none."""
    from shardadopt import upstream

    try:
        return upstream.upstream_method(upstream.GENERATION_PREPARE_MULTIMODAL_ENCODER, "test").__name__
    except Undecided:
        pytest.skip("this transformers encodes no images in generate before the prefill (before 5.18)")


@pytest.mark.parametrize(("replacements", "expected", "said"), [
    ({"f'get_": "f'fetch_"}, UNSUPPORTED, "found neither"),
    ({"keys_to_pop = set()": "keys_to_pop = set()\n    self.unshard()"},
     NOT_NEEDED, "unshard"),
], ids=["no-feature-call", "gathers"])
def test_generate_encoder_probe_reads_the_encoding(replacements, expected, said, tmp_path, monkeypatch):
    """A renamed feature call is unknown (unsupported); an encoding that gathers the FSDP units itself (the fix's
    shape, upstream-fixes/transformers-fsdp-generate-encoder-unshard.diff) reads as not-needed."""
    from transformers.generation.utils import GenerationMixin

    name = _generate_encoder_method()
    monkeypatch.setattr(GenerationMixin, name, renamed(GenerationMixin, name, replacements, tmp_path))
    state, reason = state_of("transformers-fsdp-generate-encoder-unshard")
    assert state == expected and said in reason, reason


def test_transpose_check_probe_finds_a_check_against_the_local_shard(tmp_path, monkeypatch):
    """The fix's shape (upstream-fixes/transformers-sharded-transpose-check.diff also compares with the local shard's
    shape) reads as not-needed."""
    from transformers.core_model_loading import Transpose

    check = "tensor.shape == expected_shape"
    local = renamed(Transpose, "convert", {check: f"{check} or tensor.shape == param.to_local().shape"}, tmp_path)
    monkeypatch.setattr(Transpose, "convert", local)
    state, reason = state_of("transformers-sharded-transpose-check")
    assert state == NOT_NEEDED and "shard's shape" in reason, reason


@pytest.mark.parametrize("body,expected", [
    ('    _tied_weights_keys = {"lm_head.weight": "model.language_model.embed_tokens.weight"}\n', APPLIED),
    ('    _tied_weights_keys = {"lm_head.weight": "model.language_model.embed_tokens.weight"}\n'
     '    _tp_plan = {"lm_head": "colwise_gather_output"}\n', NOT_NEEDED),
    ("    pass\n", UNSUPPORTED),  # neither a tied head nor a plan for it: a class the probe cannot read
])
def test_tied_head_probe_reads_the_representative_class_body(body, expected, tmp_path, monkeypatch):
    """transformers-tp-tied-lm-head reads Gemma3ForConditionalGeneration's class body from the installed source: the
    gap (a tied head, no plan entry: 5.15-5.19), the fix (5.20+), or a shape it does not know."""
    import shardadopt.upstream.probing
    from shardadopt.patches import transformers_tp_tied_lm_head as tied

    source = tmp_path / "modeling_gemma3.py"
    source.write_text(f"class {tied.REPRESENTATIVE_CLASS}:\n{body}")
    monkeypatch.setattr(shardadopt.upstream.probing, "package_file",
                        lambda package, *parts: str(source) if parts == tied.REPRESENTATIVE else None)
    state, reason = state_of(tied.PATCH.id)
    assert state == expected, reason


@pytest.mark.parametrize("pid,owner,counts,counted,by_dp", [
    ("trl-grpo-data-parallel", "trl.trainer.grpo_trainer:GRPOTrainer", upstream.GRPO_SCORE, "process_index",
     "data_parallel_rank"),
    ("trl-rloo-data-parallel", "trl.trainer.rloo_trainer:RLOOTrainer", upstream.RLOO_SCORE, "process_index",
     "data_parallel_rank"),
    ("trl-distillation-data-parallel", "trl.trainer.distillation_trainer:DistillationTrainer",
     upstream.DISTILLATION_TRAIN_SAMPLER, "num_processes", "data_parallel_size")])
def test_trl_seeding_probe_finds_a_trainer_that_seeds_by_data_parallel_rank(pid, owner, counts, counted, by_dp,
                                                                          tmp_path, monkeypatch):
    """The fix's shape (upstream-fixes/trl-*-data-parallel.diff seeds by ``dp_rank`` and slices or sizes by the
    data-parallel rank or size) reads as not-needed; either half left as upstream has it reads as needed, naming it."""
    pytest.importorskip("trl")
    target = _owner(owner)
    fixed_init = renamed(target, "__init__",
                         {"set_seed(args.seed, device_specific=True)": "set_seed(args.seed + dp_rank)"}, tmp_path)
    method = counts.qualname.rsplit(".", 1)[1]
    fixed_counts = renamed(target, method, {f"self.accelerator.{counted}": f"self.{by_dp}"}, tmp_path)
    monkeypatch.setattr(target, "__init__", fixed_init)
    state, reason = state_of(pid)
    assert state == APPLIED and f"counts by accelerator.{counted}" in reason, reason
    monkeypatch.setattr(target, method, fixed_counts)
    state, reason = state_of(pid)
    assert state == NOT_NEEDED and "data-parallel rank" in reason, reason


def test_distillation_head_probe_finds_a_trainer_that_checks_the_head_rows(tmp_path, monkeypatch):
    """The fix's shape (upstream-fixes/trl-distillation-plain-tp-head.diff compares the LM head's rows with
    vocab_size in ``__init__``) reads as not-needed."""
    pytest.importorskip("trl")
    from trl.trainer.distillation_trainer import DistillationTrainer

    line = "model_init_kwargs = dict(args.model_init_kwargs or {})"
    check = "\n    assert model.get_output_embeddings().weight.shape[0] == model.config.vocab_size"
    monkeypatch.setattr(DistillationTrainer, "__init__",
                        renamed(DistillationTrainer, "__init__", {line: line + check}, tmp_path))
    state, reason = state_of("trl-distillation-plain-tp-head")
    assert state == NOT_NEEDED and "fewer rows" in reason, reason


def test_the_expert_grad_scale_probe_reads_the_function_the_mixin_calls(tmp_path, monkeypatch):
    from transformers.distributed import fsdp, mixin

    name = "apply_fully_sharded_data_parallelism"
    copy = renamed(fsdp, name, {"fully_shard(": "shard_fully(", "set_force_sum_reduction_for_comms": "set_sum"},
                   tmp_path)
    monkeypatch.setattr(fsdp, name, copy)
    monkeypatch.setattr(mixin, name, copy)
    state, reason = state_of("transformers-ep-expert-grad-scale")
    assert state == UNSUPPORTED and "found neither" in reason, reason


def test_a_deleted_upstream_method_makes_doctor_fail(monkeypatch, capsys):
    """The issue's "Done when": rename (here: remove) one upstream function a probe depends on."""
    from transformers.trainer import Trainer

    cli.doctor(as_json=True)
    before = json.loads(capsys.readouterr().out)
    assert before["ok"], before
    assert {p["id"]: p["state"] for p in before["patches"]}["trainer-adopt-sharded-model"] in (APPLIED, NOT_NEEDED)
    # upstream-private: the method the probe reads, deleted
    monkeypatch.delattr(Trainer, "_prepare_for_training")
    assert cli.doctor(as_json=True) == 1
    after = {p["id"]: p for p in json.loads(capsys.readouterr().out)["patches"]}
    adopt = after["trainer-adopt-sharded-model"]
    assert adopt["state"] == UNSUPPORTED
    assert "Trainer._prepare_for_training does not exist" in adopt["reason"], adopt["reason"]


# -- shapes the probes have never seen, one per probe that runs upstream code --------------------------------------

def test_cpu_parallelism_probe_refuses_an_unknown_refusal(monkeypatch):
    from accelerate.parallelism_config import ParallelismConfig

    def validate(self, accelerator):
        raise ValueError("ParallelismConfig needs a GPU")

    # upstream-private: the method the probe runs, replaced
    monkeypatch.setattr(ParallelismConfig, "_validate_accelerator", validate)
    state, reason = state_of("accelerate-cpu-parallelism-config")
    assert state == UNSUPPORTED and "ParallelismConfig needs a GPU" in reason, reason


def test_trainer_checkpoint_probe_refuses_an_optimizer_save_it_does_not_know(monkeypatch):
    from transformers.trainer import Trainer

    def save_optimizer_and_scheduler(self, output_dir):  # e.g. a DCP save under another name
        self.save_sharded_optimizer(output_dir)

    # upstream-private: the method the probe reads, replaced
    monkeypatch.setattr(Trainer, "_save_optimizer_and_scheduler", save_optimizer_and_scheduler)
    state, reason = state_of("trainer-sharded-checkpoint")
    assert state == UNSUPPORTED and "save_sharded_optimizer" in reason, reason

    def writes_nothing(self, output_dir):
        return None

    # upstream-private: as above
    monkeypatch.setattr(Trainer, "_save_optimizer_and_scheduler", writes_nothing)
    state, reason = state_of("trainer-sharded-checkpoint")
    assert state == UNSUPPORTED and "found neither" in reason, reason


def test_tp_grad_accumulation_probe_refuses_an_installer_that_reduces_nothing(monkeypatch):
    from shardadopt.patches import transformers_tp_replicated_grad_accumulation as patch

    style = importlib.import_module(patch.MODULE).ReplicatedWithGradAllReduce
    monkeypatch.setattr(style, patch.METHOD, lambda self, module, mesh, **kwargs: module)
    state, reason = state_of(patch.PATCH.id)
    assert state == UNSUPPORTED and "neither each gradient reduced once" in reason, reason


def _scores_hook(transform):
    """A router hook of upstream's signature that returns ``transform(scores, non-local mask)``."""
    def hook(module, outputs, mesh):
        logits, scores, indices = outputs
        non_local = (indices // (module.num_experts // mesh.size())) != mesh.get_local_rank()
        return logits, transform(scores, non_local), indices
    return hook


def test_router_probe_reads_the_hooks_autograd_graph():
    import torch

    from shardadopt.patches.transformers_ep_router_grad import probe_hook

    class SumOverGroup(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return grad

    class Detour(SumOverGroup):
        pass

    masked = probe_hook(_scores_hook(lambda s, m: s.masked_fill(m, 0.0)))
    assert masked.needed, masked.reason
    summed = probe_hook(_scores_hook(lambda s, m: SumOverGroup.apply(s).masked_fill(m, 0.0)))
    assert not summed.needed, summed.reason
    for unknown in (lambda s, m: s * (~m),  # a mask that is not masked_fill
                    lambda s, m: Detour.apply(s).masked_fill(m, 0.0),  # a custom Function it does not know
                    lambda s, m: s.detach().masked_fill(m, 0.0)):  # a graph that does not reach the scores
        with pytest.raises(Undecided, match="found neither"):
            probe_hook(_scores_hook(unknown))


def test_every_patch_is_decided_on_the_installed_release():
    """No patch is ``unsupported`` on a release of the supported range (the matrix test checks which state)."""
    registry = Registry(ALL_PATCHES)
    for module in {m for p in ALL_PATCHES for m in p.modules}:
        importlib.import_module(module)
    try:
        statuses = registry.enable()
    finally:
        registry.disable()
    undecided = {s.id: s.reason for s in statuses if s.state not in (APPLIED, NOT_NEEDED)}
    assert not undecided, undecided


def test_state_changes_are_logged_once_on_rank_zero(caplog, monkeypatch):
    for module in {m for p in ALL_PATCHES for m in p.modules}:
        importlib.import_module(module)
    registry = Registry(ALL_PATCHES)
    with caplog.at_level(logging.INFO, logger="shardadopt"):
        statuses = registry.enable()
        registry.enable()  # nothing changes: nothing logged
        registry.disable()
    lines = [r.getMessage() for r in caplog.records if r.name == "shardadopt"]
    for status in statuses:  # off -> pending -> decided -> off: three changes, one line each
        own = [line for line in lines if line.startswith(f"{status.id}: ")]
        assert len(own) == 3 and own[0].startswith(f"{status.id}: pending (waiting for"), own
        assert own[1:] == [f"{status.id}: {status.state} ({status.reason})", f"{status.id}: off (disabled)"], own
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "shardadopt")

    caplog.clear()
    monkeypatch.setenv("RANK", "1")
    other_rank = Registry(ALL_PATCHES)
    with caplog.at_level(logging.INFO, logger="shardadopt"):
        other_rank.enable()
        other_rank.disable()
    assert not [r for r in caplog.records if r.name == "shardadopt"], "ranks other than 0 log nothing"


def test_the_package_adds_only_a_null_handler():
    handlers = logging.getLogger("shardadopt").handlers
    assert handlers and all(isinstance(h, logging.NullHandler) for h in handlers), handlers


# -- probes answer from the shape they know, not from the absence of another -----------------------------------------

def test_accelerate_adopt_probe_refuses_an_adoption_path_it_does_not_know(tmp_path, monkeypatch):
    """An upstream ``prepare_model`` that returns a model transformers sharded while loading, before the MULTI_CPU
    DDP wrap the probe reads: that wrap no longer says the patch is needed."""
    from accelerate.accelerator import Accelerator

    adopts = {"if device_placement is None:": "if getattr(model.config, 'distributed_config', None) is not None:\n"
                                              "        return model\n    if device_placement is None:"}
    monkeypatch.setattr(Accelerator, "prepare_model", renamed(Accelerator, "prepare_model", adopts, tmp_path))
    state, reason = state_of("accelerate-adopt-sharded-model")
    assert state == UNSUPPORTED and "distributed_config" in reason and "found neither" in reason, reason


def test_trainer_adopt_probe_refuses_a_reshard_it_does_not_know(monkeypatch):
    """A ``.reshard()`` before the optimizer that is not the fix's (every module, no FSDPModule test, no test of
    load-time sharding): neither the broken shape nor the fix."""
    from transformers.trainer import Trainer

    def prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        for module in self.model.modules():
            module.reshard()
        self.create_optimizer()

    # upstream-private: the method the probe reads, replaced
    monkeypatch.setattr(Trainer, "_prepare_for_training", prepare_for_training)
    state, reason = state_of("trainer-adopt-sharded-model")
    assert state == UNSUPPORTED and "reshard of load-time-sharded FSDPModules" in reason, reason


def test_fsdp_tp_probe_refuses_fsdp_or_tp_without_2d_loading(monkeypatch):
    """FSDP in an ``if`` of its own is not 2-D loading when TP does not come before it in the same block (here one
    excludes the other): the probe must not call that fixed."""
    from transformers.distributed import DistributedConfig, mixin

    try:
        DistributedConfig(fsdp_size=2, tp_size=2)
    except ValueError:
        pytest.skip("this transformers refuses fsdp_size with tp_size in DistributedConfig: the probe reads no source")

    def maybe_distribute_model(cls, model, distributed_config, mesh_manager):
        if distributed_config.fsdp_size > 1:
            model = mixin.apply_fully_sharded_data_parallelism(model, mesh_manager)
            return model
        return mixin.apply_tensor_parallelism(model, mesh_manager.get_mesh("tp"))

    monkeypatch.setattr(mixin.DistributedMixin, "maybe_distribute_model", classmethod(maybe_distribute_model))
    state, reason = state_of("transformers-fsdp-tp-refused")
    assert state == UNSUPPORTED and "TP then FSDP in separate ifs" in reason, reason


AGENT_STORE_RETURN = ("return TCPStore(host_name=hostname, port=port, world_size=world_size, is_master=False, "
                      "timeout=timeout)")


@pytest.mark.parametrize("replacement,expected", [
    # the fix (upstream-fixes/fixes/torch_elastic_attempt_store.py): a prefix every rank agreed on
    ("return PrefixStore(f'/worker/attempt_{agree(rank)}/', TCPStore(host_name=hostname, port=port))", NOT_NEEDED),
    # the shape pytorch#135712 reverted: a prefix from the agent's own restart count, which nodes disagree on
    ("return PrefixStore(f\"/worker/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}\", TCPStore(hostname, port))",
     APPLIED),
], ids=["job-wide-prefix", "per-agent-prefix"])
def test_attempt_store_probe_reads_the_agent_store_branch(replacement, expected, tmp_path, monkeypatch):
    from shardadopt import upstream

    factory = upstream.c10d_store_factory()
    module = inspect.getmodule(factory)
    # upstream-private: the store factory the probe reads, replaced by the fixed (or half-fixed) shape
    name = "_create_c10d_store"
    monkeypatch.setattr(module, name, renamed(module, name, {AGENT_STORE_RETURN: replacement}, tmp_path))
    state, reason = state_of("torch-elastic-attempt-store")
    assert state == expected, reason


def test_attempt_store_probe_refuses_a_branch_it_does_not_know(tmp_path, monkeypatch):
    from shardadopt import upstream

    module = inspect.getmodule(upstream.c10d_store_factory())
    # upstream-private: the agent-store check renamed to a name torch does not define
    checks = {check: "_agent_store_wanted" for check in upstream.AGENT_STORE_CHECKS}
    # upstream-private: as above, the store factory the probe reads
    name = "_create_c10d_store"
    monkeypatch.setattr(module, name, renamed(module, name, checks, tmp_path))
    state, reason = state_of("torch-elastic-attempt-store")
    assert state == UNSUPPORTED and "found neither" in reason, reason


@pytest.mark.parametrize("replacement,expected", [
    (None, APPLIED),  # the installed torch: pickle.load
    # torch reading .metadata with its weights-only unpickler: a class outside its allow-list is refused
    ("torch.load(metadata_file, weights_only=True)", NOT_NEEDED),
    # a reader that neither unpickles the file nor refuses it: the probe cannot tell
    ("Metadata(state_dict_metadata={})", UNSUPPORTED),
], ids=["pickle-load", "restricted", "unknown"])
def test_dcp_metadata_probe_runs_the_reader(replacement, expected, tmp_path, monkeypatch):
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    if replacement is not None:
        monkeypatch.setattr(FileSystemReader, "read_metadata", renamed(
            FileSystemReader, "read_metadata", {"pickle.load(metadata_file)": replacement}, tmp_path))
    state, reason = state_of("torch-dcp-metadata-restricted")
    assert state == expected, reason
