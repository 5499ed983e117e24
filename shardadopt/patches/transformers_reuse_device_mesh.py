"""transformers 5.18+: a model sharded at load time reuses the device mesh of an earlier load with the same layout.

``DistributedMixin.prepare_distribute_model`` (``transformers/distributed/mixin.py``) builds the meshes anew on every
``from_pretrained(..., distributed_config=...)``::

    device_map, mesh_manager = initialize_distributed_mesh(distributed_config)

and ``initialize_distributed_mesh`` (``transformers/distributed/utils.py``) calls
``torch.distributed.init_device_mesh`` for the dense and the expert mesh each time (5.18: one mesh). Every call
creates process groups for its dimensions that nothing destroys. Measured on 2 gloo ranks: 6 more per load with
5.24, 4 with 5.20 / 5.22; 5.18's single mesh adds groups only for layouts of several dimensions (2-D, HSDP), since
torch backs a mesh over the whole world with the default group. A hyperparameter search whose ``model_init`` shards
while loading builds one model per trial, so groups, their connections and threads (and, on NCCL, communicators
holding GPU memory) pile up trial after trial. The wrapper routes the call through
:func:`shardadopt.loadtime.reuse_device_mesh`, so every load with the same ``*_size`` fields gets the first load's
meshes.

transformers 5.15 .. 5.17 build 1-D meshes over the world, which torch backs with the default process group: nothing
to reuse (``not-needed``).
"""

from __future__ import annotations

from shardadopt import upstream
from shardadopt.patching.contract import Patch, Probe, Target
from shardadopt.upstream.probing import body_calls, calls, if_chains, source_tree, undecided
from shardadopt.upstream.versions import supported

MODULE = "transformers.distributed.mixin"
BUILDER = "initialize_distributed_mesh"


_ONE_D = ("initialize_tensor_parallelism", "initialize_fully_sharded_data_parallelism")


def probe() -> Probe:
    """Parse ``DistributedMixin.prepare_distribute_model`` and the mesh builder it calls."""
    from transformers.distributed import mixin

    where = "transformers-reuse-device-mesh probe"
    prepare = source_tree(upstream.upstream_method(Target(MODULE, "DistributedMixin.prepare_distribute_model"),
                                                   where))
    builder = getattr(mixin, BUILDER, None)
    if builder is not None and calls(prepare, BUILDER) and calls(source_tree(builder), "init_device_mesh"):
        return Probe(True, f"{BUILDER} builds new device meshes (a process group per dimension) on every sharded "
                           "load, and nothing destroys them")
    # 5.15 .. 5.17: one if/elif picks a TP or an FSDP mesh, each 1-D over the world (tp_size * fsdp_size must equal
    # the world size), which torch backs with the default process group.
    if builder is None and any(all(any(body_calls(body, name) for _, body in chain) for name in _ONE_D)
                               for chain in if_chains(prepare)):
        return Probe(False, "this transformers builds one 1-D mesh over the world per load (the default process "
                            "group; no per-load groups)")
    raise undecided("DistributedMixin.prepare_distribute_model", f"a call of {BUILDER} building meshes with "
                    "init_device_mesh (this patch's broken shape) nor the 1-D TP-or-FSDP meshes of 5.15 .. 5.17")


def _initialize_distributed_mesh(wrapped, instance, args, kwargs):
    from shardadopt.loadtime import reuse_device_mesh

    distributed_config = args[0] if args else kwargs["distributed_config"]
    return reuse_device_mesh(distributed_config, lambda: wrapped(*args, **kwargs))


PATCH = Patch(
    id="transformers-reuse-device-mesh",
    summary="sharded loads with the same layout reuse one device mesh (no new process groups per model / HPO trial)",
    upstream="not reported yet (transformers builds meshes per from_pretrained from 5.18 on)",
    requires=supported("transformers"),
    wrappers={Target(MODULE, BUILDER): _initialize_distributed_mesh},
    probe=probe,
)
