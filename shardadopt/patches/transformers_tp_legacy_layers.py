"""Tensor parallelism on transformers 5.15: the vocab-parallel embedding's padding row and the rowwise bias's name.

Upstream: transformers 5.15's own TP layers (``transformers/integrations/tensor_parallel.py``, local tensors and
forward hooks); 5.16 replaced them with DTensor layers (``transformers/distributed/tensor_parallel.py``), which have
neither problem (backport, ``upstream-fixes/transformers-tp-legacy-layers.diff``). Both found by
``tools/arch_sweep.py``:

- ``EmbeddingParallel`` (vocab-parallel ``embed_tokens``, e.g. every tied-embedding model: the plan shards the
  table the colwise ``lm_head`` shares) shifts the token ids into this rank's shard but leaves ``padding_idx``
  global. ``nn.Embedding`` zeroes the gradient of row ``padding_idx``, so with ``pad_token_id=0`` rank 1's first
  row (global token ``vocab/2``) never gets an embedding gradient: silently wrong training, seen as a 40 % error in
  the embedding's gradient at the first step whose batch holds that token (gemma, gemma2, gemma3_text, cohere,
  cohere2, ernie4_5, vaultgemma, ...). A padding id past the shard (SmolLM3's 128004 in a 2-rank 128256 table)
  raises ``Padding_idx must be within num_embeddings`` instead. The wrapper makes ``padding_idx`` local
  (:func:`shardadopt.parallel.tp.localize_padding_idx`) before each lookup.
- ``RowwiseParallel`` takes the bias out of the matmul by re-registering it as ``_bias`` at the first forward, so
  ``named_parameters()``/``state_dict()`` name it ``o_proj._bias`` from then on: a checkpoint or export written
  after training lacks every rowwise bias under its real name and loads with freshly initialised ones (gpt_neox,
  phi, starcoder2, jais2). The wrappers keep the parameter registered as ``bias`` (set to None for the matmul only,
  :func:`shardadopt.parallel.tp.stash_rowwise_bias`) and add it once after the all-reduce.

The probe reads the installed layers' source: local-tensor hooks that shift ids by ``vocab_start_index`` without
looking at ``padding_idx`` and move ``mod.bias`` to ``mod._bias`` mean ``needed``; layers without
``_prepare_input_fn`` (DTensor, 5.16+) ``not-needed``.
"""

from __future__ import annotations

import importlib
import inspect

from shardadopt.patching.contract import Patch, Probe
from shardadopt.upstream import (
    EMBEDDING_PARALLEL_PREPARE_INPUT,
    ROWWISE_PARALLEL_PREPARE_INPUT,
    ROWWISE_PARALLEL_PREPARE_OUTPUT,
    TENSOR_PARALLEL_MODULE,
    tp_layer_input_hook,
)
from shardadopt.upstream.versions import supported


def probe() -> Probe:
    from shardadopt.upstream.probing import undecided

    module = importlib.import_module(TENSOR_PARALLEL_MODULE)
    embedding = getattr(module, "EmbeddingParallel", None)
    rowwise = getattr(module, "RowwiseParallel", None)
    hooks = [tp_layer_input_hook(cls) for cls in (embedding, rowwise)]
    if all(hook is None for hook in hooks):
        return Probe(False, "tensor-parallel layers are DTensor layers without local-tensor forward hooks")
    sources = [inspect.getsource(hook) if hook is not None else "" for hook in hooks]
    if ("vocab_start_index" in sources[0] and "padding_idx" not in sources[0]
            and "mod._bias = mod.bias" in sources[1]):
        return Probe(True, "the vocab-parallel embedding keeps the global padding_idx on every shard (a real token's "
                           "row gets no gradient, or the lookup raises) and the rowwise bias is renamed `_bias`")
    raise undecided(f"{TENSOR_PARALLEL_MODULE} EmbeddingParallel/RowwiseParallel._prepare_input_fn",
                    "the 5.15 local-tensor hooks (ids shifted by vocab_start_index, bias moved to _bias) nor DTensor "
                    "layers without them")


def _prepare_input_fn(wrapped, instance, args, kwargs):
    """Both layers' input hook (named after the hooks it wraps): the embedding's padding row made local, the
    rowwise bias taken out of the matmul before upstream would rename it."""
    from shardadopt.parallel.tp import localize_padding_idx, stash_rowwise_bias

    mod, _, device_mesh = args[:3]
    if hasattr(instance, "embedding_dim_sharding"):
        if instance.embedding_dim_sharding == 0:
            localize_padding_idx(mod, device_mesh.get_local_rank())
    else:
        stash_rowwise_bias(mod)  # upstream then finds no bias to move
    return wrapped(*args, **kwargs)


def _prepare_output_fn(wrapped, instance, args, kwargs):
    from shardadopt.parallel.tp import add_stashed_bias

    return add_stashed_bias(args[0], wrapped(*args, **kwargs))


def _tensor_parallel(model, layout) -> bool:
    """A model sharded with tensor parallelism needs this fix to train right."""
    return layout.tp_size > 1



PATCH = Patch(
    id="transformers-tp-legacy-layers",
    summary="TP on transformers 5.15: a vocab-parallel embedding's padding_idx made local to each rank's shard (a "
            "real token's row got no gradient, or the lookup raised) and a rowwise projection's bias kept under its "
            "name (it became `_bias` at the first forward, missing from checkpoints)",
    upstream="backport: transformers 5.16 replaced these layers with DTensor ones",
    requires=supported("transformers"),
    wrappers={EMBEDDING_PARALLEL_PREPARE_INPUT: _prepare_input_fn,
              ROWWISE_PARALLEL_PREPARE_INPUT: _prepare_input_fn,
              ROWWISE_PARALLEL_PREPARE_OUTPUT: _prepare_output_fn},
    needed_by=_tensor_parallel,
    probe=probe,
)
