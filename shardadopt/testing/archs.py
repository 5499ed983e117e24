"""Tiny random configs for every causal-LM (and image-text-to-text) model type of the installed transformers, derived
from each type's own default config (used by ``tools/arch_sweep.py``, its CI sample and ``shardadopt doctor --model
... --check``; the vision part of an image-text-to-text config: ``shardadopt/testing/vlm.py``).

The shrink is generic: layer counts and per-layer lists keep one layer of each kind, widths, heads, MoE and MLA
sizes become small, special token ids move inside the small vocabulary. Every other field keeps its default, so
each type's own code paths (sliding windows, soft-capping, shared experts, linear attention, ...) stay on. A type
whose shrunk config does not build (an inconsistency the generic rules cannot see, e.g. ``lfm2_moe``, whose
default config leaves ``layer_types`` unset for its modeling code to index) raises here; the sweep records it as
``not testable here`` with that error.
"""

from __future__ import annotations

import os
from typing import Any

VOCAB = 512
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
MAX_PARAMS = 4_000_000  # a tiny config above this missed a size field: report it instead of training it slowly

# the first one present is the stack's layer count; the others are shortened with it (an encoder-decoder's second
# stack, HRM's ``num_layers_per_stack``: the real depth of each recurrent stack, ``num_hidden_layers`` counting cache
# slots)
_LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "decoder_layers", "num_layers_per_stack")
# fields read as "how many / which layers": kept within the shortened stack
_DENSE_PREFIX = ("first_k_dense_replace", "num_dense_layers", "n_dense_layers", "first_k_dense")
_LAYER_STEPS = ("decoder_sparse_step", "interleave_moe_layer_step", "moe_layer_freq", "no_rope_layer_interval",
                "sliding_window_pattern", "full_attention_interval", "attn_layer_period", "expert_layer_period")
EXPERT_COUNTS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
_FIXED = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "hidden_dim", "dim", "embed_dim"), HIDDEN),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
                     "decoder_attention_heads"), HEADS),
    **dict.fromkeys(("head_dim", "v_head_dim", "attention_head_dim", "linear_key_head_dim",
                     "linear_value_head_dim"), HEAD_DIM),
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "qk_head_dim": 16, "kv_lora_rank": 16, "q_lora_rank": 32,
    **dict.fromkeys(("intermediate_size", "ffn_hidden_size", "intermediate_size_mlp", "n_inner", "ffn_dim",
                     "decoder_ffn_dim", "encoder_ffn_dim", "mlp_hidden_size"), 128),
    **dict.fromkeys(("moe_intermediate_size", "expert_ffn_hidden_size", "shared_expert_intermediate_size",
                     "moe_ffn_hidden_size", "expert_intermediate_size"), 32),
    **dict.fromkeys(EXPERT_COUNTS, 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k"), 2),
    "n_group": 1, "topk_group": 1, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "vocab_size": VOCAB,
}
_AT_MOST = {"n_shared_experts": 1, "num_shared_experts": 1, "zero_expert_num": 2, "moe_shared_expert_count": 1,
            "sliding_window": 8, "attention_chunk_size": 8, "max_position_embeddings": 256, "n_positions": 256,
            "original_max_position_embeddings": 128, "num_nextn_predict_layers": 0, "rotary_dim": HEAD_DIM // 2,
            "d_head": HEAD_DIM}
_RANDOM_IN_TRAINING = ("dropout", "pdrop", "jitter", "drop_rate", "drop_path")
# defaults some configs leave None for the modeling code to fail on (nemotron, hunyuan, deepseek_v2): the value
# that None means elsewhere
_NONE_MEANS = {"head_dim": HEAD_DIM, "num_key_value_heads": HEADS}


CAUSAL_LM = "causal-lm"
IMAGE_TEXT = "image-text-to-text"
# task -> the Auto mapping of transformers' modeling_auto whose classes it trains
TASKS = {CAUSAL_LM: "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", IMAGE_TEXT: "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"}


def auto_mapping(task: str) -> dict[str, str]:
    """Model type -> class name, from the installed transformers' Auto mapping for ``task``."""
    from transformers.models.auto import modeling_auto

    return getattr(modeling_auto, TASKS[task])


def causal_lm_types(plan: str | None = None, task: str = CAUSAL_LM) -> list[str]:
    """Model types with a class for ``task`` (causal LM, image-text-to-text) in the installed transformers;
    ``plan="tp"``/``"ep"``: only those whose config class (or its text sub-config's class, for a composite config)
    declares a base-model tensor-/expert-parallel plan."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    attribute = {None: None, "tp": "base_model_tp_plan", "ep": "base_model_ep_plan"}[plan]
    types = []
    for model_type in auto_mapping(task):
        try:
            config_class = CONFIG_MAPPING[model_type]
        except (KeyError, ImportError):
            continue
        if attribute is None or getattr(config_class, attribute, None) or (
                task != CAUSAL_LM and _text_plan(config_class, attribute)):
            types.append(model_type)
    return sorted(types)


def _text_plan(config_class: type, attribute: str) -> bool:
    """Whether a composite config's default text config declares the plan (``LlavaConfig``: its Llama text
    model's plan is what a sharded load applies to the language model)."""
    try:
        text = config_class().get_text_config()
    except Exception:  # a default that does not build: no plan to read (the sweep reports the build itself)
        return False
    return bool(getattr(text, attribute, None))


def model_class(model_type: str, task: str = CAUSAL_LM):
    """The class transformers' Auto mapping for ``task`` gives ``model_type``."""
    import transformers

    return getattr(transformers, auto_mapping(task)[model_type])


def _is_layer_dict(value: Any, layers: int) -> bool:
    """A dict keyed by layer index (``per_layer_config``)."""
    return (isinstance(value, dict) and len(value) > 0
            and all(str(k).isdigit() and int(k) < layers for k in value))


def _is_index_list(value: Any, layers: int) -> bool:
    return (isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            and value == sorted(set(value)) and all(0 <= v < layers for v in value)
            and len(value) < layers)


def shrink(values: dict[str, Any]) -> dict[str, Any]:
    """A tiny version of a config's ``to_dict()`` (see the module docstring); nested dicts (sub-configs, rope
    parameters) shrink too."""
    values = dict(values)
    layer_dict_keys: list[str] = []
    count_key = next((k for k in _LAYER_COUNTS if isinstance(values.get(k), int)), None)
    if count_key is not None:
        layers = values[count_key]
        per_layer = [k for k, v in values.items() if isinstance(v, list) and len(v) == layers and layers > 1
                     and not _is_index_list(v, layers + 1)]
        index_lists = [k for k, v in values.items() if k not in per_layer and _is_index_list(v, layers)]
        layer_dicts = layer_dict_keys = [k for k, v in values.items() if _is_layer_dict(v, layers)]
        kinds = [tuple([_hashable(values[k][i]) for k in per_layer] + [i in values[k] for k in index_lists]
                       + [_hashable(_layer_entry(values[k], i)) for k in layer_dicts])
                 for i in range(layers)]
        kept = sorted({kinds.index(kind) for kind in kinds})
        for key in _DENSE_PREFIX:  # dense layers first: one of them, then the sparse ones
            if isinstance(values.get(key), int) and 0 < values[key] < layers:
                kept = sorted({0, *(i for i in kept if i >= values[key]), values[key]})
        for index in range(layers):  # at least two layers: the stack's layer-to-layer path is exercised
            if len(kept) >= min(2, layers):
                break
            if index not in kept:
                kept = sorted({*kept, index})
        for key in per_layer:
            values[key] = [values[key][i] for i in kept]
        for key in index_lists:
            values[key] = [new for new, old in enumerate(kept) if old in values[key]]
        for key in layer_dicts:
            entries = values[key]
            key_type = type(next(iter(entries)))
            values[key] = {key_type(new): _shrunk(_layer_entry(entries, old)) for new, old in enumerate(kept)
                           if _layer_entry(entries, old) is not None}
        for key in _DENSE_PREFIX:
            if isinstance(values.get(key), int) and 0 < values[key] < layers:
                values[key] = 1
        for key in _LAYER_STEPS:
            if isinstance(values.get(key), int) and values[key] > len(kept):
                values[key] = len(kept)
        if isinstance(values.get("max_window_layers"), int):
            values["max_window_layers"] = min(values["max_window_layers"], len(kept))
        values[count_key] = len(kept)
        for key in _LAYER_COUNTS:  # encoder-decoder configs count both stacks
            if key != count_key and isinstance(values.get(key), int):
                values[key] = min(values[key], len(kept))
    heads = values.get("num_attention_heads")
    for key, meaning in _NONE_MEANS.items():
        if key in values and values[key] is None:
            values[key] = meaning
    if values.get("num_experts_per_tok", 0) is None and any(values.get(k) for k in EXPERT_COUNTS):
        values["num_experts_per_tok"] = 2
    for key, value in list(values.items()):
        if isinstance(value, dict) and key not in layer_dict_keys:
            values[key] = shrink(value)
        elif not isinstance(key, str) or isinstance(value, bool) or value is None:
            continue
        elif isinstance(value, float) and any(word in key for word in _RANDOM_IN_TRAINING):
            values[key] = 0.0  # one process and the sharded run draw different random numbers
        elif key in _FIXED and isinstance(value, int):
            values[key] = _FIXED[key]
        elif key in _AT_MOST and isinstance(value, int):
            values[key] = min(value, _AT_MOST[key])
        elif key == "num_key_value_heads" and isinstance(value, int):
            # keep the grouping kind: multi-head (kv == heads), grouped (kv < heads), multi-query (kv == 1)
            values[key] = 1 if value == 1 else (HEADS if heads is not None and value >= heads else KV_HEADS)
        elif key.endswith("_token_id") or key.endswith("_token_ids"):
            values[key] = _within_vocabulary(value)
        elif isinstance(value, int) and value > 256 and ("size" in key or "dim" in key) \
                and not any(word in key for word in ("vocab", "position", "token", "chunk_size_feed")):
            values[key] = 32
    if isinstance(values.get("qk_rope_head_dim"), int):  # MLA: the rotary part is what head_dim means there
        values["head_dim"] = values["qk_rope_head_dim"]
    return values


def _shrunk(value: Any) -> Any:
    return shrink(value) if isinstance(value, dict) else value


def _layer_entry(entries: dict, layer: int) -> Any:
    return entries.get(layer, entries.get(str(layer)))


def _hashable(value: Any) -> Any:
    return tuple(map(_hashable, value)) if isinstance(value, list) else (
        tuple(sorted(value.items())) if isinstance(value, dict) else value)


def _within_vocabulary(value: Any) -> Any:
    if isinstance(value, list):
        return [_within_vocabulary(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and value >= VOCAB:
        return VOCAB - 1 - value % 8  # distinct small ids for distinct specials, kept off the common range
    return value


def tiny_config(model_type: str, values: dict[str, Any] | None = None, task: str = CAUSAL_LM):
    """The tiny config of ``model_type``, shrunk from ``values`` (a checkpoint's ``config.json``) or the type's
    default config (raises what transformers raises when the shrunk values are inconsistent); for an
    image-text-to-text type the vision tower shrinks too (``shardadopt.testing.vlm.shrink_vision``)."""
    config_class = model_class(model_type, task).config_class
    values = dict(values) if values is not None else config_class().to_dict()
    for key in ("transformers_version", "architectures", "model_type"):
        values.pop(key, None)
    if task == IMAGE_TEXT:
        from shardadopt.testing import vlm

        values = vlm.shrink_vision(vlm.special_ids(values, VOCAB), HIDDEN)
    config = config_class.from_dict(shrink(values))
    if task == IMAGE_TEXT:
        vlm.fit_rotary_sections(config, HEAD_DIM)
    config.use_cache = False  # training: no KV cache
    return config


def build_tiny(model_type: str, seed: int = 0, values: dict[str, Any] | None = None, task: str = CAUSAL_LM):
    """A tiny random fp32 model of ``model_type`` (deterministic for ``seed``; config as :func:`tiny_config`);
    raises ``ValueError`` when the tiny config still has more than ``MAX_PARAMS`` parameters."""
    import torch

    config = tiny_config(model_type, values, task)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_class(model_type, task)(config).float()
    count = sum(p.numel() for p in model.parameters())
    if count > MAX_PARAMS:
        big = max(model.named_parameters(), key=lambda item: item[1].numel())
        raise ValueError(f"the tiny config still has {count:,} parameters (largest {big[0]} "
                         f"{tuple(big[1].shape)}): a size field the generic shrink does not know")
    return model


def write_tiny(model_type: str, root: str | os.PathLike, seed: int = 0, values: dict[str, Any] | None = None,
               task: str = CAUSAL_LM) -> str:
    """Write the tiny checkpoint of ``model_type`` for ``task`` (:func:`build_tiny`) under ``root`` once
    (atomically); its directory."""
    import shutil
    import tempfile

    path = os.path.join(os.fspath(root), f"tiny-{model_type}" if task == CAUSAL_LM else f"tiny-{task}-{model_type}")
    if not os.path.exists(os.path.join(path, "config.json")):
        os.makedirs(root, exist_ok=True)
        model = build_tiny(model_type, seed, values, task)
        staging = tempfile.mkdtemp(prefix=f".tiny-{model_type}-", dir=root)
        model.save_pretrained(staging)
        try:
            os.rename(staging, path)
        except OSError:  # another process wrote it first; same seed, same checkpoint
            shutil.rmtree(staging, ignore_errors=True)
    return path
