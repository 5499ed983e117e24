"""Tiny random checkpoints that load offline with ``from_pretrained``, for tests, selftest and benchmarks."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterable

_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
VOCAB_SIZE = _COMMON["vocab_size"]


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**_COMMON))


def _qwen3moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**_COMMON, moe_intermediate_size=32, num_experts=4,
                                              num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[]))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**_COMMON, tie_word_embeddings=True))


# Classification heads (score on top of the base model). Sequence classification pools the last non-pad token,
# so pad_token_id is set; token classification's dropout is off (a one-process reference cannot draw the masks
# the ranks draw).
SEQUENCE_LABELS, TOKEN_LABELS, PAD_ID = 3, 5, 0


def _qwen3_seqcls():
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    return Qwen3ForSequenceClassification(Qwen3Config(**_COMMON, num_labels=SEQUENCE_LABELS, pad_token_id=PAD_ID))


def _llama_tokcls():
    from transformers import LlamaConfig, LlamaForTokenClassification

    return LlamaForTokenClassification(LlamaConfig(**_COMMON, num_labels=TOKEN_LABELS, pad_token_id=PAD_ID,
                                                   classifier_dropout=0.0))


BUILDERS: dict[str, Callable] = {"qwen3": _qwen3, "qwen3moe": _qwen3moe, "llama": _llama}
# written only when named (the test session's causal-LM set stays as it was)
HEAD_BUILDERS: dict[str, Callable] = {"qwen3-seqcls": _qwen3_seqcls, "llama-tokcls": _llama_tokcls}
MOE_MODELS = frozenset({"qwen3moe"})


def tiny_checkpoints(root: str | os.PathLike, names: Iterable[str] | None = None) -> dict[str, str]:
    """Write (once) tiny random checkpoints under ``root``; name -> checkpoint directory. ``names`` default to the
    causal LMs (:data:`BUILDERS`); the classification heads (:data:`HEAD_BUILDERS`) are written when named.

    Each is written to a temporary directory and renamed into place, so concurrent callers and interrupted runs
    never see a half-written checkpoint.
    """
    import torch

    root = os.fspath(root)
    os.makedirs(root, exist_ok=True)
    paths = {}
    builders = {**BUILDERS, **HEAD_BUILDERS}
    for name in names or BUILDERS:
        if name not in builders:
            raise ValueError(f"unknown tiny model {name!r}; known: {sorted(builders)}")
        path = os.path.join(root, f"tiny-{name}")
        if not os.path.exists(os.path.join(path, "config.json")):
            with torch.random.fork_rng():
                torch.manual_seed(0)
                model = builders[name]()
            staging = tempfile.mkdtemp(prefix=f".tiny-{name}-", dir=root)
            model.save_pretrained(staging)
            if not os.path.exists(os.path.join(staging, "config.json")):
                # under torch.distributed transformers writes from global rank 0 only: wait for its copy
                shutil.rmtree(staging, ignore_errors=True)
                _wait_for(os.path.join(path, "config.json"))
                paths[name] = path
                continue
            try:
                os.rename(staging, path)
            except OSError:  # another process won the race; its copy is identical
                shutil.rmtree(staging, ignore_errors=True)
        paths[name] = path
    return paths


def _wait_for(file: str, timeout: float = 600.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not os.path.exists(file):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{file} did not appear within {timeout:.0f}s: under torch.distributed only global "
                               f"rank 0 writes tiny checkpoints, so call tiny_checkpoints on rank 0 too")
        time.sleep(0.2)


def token_batch(seed: int, batch_size: int, seq_len: int = 16):
    """A deterministic batch of token ids (the same on every process for the same seed)."""
    import torch

    return torch.randint(0, VOCAB_SIZE, (batch_size, seq_len), generator=torch.Generator().manual_seed(seed))


def full(tensor):
    """The full value of a DTensor (a collective on its mesh), or the tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def local_copy(tensor):
    """A detached copy of this rank's local shard of a DTensor, or of the tensor itself."""
    from torch.distributed.tensor import DTensor

    from shardadopt import upstream

    return (upstream.dtensor_local(tensor) if isinstance(tensor, DTensor) else tensor).detach().clone()


HAND_SHARDED_LAYOUTS = ("plain", "fsdp", "tp", "partial-mesh", "ambiguous")


def hand_sharded_mlp(layout: str, width: int = 4):
    """A two-layer MLP sharded by hand over the whole world (call on every rank of an initialised group).

    ``fsdp``: ``fully_shard``; ``tp``: colwise/rowwise ``parallelize_module``; ``partial-mesh``: each rank shards
    over a mesh of itself only (the mesh misses the other ranks); ``ambiguous``: two differently named non-FSDP
    meshes (which one is tensor parallel?); ``plain``: not sharded.
    """
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if layout not in HAND_SHARDED_LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; known: {HAND_SHARDED_LAYOUTS}")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width))
    world = dist.get_world_size()
    if layout == "fsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    elif layout == "tp":
        parallelize_module(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)),
                           {"0": ColwiseParallel(), "2": RowwiseParallel()})
    elif layout == "partial-mesh":
        fully_shard(model, mesh=DeviceMesh("cpu", [dist.get_rank()]))
    elif layout == "ambiguous":
        parallelize_module(model[0], init_device_mesh("cpu", (world,), mesh_dim_names=("a",)), ColwiseParallel())
        parallelize_module(model[2], init_device_mesh("cpu", (world,), mesh_dim_names=("b",)), RowwiseParallel())
    return model


def token_dataset(n: int, offset: int = 0, seq_len: int = 16):
    """``n`` deterministic causal-LM samples ``{"input_ids", "labels"}`` (sample i seeded by ``i + offset``)."""
    import torch

    class TokenDataset(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return n

        def __getitem__(self, i: int) -> dict:
            ids = torch.randint(0, VOCAB_SIZE, (seq_len,), generator=torch.Generator().manual_seed(i + offset))
            return {"input_ids": ids, "labels": ids.clone()}

    return TokenDataset()
