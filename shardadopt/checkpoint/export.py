"""Full-weight export: consolidated safetensors for a plain ``from_pretrained``, gathered one tensor at a time."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
from typing import Any

import torch
import torch.distributed as dist

from shardadopt import upstream
from shardadopt.checkpoint.errors import CheckpointError
from shardadopt.checkpoint.publish import publish_files, staging_path
from shardadopt.checkpoint.sharding import barrier, is_dtensor, rank_local
from shardadopt.fence import fenced
from shardadopt.parallel.topology import rank_and_world_size

_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    text = size.strip().upper()
    for unit, factor in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def _unique_state(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's state dict entries in order, each tensor once (tied weights keep their first name)."""
    seen: set[int] = set()
    out = []
    for name, tensor in model.state_dict().items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        out.append((name, tensor))
    return out


def _reverter(model: torch.nn.Module, original_format: bool):
    """A function mapping one in-memory (name, tensor) to the checkpoint-format tensors transformers would save."""
    if not original_format or not hasattr(model, "config"):
        return lambda name, tensor: {name: tensor}
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return lambda name, tensor: {name: tensor}

    def revert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        try:
            return revert_weight_conversion(model, {name: tensor})
        except Exception as exc:
            raise CheckpointError(
                f"could not convert {name} back to the checkpoint format on its own ({type(exc).__name__}: {exc}); "
                f"export with original_format=False (from_pretrained loads the in-memory names too)") from exc

    return revert


def _full_value(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor on CPU (a collective for a DTensor: every rank must call it in the same order)."""
    if is_dtensor(tensor):
        tensor = tensor.full_tensor()
    return tensor.detach().to("cpu")


def _pieces(tensor: Any) -> list[tuple[int, tuple[slice, ...]]] | None:
    """For a DTensor laid out with ``Shard``/``Replicate`` only on a mesh that holds rank 0: (global rank, the box
    of the global tensor it holds) for one holder of each distinct piece (coordinate 0 on replicated mesh dims),
    empty pieces left out. ``None`` when the layout needs ``full_tensor`` (``Partial``, strided shards, ...)."""
    from torch.distributed.tensor import Replicate, Shard

    placements = tensor.placements
    ranks = tensor.device_mesh.mesh
    if not all(type(p) in (Shard, Replicate) for p in placements) or not (ranks == 0).any():
        return None
    out = []
    for coordinate in torch.cartesian_prod(*[torch.arange(n) for n in ranks.shape]).reshape(-1, ranks.dim()).tolist():
        if any(isinstance(p, Replicate) and c != 0 for p, c in zip(placements, coordinate)):
            continue
        shape, offset = upstream.compute_local_shape_and_global_offset(tensor.shape, ranks.shape, coordinate,
                                                                       placements)
        if all(n > 0 for n in shape):
            out.append((int(ranks[tuple(coordinate)]), tuple(slice(o, o + n) for o, n in zip(offset, shape))))
    return out


# Device types each backend's send/recv take (torch.distributed's backend table): gloo's point-to-point hands the
# tensor's data pointer to its TCP transport, so CUDA tensors must not reach it; NCCL takes CUDA tensors only.
_P2P_DEVICE_TYPES = {"gloo": ("cpu",), "nccl": ("cuda",), "xccl": ("xpu",)}


def _p2p_device(local: torch.device) -> torch.device:
    """Where a tensor on ``local`` goes through ``dist.send``/``dist.recv`` on the default group: ``local`` when
    the backend serving that device type sends it (CUDA on NCCL, CPU on gloo, either on ``cpu:gloo,cuda:nccl``),
    else a device that backend does send (CPU shards under NCCL: the current GPU; CUDA shards under gloo: CPU)."""
    backend = str(dist.get_backend())
    if ":" in backend:  # one backend per device type, e.g. "cpu:gloo,cuda:nccl"
        served = [tuple(item.split(":", 1)) for item in backend.split(",")]
    else:
        served = [(kind, backend) for kind in upstream.backend_device_types()]
    usable = [kind for kind, name in served if kind in _P2P_DEVICE_TYPES.get(name, (kind,))]
    if local.type in usable or not usable:
        return local
    kind = "cpu" if "cpu" in usable else usable[0]
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, torch.get_device_module(kind).current_device())


def _gather_to_root(tensor: torch.Tensor) -> torch.Tensor | None:
    """The full tensor on CPU on global rank 0, ``None`` elsewhere; a collective in the same order on every rank.

    ``DTensor.full_tensor()`` all-gathers the whole tensor to every rank (plus the collective's own buffers). Here
    rank 0 preallocates the full tensor once and receives each other holder's local piece straight into its place
    (point-to-point), so the other ranks allocate nothing and rank 0 holds one full parameter.
    """
    rank = rank_and_world_size()[1]
    if not is_dtensor(tensor):
        return tensor.detach().to("cpu") if rank == 0 else None
    pieces = _pieces(tensor)
    if pieces is None:
        value = _full_value(tensor)
        return value if rank == 0 else None
    local = tensor.to_local().detach()
    wire = _p2p_device(local.device)
    if rank != 0:
        if any(source == rank for source, _ in pieces):
            dist.send(local.to(wire).contiguous(), dst=0)
        return None
    full_value = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    for source, box in pieces:
        target = full_value[box]
        if source == 0:
            target.copy_(local)
        elif target.is_contiguous() and wire.type == "cpu":
            dist.recv(target, src=source)
        else:  # a non-contiguous box (a Shard(1) piece) or a device wire: through one piece-sized buffer
            buffer = torch.empty(target.shape, dtype=local.dtype, device=wire)
            dist.recv(buffer, src=source)
            target.copy_(buffer)
            del buffer
    return full_value


def full_state_dict(model: torch.nn.Module, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU tensors of ``model``'s state, gathered one parameter at a time.

    A collective. With ``rank0_only`` the other ranks return ``{}``: each tensor is gathered to rank 0 only (see
    :func:`save_full`), so no other rank allocates anything and only rank 0 ever holds the whole model.

    Args:
        model: the (sharded) model.
        rank0_only: gather to rank 0 only; the other ranks return ``{}``.

    Returns:
        Parameter and buffer name -> full CPU tensor.
    """
    out = {}
    with fenced("a full_state_dict gather"):  # rank 0 failing to allocate must not leave the senders waiting
        for name, tensor in model.state_dict().items():
            value = _gather_to_root(tensor) if rank0_only else _full_value(tensor)
            if value is not None:
                out[name] = value
    return out


def _write_safetensors_header(f, entries: list[tuple[str, torch.dtype, tuple[int, ...], int]]) -> int:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset,
                                                                                                   offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    return offset


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def save_full(model: torch.nn.Module, directory: str | os.PathLike, *, max_shard_size: int | str = "5GB",
              original_format: bool = True, write_config: bool = True) -> list[str]:
    """Write ``model``'s full weights as safetensors that a plain single-process ``from_pretrained`` loads.

    A collective over the model's ranks. Parameters are gathered one at a time to rank 0 only (into one
    preallocated tensor, point-to-point from the holders of each piece) and streamed into pre-planned safetensors
    files (the headers are written from the global shapes before any data), so rank 0 holds its own shard plus one
    full parameter and the other ranks nothing beyond their shards. With ``original_format`` the names and layout are
    converted back to the format transformers saves (e.g. fused MoE experts split per expert). Writes
    ``config.json`` (and ``generation_config.json``) with ``write_config``. Returns the weight files written
    (on rank 0; ``[]`` elsewhere).

    Args:
        model: the (sharded) model.
        directory: where the weights are written (the same path on every rank).
        max_shard_size: the largest safetensors file, in bytes or as ``"5GB"``.
        original_format: convert names and layout back to what transformers saves.
        write_config: also write the model's ``config.json`` (and generation config).

    Returns:
        The weight files written, on rank 0; ``[]`` on the other ranks.
    """
    from huggingface_hub import constants

    if rank_local(model):
        raise CheckpointError("save_full cannot gather tensor-parallel parameters that are plain per-rank shards "
                              "(this transformers release's TP does not use DTensor); use model.save_pretrained for "
                              "tensor parallelism alone (transformers 5.15 writes expert-parallel models with wrong "
                              "shapes: no consolidated export there)")
    directory = os.path.abspath(os.fspath(directory))
    rank = rank_and_world_size()[1]
    limit = _parse_size(max_shard_size)
    revert = _reverter(model, original_format)
    entries = _unique_state(model)

    # Plan on meta tensors: output names, dtypes, shapes, and which file each source tensor's outputs go to.
    plan: list[list[tuple[str, torch.dtype, tuple[int, ...], int]]] = []
    for name, tensor in entries:
        meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        plan.append([(n, t.dtype, tuple(t.shape), t.numel() * t.element_size()) for n, t in revert(name,
                                                                                                  meta).items()])
    files: list[list[int]] = [[]]
    size = 0
    for i, outputs in enumerate(plan):
        nbytes = sum(o[3] for o in outputs)
        if files[-1] and size + nbytes > limit:
            files.append([])
            size = 0
        files[-1].append(i)
        size += nbytes
    sharded = len(files) > 1
    names = ([f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))] if sharded
             else [constants.SAFETENSORS_SINGLE_FILE])

    with fenced(f"save_full into {directory}"):  # a rank raising anywhere in here: every rank raises
        staging = staging_path(directory)
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)  # left by an earlier crash
            os.makedirs(staging)
        for filename, members in zip(names, files):
            handle = open(os.path.join(staging, filename), "wb") if rank == 0 else contextlib.nullcontext()
            with handle as f:
                if rank == 0:
                    _write_safetensors_header(f, [o for i in members for o in plan[i]])
                for i in members:
                    name, tensor = entries[i]
                    value = _gather_to_root(tensor)  # every rank takes part; only rank 0 receives the full tensor
                    if rank == 0:
                        for (out_name, dtype, shape, _), (got_name, out) in zip(plan[i],
                                                                                  revert(name, value).items()):
                            if (got_name, out.dtype, tuple(out.shape)) != (out_name, dtype, shape):
                                raise CheckpointError(f"conversion of {name} gave {got_name} {tuple(out.shape)}, "
                                                      f"planned {out_name} {shape}")
                            f.write(_tensor_bytes(out))
                    del value
        if rank == 0:
            if sharded:
                index = {"metadata": {"total_size": sum(o[3] for outputs in plan for o in outputs)},
                         "weight_map": {o[0]: names[k] for k, members in enumerate(files) for i in members
                                        for o in plan[i]}}
                with open(os.path.join(staging, constants.SAFETENSORS_INDEX_FILE), "w") as f:
                    json.dump(index, f, indent=2, sort_keys=True)
            if write_config and hasattr(model, "config") and hasattr(model.config, "save_pretrained"):
                model.config.save_pretrained(staging)
                generation = getattr(model, "generation_config", None)
                if generation is not None and getattr(model, "can_generate", lambda: False)():
                    generation.save_pretrained(staging)
        # Rank 0 received every piece it wrote (each gather ends on rank 0), so it publishes at once; the others
        # wait for publication only.
        written = publish_files(staging, directory, names) if rank == 0 else []
        barrier()
    return written
