"""transformers-reuse-device-mesh: sharded loads with the same layout reuse one device mesh (no new process groups)."""

from upstream_diffs import LICENSE_HEADER, Edit, Fix, NewFile, Variant

TEST = LICENSE_HEADER + '''\
import sys

from transformers.testing_utils import (
    TestCasePlus,
    execute_subprocess_async,
    get_torch_dist_unique_port,
    require_torch,
)


class TestDeviceMeshReuse(TestCasePlus):
    @require_torch
    def test_sharded_loads_with_one_layout_create_no_new_process_groups(self):
        checkpoint = self.get_auto_remove_tmp_dir()
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=4",
            f"--master_port={get_torch_dist_unique_port()}",
            self.test_file_path,
            checkpoint,
        ]
        execute_subprocess_async(cmd, env=self.get_env())


if __name__ == "__main__":
    # Runs on each of 4 ranks (gloo, CPU), loading one checkpoint 2-D sharded (fsdp x tp) three times, as a
    # hyperparameter search does with one model per trial.
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    checkpoint = sys.argv[1]
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        config = LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
        LlamaForCausalLM(config).save_pretrained(checkpoint)
    dist.barrier()

    def load():
        return AutoModelForCausalLM.from_pretrained(
            checkpoint, distributed_config=DistributedConfig(fsdp_size=2, tp_size=2)
        )

    input_ids = torch.arange(8).reshape(1, 8)
    with torch.no_grad():
        expected = load()(input_ids).logits
        groups_after_first_load = len(_world.pg_map)
        for _ in range(2):
            logits = load()(input_ids).logits
            torch.testing.assert_close(logits, expected)
    assert len(_world.pg_map) == groups_after_first_load, (
        f"{len(_world.pg_map) - groups_after_first_load} process groups more after two more loads with one layout"
    )
    dist.destroy_process_group()
'''

MESH_CACHE = '''\
# Device meshes built so far, per layout: `init_device_mesh` creates a process group per mesh dimension and nothing
# destroys them, so new meshes on every sharded `from_pretrained` (one model per hyperparameter-search trial, say)
# pile process groups up. A mesh is reused only within the default process group it was built in.
_DEVICE_MESHES: dict[tuple, tuple] = {}


def _init_device_mesh(device_type: str, mesh_shape: tuple[int, ...], mesh_dim_names: tuple[str, ...]):
    """`torch.distributed.init_device_mesh`, built once per layout and default process group."""
    key = (device_type, tuple(mesh_shape), tuple(mesh_dim_names))
    world = torch.distributed.group.WORLD
    built = _DEVICE_MESHES.get(key)
    if built is None or built[0] is not world:
        mesh = torch.distributed.init_device_mesh(device_type, mesh_shape, mesh_dim_names=mesh_dim_names)
        built = _DEVICE_MESHES[key] = (world, mesh)
    return built[1]


'''

UTILS = "src/transformers/distributed/utils.py"
ADD_CACHE = Edit(UTILS, "def initialize_distributed_mesh(\n", MESH_CACHE + "def initialize_distributed_mesh(\n")


def use_cache(meshes: int) -> Edit:
    return Edit(UTILS, "= torch.distributed.init_device_mesh(\n        device_type,\n",
                "= _init_device_mesh(\n        device_type,\n", count=meshes)


TEST_FILE = NewFile("tests/distributed/test_device_mesh_reuse.py", TEST)

FIX = Fix(
    id="transformers-reuse-device-mesh",
    distribution="transformers",
    kind="proposal",
    upstream="transformers main (not reported yet; every release from 5.18 to 5.24 builds meshes per load)",
    summary="""
        initialize_distributed_mesh calls torch.distributed.init_device_mesh on every
        from_pretrained(..., distributed_config=...), and every mesh of more than one dimension creates a process
        group per dimension that nothing destroys: on 2 gloo ranks 4 to 6 more groups per load from 5.19 on (a dense
        and an expert mesh), on 5.18 for 2-D and HSDP layouts. A hyperparameter search whose model_init shards while
        loading builds one model per trial, so groups, their connections and threads (on NCCL: communicators holding
        GPU memory) accumulate trial after trial.

        Build each mesh once per layout (device type, shape, dimension names) and default process group, and hand
        it out again: models loaded with one layout then share one mesh, as the parts of a torchtitan model do, and a
        re-initialised default group gets new meshes. The test loads a 2-D (fsdp x tp) model three times on 4 ranks
        and checks the process-group count and the logits.

        Left out of this diff (shardadopt does it at runtime): rebuilding a cached mesh whose subgroup a user
        destroyed with destroy_process_group(group), and a lock for loads from several threads.
    """,
    variants=(
        # 5.18: one mesh over the configured dimensions
        Variant("5.18", edits=(ADD_CACHE, use_cache(1)), new_files=(TEST_FILE,)),
        # 5.19: a dense and an expert mesh
        Variant("5.19", edits=(ADD_CACHE, use_cache(2)), new_files=(TEST_FILE,)),
        # 5.20 and 5.23 changed the mesh shapes (dp_replicate) and the device binding around the calls
        Variant("5.20", edits=(ADD_CACHE, use_cache(2)), new_files=(TEST_FILE,)),
        Variant("5.23", edits=(ADD_CACHE, use_cache(2)), new_files=(TEST_FILE,)),
    ),
)
