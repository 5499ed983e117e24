"""FSDP: ``generate`` with images on a model sharded at load time gathers the units its image encoding reads.

Upstream: not reported yet (proposal, ``upstream-fixes/transformers-fsdp-generate-encoder-unshard.diff``). transformers
5.25's ``generate`` encodes the images (and videos) itself before the prefill:
``GenerationMixin._prepare_multimodal_encoder_kwargs_for_generation`` calls ``self.base_model.get_image_features``
and hands the result to the forward as ``mm_encoder_outputs``. That call is no forward of the model, so on a model
loaded with ``fsdp_size`` FSDP2's root pre-forward hook never all-gathers the root unit's parameters (a vision
tower's patch embedding, a merger / projector): the first layer meets DTensor shards and ``generate`` raises
(``aten.convolution: got mixed torch.Tensor and DTensor``; Qwen2.5-VL, Gemma 3). transformers 5.15 has no such step
(the forward encodes the images) and needs nothing.

The wrapper runs that method inside :func:`shardadopt.parallel.fsdpunits.gathered_for_call` for ``base_model``: the FSDP
units enclosing it (the root) are unsharded for the call and resharded after; the units it runs a forward of (a
tower's blocks) gather themselves. The probe reads the method: a call of ``get_<modality>_features`` (or of a
``getattr(..., f"get_{modality}_features")``) means ``needed``; a method that gathers FSDP units itself (``unshard``,
``register_fsdp_forward_method``), or no such method while generate's module encodes nothing before the prefill
(5.15), means ``not-needed``.
"""

from __future__ import annotations

import ast
import inspect
import re

from shardadopt import upstream
from shardadopt.patching.contract import Patch, Probe
from shardadopt.upstream.versions import supported

TARGET = upstream.GENERATION_PREPARE_MULTIMODAL_ENCODER
# What a method that gathers the FSDP units it reads would call.
_GATHERS = {"unshard", "register_fsdp_forward_method"}
# What generate's module names where it hands pre-encoded image features to the forward.
_PRE_ENCODED = "mm_encoder_outputs"


# A feature extraction method, by name (``get_image_features``) or as generate builds its name
# (``f"get_{modality}_features"``).
_GETTER = re.compile(r"get_(\w+|\{\w+\})_features")


def _feature_getters(tree: ast.AST) -> list[str]:
    """The image / video feature extraction ``tree`` calls: ``get_image_features(...)`` by name, or a
    ``getattr(owner, f"get_{modality}_features", ...)`` (5.18+)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if name and _GETTER.fullmatch(name):
            found.append(name)
        elif name == "getattr" and len(node.args) >= 2 and _GETTER.search(ast.unparse(node.args[1])):
            found.append(f"getattr(..., {ast.unparse(node.args[1])})")
    return found


def probe() -> Probe:
    import transformers.generation.utils as generation

    from shardadopt.upstream.probing import names, source_tree, undecided

    owner = generation.GenerationMixin
    *_, method_name = TARGET.qualname.split(".")
    method = inspect.getattr_static(owner, method_name, None)
    if method is None:
        if _PRE_ENCODED not in inspect.getsource(owner):
            return Probe(False, "generate encodes no images before the prefill (the model's forward does, under "
                                "FSDP's hooks)")
        raise undecided(TARGET.qualname, f"the method (it is gone, but GenerationMixin still names {_PRE_ENCODED})")
    tree = source_tree(method)
    gathers = _GATHERS & names(tree)
    if gathers:
        return Probe(False, f"{method_name} gathers the FSDP units it reads ({', '.join(sorted(gathers))})")
    getters = _feature_getters(tree)
    if getters:
        return Probe(True, f"generate encodes the images before the prefill outside any forward ({getters[0]}): "
                           "FSDP2's root unit (a vision patch embedding, a projector) stays sharded for that call")
    raise undecided(TARGET.qualname, "a get_<modality>_features call (the gap) nor a gather of FSDP units (the fix)")


def _prepare_multimodal_encoder(wrapped, instance, args, kwargs):
    from shardadopt.parallel.fsdpunits import gathered_for_call

    if instance is None:
        return wrapped(*args, **kwargs)
    with gathered_for_call(instance, getattr(instance, "base_model", instance)):
        return wrapped(*args, **kwargs)


PATCH = Patch(
    id="transformers-fsdp-generate-encoder-unshard",
    summary="FSDP: generate() with images on a model loaded with fsdp_size gathers the root unit (vision patch "
            "embedding, projector) for the image encoding it runs before the prefill, and reshards it after",
    upstream="proposal for transformers main (not reported yet)",
    requires=supported("transformers"),
    wrappers={TARGET: _prepare_multimodal_encoder},
    probe_modules=("transformers.generation.utils",),
    probe=probe,
)
