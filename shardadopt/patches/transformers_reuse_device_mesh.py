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

import ast
import inspect
import textwrap

from shardadopt.registry import Patch, Probe, Target

MODULE = "transformers.distributed.mixin"
BUILDER = "initialize_distributed_mesh"


def _calls(function, name: str) -> bool:
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return any(isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == name
               for node in ast.walk(tree))


def probe() -> Probe:
    from transformers.distributed import mixin

    builder = getattr(mixin, BUILDER, None)
    if builder is None:
        return Probe(False, "this transformers builds 1-D meshes over the default process group (no per-load groups)")
    if not _calls(builder, "init_device_mesh"):
        return Probe(False, f"{BUILDER} does not build a new device mesh on every call")
    return Probe(True, f"{BUILDER} builds new device meshes (a process group per dimension) on every sharded load, "
                       "and nothing destroys them")


def _initialize_distributed_mesh(wrapped, instance, args, kwargs):
    from shardadopt.loadtime import reuse_device_mesh

    distributed_config = args[0] if args else kwargs["distributed_config"]
    return reuse_device_mesh(distributed_config, lambda: wrapped(*args, **kwargs))


PATCH = Patch(
    id="transformers-reuse-device-mesh",
    summary="sharded loads with the same layout reuse one device mesh (no new process groups per model / HPO trial)",
    upstream="not reported yet (transformers 5.18 .. 5.24 build meshes per from_pretrained)",
    requires={"transformers": ">=5.15,<5.25"},
    wrappers={Target(MODULE, BUILDER): _initialize_distributed_mesh},
    probe=probe,
)
