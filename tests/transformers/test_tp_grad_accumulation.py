"""transformers-tp-replicated-grad-accumulation: TP + gradient accumulation gives every gradient of one process.

2 ranks, ``tp_size=2`` (one data-parallel rank: both ranks see every micro-batch), 2 and 3 micro-batches
accumulated (backward per micro-batch, no zero_grad), every parameter's full gradient compared with a single
process accumulating the same micro-batches (rtol 1e-5, fp32). Qwen3 uses the ``replicated_with_grad_allreduce``
style for ``q_norm``/``k_norm``; without the patch exactly those gradients are wrong. Llama's plan has no such
style: it is the control that the patch changes nothing else. ``fix_tp_grad_accumulation`` repairs a model loaded
before ``enable()``, and together with the partial-grad patch each acts on q_norm/k_norm exactly once.
"""

from __future__ import annotations

import ast
import importlib
import inspect

import pytest
import torch

import shardadopt
from shardadopt.patches.transformers_tp_replicated_grad_accumulation import MODULE, PATCH
from shardadopt.patching.registry import APPLIED, NOT_NEEDED
from shardadopt.testing.scripts import load_tool
from shardadopt.upstream.versions import installed_version

ID = PATCH.id

tool = load_tool("upstream_diffs")
DIFF = tool.diff_for(tool.load_fixes([ID])[ID], str(installed_version("transformers")))  # the installed release's
BATCH = 2
SEEDS = (21, 22, 23)  # one token batch per micro-batch
STYLE_PARAMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")

pytestmark = pytest.mark.multiproc


# -- worker functions (run on every rank) -------------------------------------------------------------------------

def gathered(model, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient (a collective). DTensor grads are gathered over their mesh; transformers
    5.15 keeps TP shards as plain rank-local tensors, concatenated here along the one dim that differs from the
    full shape (the tiny models split evenly, in rank order)."""
    import torch.distributed as dist

    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        elif grad.shape != shapes[name]:
            (dim,) = [d for d, (a, b) in enumerate(zip(grad.shape, shapes[name])) if a != b]
            parts = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, grad.contiguous())
            grad = torch.cat(parts, dim)
        grads[name] = grad.detach().clone()
    return grads


def accumulate(model, micro_batches: int) -> None:
    from shardadopt.testing import token_batch

    for seed in SEEDS[:micro_batches]:
        batch = token_batch(seed, BATCH)
        model(input_ids=batch, labels=batch).loss.backward()


def tp_grads(path: str, micro_batches: int, exclude: list[str] | None, repair: bool,
             shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Full gradients after ``micro_batches`` accumulated backwards under ``tp_size=2``; loaded after
    ``enable(exclude=exclude)`` (``None``: without ``enable()``), repaired by ``fix_tp_grad_accumulation`` first
    when ``repair``."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    if exclude is not None:
        shardadopt.enable(exclude=exclude)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     distributed_config=DistributedConfig(tp_size=2))
        if repair:
            # One micro-batch first: on 5.21+ upstream hooks the parameters on the first forward.
            accumulate(model, 1)
            model.zero_grad()
            assert shardadopt.fix_tp_grad_accumulation(model) == 2 * model.config.num_hidden_layers
            assert shardadopt.fix_tp_grad_accumulation(model) == 0, "a second repair must find nothing to do"
        accumulate(model, micro_batches)
        return gathered(model, shapes)
    finally:
        shardadopt.disable()


def twod_grads(path: str, micro_batches: int, exclude: list[str], shapes: dict[str, torch.Size]):
    """fsdp_size=2 x tp_size=2 on 4 ranks, FSDP gradient sync off for all but the last micro-batch (what
    accelerate's ``accumulate`` does): the unsharded gradients accumulate, as under pure TP."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from shardadopt.testing import token_batch

    shardadopt.enable(exclude=exclude)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     distributed_config=DistributedConfig(fsdp_size=2, tp_size=2))
        dp_rank = shardadopt.topology(model).dp_rank
        for i, seed in enumerate(SEEDS[:micro_batches]):
            model.set_requires_gradient_sync(i == micro_batches - 1)
            batch = token_batch(seed, 2 * BATCH).chunk(2)[dp_rank]
            model(input_ids=batch, labels=batch).loss.backward()
        return gathered(model, shapes)
    finally:
        shardadopt.disable()


def twod_unsupported() -> str | None:
    from shardadopt.testing.layouts import unloadable_reason

    return unloadable_reason({"fsdp_size": 2, "tp_size": 2})


# -- tests ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def references(tiny_models) -> dict[tuple[str, int], dict[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    refs = {}
    for family in ("qwen3", "llama"):
        model = AutoModelForCausalLM.from_pretrained(tiny_models[family], dtype=torch.float32)
        for micro_batches in (2, 3):
            model.zero_grad()
            accumulate(model, micro_batches)
            refs[family, micro_batches] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return refs


def mismatched(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> list[str]:
    """Names whose gradient differs from the reference beyond fp32 reduction-order noise: rtol 1e-5 and an atol of
    1e-5 of the tensor's scale (entries near zero of a large gradient differ by ~1e-6 of its scale from one CPU to
    another, e.g. Apertus' embedding after an SGD step); a missing or doubled reduction is off by 0.5x or more."""
    assert grads.keys() == reference.keys()
    return sorted(name for name, grad in grads.items()
                  if grad.shape != reference[name].shape
                  or not torch.allclose(grad, reference[name], rtol=1e-5,
                                        atol=max(1e-7, 1e-5 * reference[name].abs().max().item())))


def style_params(reference: dict[str, torch.Tensor]) -> list[str]:
    return sorted(name for name in reference if name.endswith(STYLE_PARAMS))


def shapes_of(reference: dict[str, torch.Tensor]) -> dict[str, torch.Size]:
    return {name: grad.shape for name, grad in reference.items()}


def test_patch_applies_where_upstream_reduces_accumulated_grad():
    importlib.import_module(MODULE)
    try:
        (state,) = [s for s in shardadopt.enable(only=[ID]) if s.id == ID]
    finally:
        shardadopt.disable()
    # 5.15 .. 5.24 all reduce the accumulated .grad; the probe must see it (the contract's not-needed case is
    # covered by test_probe_not_needed_on_fixed_upstream).
    assert state.state == APPLIED, state.reason


@pytest.mark.parametrize("micro_batches", [2, 3])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_tp_accumulated_grads_match_single_process(pool2, tiny_models, references, family, micro_batches):
    reference = references[family, micro_batches]
    fixed = pool2.run(tp_grads, tiny_models[family], micro_batches, [], False, shapes_of(reference), timeout=120)
    for rank, grads in enumerate(fixed):
        assert mismatched(grads, reference) == [], f"rank {rank}"


@pytest.mark.parametrize("micro_batches", [2, 3])
def test_without_patch_style_grads_are_wrong(pool2, tiny_models, references, micro_batches):
    reference = references["qwen3", micro_batches]
    broken = pool2.run(tp_grads, tiny_models["qwen3"], micro_batches, [ID], False, shapes_of(reference),
                       timeout=120)
    # Exactly the replicated_with_grad_allreduce parameters go wrong, on both ranks.
    for grads in broken:
        assert mismatched(grads, reference) == style_params(reference)


def test_llama_control_is_right_without_patch(pool2, tiny_models, references):
    reference = references["llama", 2]
    unpatched = pool2.run(tp_grads, tiny_models["llama"], 2, [ID], False, shapes_of(reference), timeout=120)
    for grads in unpatched:
        assert mismatched(grads, reference) == []


def test_fix_repairs_a_model_loaded_without_patch(pool2, tiny_models, references):
    reference = references["qwen3", 3]
    repaired = pool2.run(tp_grads, tiny_models["qwen3"], 3, None, True, shapes_of(reference), timeout=120)
    for grads in repaired:
        assert mismatched(grads, reference) == []


def test_fix_and_partial_grad_patch_each_act_once(pool2, tiny_models, references):
    """Upstream's hooks in place at the first forward (this patch excluded), the partial-grad patch on: it must
    recognise upstream's hooks in every layout (5.15's backward hook, 5.21's forward wrapper, 5.25's forward
    pre-hook) and leave q_norm/k_norm alone, and ``fix_tp_grad_accumulation`` must then find and replace every one
    of them; accumulating 2 micro-batches gives one process's gradients (a missed hook: 50 % off, a second sum:
    2x)."""
    from shardadopt.patches.transformers_tp_partial_grad import PATCH as PARTIAL

    PARTIAL_ID = PARTIAL.id

    try:
        states = {s.id: s.state for s in shardadopt.enable(only=[PARTIAL_ID])}
    finally:
        shardadopt.disable()
    assert states[PARTIAL_ID] == APPLIED
    reference = references["qwen3", 2]
    repaired = pool2.run(tp_grads, tiny_models["qwen3"], 2, [ID], True, shapes_of(reference), timeout=120)
    for rank, grads in enumerate(repaired):
        assert mismatched(grads, reference) == [], f"rank {rank}"


class _FixedStyle:
    """A fixed upstream in either layout (5.15's ``prepare_module_tp``, 5.16+'s ``install_forward``): the gradient
    flowing into the parameter is reduced (a tensor hook), never the accumulated ``.grad``."""

    def install_forward(self, module, mesh):
        import torch.distributed as dist

        def _all_reduce_new_grad(grad):
            grad = grad.clone(memory_format=torch.contiguous_format)
            dist.all_reduce(grad, group=mesh.get_group())
            return grad

        def hook(mod, args):
            for param in mod.parameters(recurse=False):
                # upstream-private: upstream's own marker, in this copy of its hook
                if torch.is_grad_enabled() and not getattr(param, "_hooked", False):
                    param.register_hook(_all_reduce_new_grad)
                    param._hooked = True  # upstream-private: upstream's marker

        module.register_forward_pre_hook(hook)
        return module

    prepare_module_tp = install_forward


def test_probe_not_needed_on_fixed_upstream(monkeypatch):
    from shardadopt.patches import transformers_tp_replicated_grad_accumulation as patch

    assert patch.probe().needed
    monkeypatch.setattr(importlib.import_module(MODULE), "ReplicatedWithGradAllReduce", _FixedStyle)
    found = patch.probe()
    assert not found.needed, found.reason
    try:
        states = {s.id: s.state for s in shardadopt.enable(only=[ID])}
    finally:
        shardadopt.disable()
    assert states[ID] == NOT_NEEDED


@pytest.fixture(scope="module")
def twod_reference(tiny_models) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    from shardadopt.testing import token_batch

    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen3"], dtype=torch.float32)
    for seed in SEEDS[:2]:
        batch = token_batch(seed, 2 * BATCH)
        model(input_ids=batch, labels=batch).loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.skipif(twod_unsupported() is not None, reason=twod_unsupported() or "")
def test_2d_fsdp_tp_no_sync_accumulation(pool4, tiny_models, twod_reference):
    shapes = shapes_of(twod_reference)
    fixed = pool4.run(twod_grads, tiny_models["qwen3"], 2, [], shapes, timeout=180)
    broken = pool4.run(twod_grads, tiny_models["qwen3"], 2, [ID], shapes, timeout=180)
    for rank in range(4):
        assert mismatched(fixed[rank], twod_reference) == [], f"rank {rank}"
        assert mismatched(broken[rank], twod_reference) == style_params(twod_reference), f"rank {rank}"


def diff_applied_style():
    """``ReplicatedWithGradAllReduce`` as upstream's source reads with the patch's diff applied, compiled in the
    upstream module's namespace; None when the installed source is not the one the diff is against."""
    module = importlib.import_module(MODULE)
    source = inspect.getsource(module)
    hunks = tool.source_hunks(DIFF.read_text()).split("\n@@")[1:]
    for hunk in hunks:
        lines = hunk.split("\n")[1:]
        old = "\n".join(line[1:] for line in lines if line[:1] in (" ", "-"))
        new = "\n".join(line[1:] for line in lines if line[:1] in (" ", "+"))
        if source.count(old) != 1:
            return None
        source = source.replace(old, new)
    (node,) = [n for n in ast.parse(source).body
               if isinstance(n, ast.ClassDef) and n.name == "ReplicatedWithGradAllReduce"]
    namespace = dict(vars(module))
    exec(compile(ast.get_source_segment(source, node), str(DIFF), "exec"), namespace)
    return namespace["ReplicatedWithGradAllReduce"]


def test_probe_not_needed_with_the_upstream_diff(monkeypatch):
    from shardadopt.patches import transformers_tp_replicated_grad_accumulation as patch

    fixed = diff_applied_style()
    if fixed is None:
        pytest.skip(f"{DIFF.name} changes other source than {MODULE}'s ReplicatedWithGradAllReduce")
    monkeypatch.setattr(importlib.import_module(MODULE), "ReplicatedWithGradAllReduce", fixed)
    found = patch.probe()
    assert not found.needed, found.reason


# -- transformers-tp-partial-grad: a whole parameter whose first gradient is zero ----------------------------------

def sgd_step_grads(path: str, sizes: dict | None, steps: int, shapes: dict[str, torch.Size]):
    """``steps`` SGD steps on ``path`` (loaded with ``DistributedConfig(**sizes)`` after ``enable()``, or in one
    process), one token batch each; every step's full gradients."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from shardadopt.testing import token_batch

    shardadopt.enable()
    try:
        extra = {} if sizes is None else {"distributed_config": DistributedConfig(**sizes)}
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        per_step = []
        for seed in SEEDS[:steps]:
            batch = token_batch(seed, BATCH)
            model(input_ids=batch, labels=batch).loss.backward()
            per_step.append(gathered(model, shapes) if sizes else
                            {n: p.grad.detach().clone() for n, p in model.named_parameters()})
            optimizer.step()
            optimizer.zero_grad()
        return per_step
    finally:
        shardadopt.disable()


@pytest.fixture(scope="module")
def zero_down_apertus(tmp_path_factory) -> str:
    """A tiny Apertus whose MLP output projections start at zero (zero-initialised residual branches): at step 0
    nothing flows back into the xIELU activation, whose scalars ``alpha_p``/``alpha_n`` then get an exactly zero
    gradient on every TP rank; from step 1 on their gradients are partial (each rank sees half the features)."""
    from shardadopt.testing.archs import build_tiny

    model = build_tiny("apertus", seed=3)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.zero_()
    path = tmp_path_factory.mktemp("apertus-zero-down")
    model.save_pretrained(path)
    return str(path)


def test_partial_gradient_first_zero_then_partial_is_summed(pool2, zero_down_apertus):
    reference = sgd_step_grads(zero_down_apertus, None, 2, {})
    activations = sorted(n for n in reference[0] if ".act_fn." in n)
    assert activations and all(not reference[0][n].any() for n in activations), "step 0 must give them no gradient"
    assert all(reference[1][n].any() for n in activations), "step 1 must give them a gradient"
    per_rank = pool2.run(sgd_step_grads, zero_down_apertus, {"tp_size": 2}, 2, shapes_of(reference[0]), timeout=120)
    for rank, steps in enumerate(per_rank):
        for step, (grads, want) in enumerate(zip(steps, reference)):
            assert mismatched(grads, want) == [], f"rank {rank}, step {step}"


# -- transformers-tp-legacy-layers: vocab-parallel padding row and rowwise bias names (5.15's TP layers) ------------

LEGACY_ID = "transformers-tp-legacy-layers"
# token 32 is the first row of rank 1's half of the 64-token table: the row a global padding_idx=0 hits there
LEGACY_IDS = [[1, 32, 5, 40, 32, 9, 33, 2], [32, 3, 60, 32, 31, 0, 7, 32]]


def legacy_grads(path: str, sizes: dict | None, exclude: list[str], shapes: dict[str, torch.Size]):
    """Names and full gradients after one backward, loaded after ``enable(exclude=...)`` (``shapes``: the full
    shapes, by name, for putting 5.15's plain shards together)."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    shardadopt.enable(exclude=exclude)
    try:
        extra = {} if sizes is None else {"distributed_config": DistributedConfig(**sizes)}
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra)
        batch = torch.tensor(LEGACY_IDS)
        model(input_ids=batch, labels=batch).loss.backward()
        names = sorted(n for n, _ in model.named_parameters())
        if sizes is None:
            return names, {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        return names, gathered(model, {n: shapes.get(n, p.shape) for n, p in model.named_parameters()})
    finally:
        shardadopt.disable()


@pytest.fixture(scope="module")
def tied_biased_llama(tmp_path_factory) -> str:
    """A tiny Llama with tied embeddings (5.15 makes the table vocab-parallel), ``pad_token_id=0`` and biases on
    the rowwise ``o_proj``/``down_proj``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, tie_word_embeddings=True,
                         attention_bias=True, mlp_bias=True)
    with torch.random.fork_rng():
        torch.manual_seed(5)
        model = LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tied-biased-llama")
    model.save_pretrained(path)
    return str(path)


def test_tp_vocab_parallel_padding_row_and_rowwise_bias_names(pool2, tied_biased_llama):
    names, reference = legacy_grads(tied_biased_llama, None, [], {})
    assert reference["model.embed_tokens.weight"][32].abs().max() > 0, "token 32 must get an embedding gradient"
    shapes = shapes_of(reference)
    for rank, (got_names, grads) in enumerate(pool2.run(legacy_grads, tied_biased_llama, {"tp_size": 2}, [],
                                                         shapes, timeout=120)):
        assert got_names == names, f"rank {rank}: parameter names differ from one process"
        assert mismatched(grads, reference) == [], f"rank {rank}"
    importlib.import_module("transformers.integrations.tensor_parallel")
    try:
        (state,) = [s for s in shardadopt.enable(only=[LEGACY_ID]) if s.id == LEGACY_ID]
    finally:
        shardadopt.disable()
    if state.state == APPLIED:  # transformers 5.15: without the patch, both problems are back
        broken_names, broken = pool2.run(legacy_grads, tied_biased_llama, {"tp_size": 2}, [LEGACY_ID], shapes,
                                         timeout=120)[1]
        assert any(n.endswith("._bias") for n in broken_names), broken_names
        assert not torch.allclose(broken["model.embed_tokens.weight"][32], reference["model.embed_tokens.weight"][32])
