"""Tiny image-text-to-text models and their training batches, with real images (used by ``tools/arch_sweep.py
--task image-text-to-text``, its CI sample and ``shardadopt doctor --model ... --check``).

The config is the causal-LM one's shrink (``shardadopt/testing/archs.py``) applied to the composite config, its
vision tower included, plus what a vision tower needs to stay small and consistent: an image of a few patches a
side, the projector's output width equal to the language model's, pooled token counts that still divide.

A sample is one random image put through the type's own image processor (its default, with the size, patch and
merge fields set from the tiny vision config, tiling off), and text around the image's placeholder tokens: as many
as the tiny model's ``get_image_features`` returns for that image, so the count is the model's own rather than a
formula per type. Image placeholders get label -100; ``token_type_ids``/``mm_token_type_ids`` mark them where the
forward takes them. The batch is written once next to the checkpoint, so the reference and every rank read the
same tensors.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch

TEXT_KEYS = ("input_ids", "labels", "attention_mask", "token_type_ids", "mm_token_type_ids")
PATCHES_PER_SIDE = 4  # a tiny image: 4 x 4 patches
TEXT_TOKENS = 12
_IMAGE_TOKEN_KEYS = ("image_token_id", "image_token_index", "image_token")
_START_KEYS = ("vision_start_token_id", "boi_token_id", "image_start_token_id", "boi_token_index")
_END_KEYS = ("vision_end_token_id", "eoi_token_id", "image_end_token_id", "eoi_token_index")
# processor switches that would cut one image into several tiles or crops, each more placeholder tokens
_ONE_TILE = {"do_image_splitting": False, "do_pan_and_scan": False, "max_image_tiles": 1, "max_num_tiles": 1,
             "min_num_tiles": 1, "crop_to_patches": False, "use_thumbnail": False,
             "image_grid_pinpoints": None}
# fields of a vision or projector config that are the language model's width, not the tower's own
_TEXT_WIDTH_KEYS = ("out_hidden_size", "text_hidden_size", "projection_dim", "output_hidden_size", "text_dim")


def shrink_vision(values: dict[str, Any], text_width: int) -> dict[str, Any]:
    """The vision-specific part of the shrink (before :func:`shardadopt.testing.archs.shrink`): each (nested) config
    with a patch size gets an image of ``PATCHES_PER_SIDE`` patches a side; widths meant to be the language
    model's (``out_hidden_size``, ...) become ``text_width``; pooled token counts (``mm_tokens_per_image``) fit
    the smaller image; placeholder ids (``image_token_index``) move into the vocabulary; multimodal rotary
    sections (``mrope_section``) fit the smaller heads. Runs before the causal-LM shrink."""

    values = dict(values)
    patch = values.get("patch_size")
    if isinstance(patch, list):
        patch = patch[0]
    if isinstance(patch, int) and patch > 0:
        side = patch * PATCHES_PER_SIDE
        for key in ("image_size", "max_image_size", "vision_image_size"):
            if isinstance(values.get(key), int):
                values[key] = side
            elif isinstance(values.get(key), list) and len(values[key]) == 2:
                values[key] = [side, side]
    for key in _TEXT_WIDTH_KEYS:
        if isinstance(values.get(key), int):
            values[key] = text_width
    if isinstance(values.get("mm_tokens_per_image"), int):
        values["mm_tokens_per_image"] = 4  # 2 x 2 pooled tokens from 4 x 4 patches
    for key, value in list(values.items()):
        if isinstance(value, dict):
            values[key] = shrink_vision(value, text_width)
    return values


def special_ids(values: dict[str, Any], vocab: int) -> dict[str, Any]:
    """``values`` with every special token id beyond ``vocab`` (``*_token_id``, ``*_token_index``, in nested
    configs too) moved to the top of the vocabulary, distinct ids staying distinct (an image placeholder that
    shares its id with the end-of-image marker miscounts the image's tokens)."""
    found: set[int] = set()

    def collect(node: Any) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                collect(value)
            elif _is_special(key, value) and value >= vocab:
                found.add(value)

    def moved(node: dict[str, Any]) -> dict[str, Any]:
        return {k: moved(v) if isinstance(v, dict) else (mapping[v] if _is_special(k, v) and v in mapping else v)
                for k, v in node.items()}

    collect(values)
    mapping = {old: vocab - 1 - i for i, old in enumerate(sorted(found))}
    return moved(values)


def _is_special(key: Any, value: Any) -> bool:
    return (isinstance(key, str) and (key.endswith("_token_id") or key.endswith("_token_index"))
            and isinstance(value, int) and not isinstance(value, bool))


def fit_rotary_sections(config: Any, head_dim: int) -> None:
    """Multimodal rotary sections (Qwen's ``mrope_section``, which its modeling code defaults to ``[16, 24, 24]``
    when the config leaves it out) set to the tiny heads' rotary half (of the rotated part of a head, with a
    partial rotary factor; ``head_dim`` where the text config has none), in the same proportions."""
    text = config.get_text_config()
    rope = getattr(text, "rope_parameters", None)
    if isinstance(rope, dict) and "mrope_section" in getattr(type(text), "ignore_keys_at_rope_validation", ()):
        section = rope.get("mrope_section") or [16, 24, 24]
        factor = rope.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", None)) or 1.0
        half = int((getattr(text, "head_dim", None) or head_dim) * factor) // 2
        scaled = [max(1, round(s * half / sum(section))) for s in section]
        scaled[0] += half - sum(scaled)
        rope["mrope_section"] = scaled


def image_processor(model_type: str, config: Any) -> tuple[Any, dict[str, Any]]:
    """The type's own image processor (its defaults, or its dense sibling's for an MoE variant; the PIL one where
    transformers names one: it needs no torchvision) and the call's keyword arguments that set it to the tiny
    vision tower's image, patch and merge sizes, one tile per image."""
    from transformers.models.auto.image_processing_auto import (
        IMAGE_PROCESSOR_MAPPING_NAMES,
        get_image_processor_class_from_name,
    )

    # an MoE variant without its own entry (qwen3_vl_moe, glm4v_moe) has its dense sibling's vision tower
    names = IMAGE_PROCESSOR_MAPPING_NAMES.get(model_type) or IMAGE_PROCESSOR_MAPPING_NAMES.get(
        model_type.removesuffix("_moe"))
    if not names:
        raise LookupError(f"transformers names no image processor for {model_type!r}")
    names = names if isinstance(names, dict) else {"slow": names}
    name = names.get("pil") or next(iter(v for v in names.values() if v))
    processor = get_image_processor_class_from_name(name)()
    vision = _vision_config(config)
    image = _get(vision, "image_size")
    if isinstance(image, list):
        image = image[0]
    kwargs: dict[str, Any] = {}
    for key in ("size", "crop_size", "max_image_size"):
        current = {k: _get(getattr(processor, key, None), k) for k in ("height", "width", "shortest_edge",
                                                                      "longest_edge")}
        current = {k: v for k, v in current.items() if v is not None}
        if current and isinstance(image, int) and not {"shortest_edge", "longest_edge"} <= set(current):
            kwargs[key] = dict.fromkeys(current, image)  # not a pixel budget (Qwen's min/max pixels)
    for attribute, field in (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"),
                             ("temporal_patch_size", "temporal_patch_size")):
        if hasattr(processor, attribute) and isinstance(_get(vision, field), int):
            kwargs[attribute] = _get(vision, field)
    kwargs.update({k: v for k, v in _ONE_TILE.items() if hasattr(processor, k)})
    return processor, kwargs


def _vision_config(config: Any) -> Any:
    for key in ("vision_config", "visual_config", "vision_tower_config", "encoder_config"):
        if getattr(config, key, None) is not None:
            return getattr(config, key)
    return config


def _get(config: Any, key: str) -> Any:
    """A field of a config, a dict or a ``SizeDict``."""
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def image_side(config: Any) -> int:
    """The side of the square test image: the tower's image size, else ``PATCHES_PER_SIDE`` merged patches."""
    vision = _vision_config(config)
    size = _get(vision, "image_size")
    if isinstance(size, list):
        size = size[0]
    if isinstance(size, int):
        return size
    patch = _get(vision, "patch_size") or 14
    return patch * (_get(vision, "spatial_merge_size") or 1) * PATCHES_PER_SIDE


def one_image(model_type: str, config: Any, seed: int) -> dict[str, torch.Tensor]:
    """The image processor's tensors for one random image (seeded), each with a leading image or patch dim."""
    side = image_side(config)
    pixels = torch.randint(0, 256, (side, side, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    processor, kwargs = image_processor(model_type, config)
    out = processor(images=[pixels.numpy()], return_tensors="pt", **kwargs)
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor) and k not in TEXT_KEYS}


def image_token_count(model: Any, image: dict[str, torch.Tensor]) -> int:
    """How many placeholder tokens one image takes: the features ``model.get_image_features`` returns for it."""
    accepted = inspect.signature(model.get_image_features).parameters
    kwargs = image if any(p.kind == p.VAR_KEYWORD for p in accepted.values()) \
        else {k: v for k, v in image.items() if k in accepted}
    with torch.no_grad():
        out = model.get_image_features(**kwargs)
    features = getattr(out, "pooler_output", None)
    if features is None:
        features = out if isinstance(out, (torch.Tensor, list, tuple)) else out[0]
    if isinstance(features, torch.Tensor):
        features = [features]
    return sum(f.shape[:-1].numel() for f in features)


def token_id(config: Any, keys: tuple[str, ...]) -> int | None:
    for holder in (config, getattr(config, "text_config", None)):
        for key in keys:
            value = getattr(holder, key, None) if holder is not None else None
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def samples(model_type: str, model: Any, count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``count`` training samples for ``model`` (a tiny model of ``model_type``): one image and text each."""
    config = model.config
    image_token = token_id(config, _IMAGE_TOKEN_KEYS)
    if image_token is None:
        raise LookupError(f"{type(config).__name__} names no image placeholder token ({', '.join(_IMAGE_TOKEN_KEYS)})")
    images = [one_image(model_type, config, seed + i) for i in range(count)]
    n_image = image_token_count(model, images[0])
    start, end = token_id(config, _START_KEYS), token_id(config, _END_KEYS)
    vocab = config.get_text_config().vocab_size
    specials = {v for values in (config.to_dict(), config.get_text_config().to_dict()) for k, v in values.items()
                if _is_special(k, v)}
    ordinary = torch.tensor([t for t in range(min(vocab, 512)) if t not in specials])
    accepted = inspect.signature(model.forward).parameters
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for image in images:
        text = ordinary[torch.randint(0, len(ordinary), (TEXT_TOKENS,), generator=generator)]
        placeholder = [start] * (start is not None) + [image_token] * n_image + [end] * (end is not None)
        ids = torch.cat([text[:2], torch.tensor(placeholder, dtype=torch.long), text[2:]])
        is_image = ids == image_token
        row = {"input_ids": ids, "labels": ids.masked_fill(is_image, -100), **image}
        if "token_type_ids" in accepted:
            row["token_type_ids"] = is_image.long()
        if "mm_token_type_ids" in accepted:
            row["mm_token_type_ids"] = is_image.int()
        rows.append(row)
    return rows


def collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A batch of samples: text tensors stacked, image tensors (leading image or patch dim) concatenated."""
    return {k: torch.stack([r[k] for r in rows]) if k in TEXT_KEYS else torch.cat([r[k] for r in rows])
            for k in rows[0]}


def write_batches(path: str, model_type: str, count: int, seed: int) -> str:
    """The file of ``count`` samples for the tiny checkpoint at ``path`` (written once, next to it)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    file = os.path.join(path, f"samples-{count}.pt")
    if not os.path.exists(file):
        model_class = getattr(transformers, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type])
        model = model_class.from_pretrained(path, dtype=torch.float32)
        rows = samples(model_type, model, count, seed)
        torch.save(rows, file + ".tmp")
        os.replace(file + ".tmp", file)
    return file
