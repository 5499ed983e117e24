"""transformers-fused-weight-sharding: a checkpoint tensor that a weight conversion splits (HRM's fused gqkv_proj)
is read whole and each converted tensor sharded by its own parameter's layout, not sliced with the first
target's bounds before the split."""

from upstream_diffs import LICENSE_HEADER, Edit, Fix, NewFile, Variant

TEST = LICENSE_HEADER + '''\
import sys

from transformers.testing_utils import (
    TestCasePlus,
    execute_subprocess_async,
    get_torch_dist_unique_port,
    require_torch,
)


class TestShardedLoadOfFusedCheckpointTensors(TestCasePlus):
    @require_torch
    def test_chunked_projections_hold_their_own_rows(self):
        checkpoint = self.get_auto_remove_tmp_dir()
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            f"--master_port={get_torch_dist_unique_port()}",
            self.test_file_path,
            checkpoint,
        ]
        execute_subprocess_async(cmd, env=self.get_env())


if __name__ == "__main__":
    # Runs on each of 2 ranks (gloo, CPU). HRM checkpoints store each attention's gate/q/k/v as one fused
    # attn.gqkv_proj, which the conversion mapping chunks into the four projections: with fsdp_size=2 every
    # projection must hold its own half of its own rows, not a quarter of the fused tensor's half.
    import torch
    import torch.distributed as dist

    from transformers import AutoModelForCausalLM, HrmTextConfig, HrmTextForCausalLM
    from transformers.distributed import DistributedConfig

    checkpoint = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        torch.manual_seed(0)
        config = HrmTextConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            head_dim=8, H_cycles=1, L_cycles=1, L_bp_cycles=[1],
        )
        HrmTextForCausalLM(config).save_pretrained(checkpoint)
    dist.barrier()

    reference = AutoModelForCausalLM.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, distributed_config=DistributedConfig(fsdp_size=2))
    names = [name for name, _ in reference.named_parameters() if name.endswith(("_proj.weight"))]
    assert any("self_attn.q_proj" in name for name in names), names
    for name in names:
        got = model.get_parameter(name).full_tensor()
        assert torch.equal(got, reference.get_parameter(name)), f"rank {rank}: {name} differs from one process"
    dist.destroy_process_group()
'''

SPAWN_OLD = """            if is_dtensor(empty_param):
                sharding_op = DtensorShardOperation(empty_param)
"""
SPAWN_NEW = """            if is_dtensor(empty_param):
                sharding_op = DtensorShardOperation(empty_param)
                # `empty_param` is the first target of a conversion: a tensor the conversion splits (e.g. a fused
                # qkv) sliced with its bounds would give every target the wrong rows. Read it whole instead,
                # `WeightConverter.convert` shards each converted tensor by its own param
                if isinstance(mapping, WeightConverter) and differs_along_sharded_dim(tensor, empty_param):
                    sharding_op = None
"""
CONVERT_OLD = """        # some quantizers need to already rename in `convert` as they cannot only rely on prefix and suffix
        except StopIteration:
            pass

"""
CONVERT_NEW = """        # some quantizers need to already rename in `convert` as they cannot only rely on prefix and suffix
        except StopIteration:
            pass

        # tensors read whole (see `differs_along_sharded_dim`) come out of the operations whole: shard them
        if model is not None:
            collected_tensors = {k: shard_like_param(model, k, v) for k, v in collected_tensors.items()}

"""
HELPER_OLD = """@torch.no_grad()
def set_param_for_module(
"""
HELPER_NEW = """def differs_along_sharded_dim(source, param) -> bool:
    \"\"\"Whether a checkpoint tensor with as many dims as the DTensor `param` differs from it along a dim `param` is
    sharded on: a fused tensor a conversion splits into several params (or one of several it joins). Its contiguous
    slice would take the wrong rows: it has to be converted whole and each result sharded.\"\"\"
    source_shape = list(source.shape) if isinstance(source, torch.Tensor) else source.get_shape()
    if len(source_shape) != param.ndim:
        return False
    sharded = {p.dim % param.ndim for p in param.placements if hasattr(p, "dim")}
    return any(source_shape[dim] != param.shape[dim] for dim in sharded)


def shard_like_param(model: PreTrainedModel, target_name: str, value):
    \"\"\"`value` sharded by the layout of the DTensor param `target_name` when it has that param's full shape.\"\"\"
    tensor = value[0] if isinstance(value, list) else value
    module_path, _, param_name = target_name.rpartition(".")
    try:
        ref = getattr(model.get_submodule(module_path) if module_path else model, param_name, None)
    except AttributeError:
        return value
    if not isinstance(tensor, torch.Tensor) or not is_dtensor(ref) or tensor.shape != ref.shape:
        return value
    if ref._local_tensor.shape == ref.shape:
        return value
    shard = DtensorShardOperation(ref).shard_tensor(tensor, device=tensor.device, dtype=tensor.dtype)
    return [shard, *value[1:]] if isinstance(value, list) else shard


@torch.no_grad()
def set_param_for_module(
"""
LOADING = "src/transformers/core_model_loading.py"

EDITS = (
    Edit(LOADING, SPAWN_OLD, SPAWN_NEW),
    Edit(LOADING, CONVERT_OLD, CONVERT_NEW),
    Edit(LOADING, HELPER_OLD, HELPER_NEW),
)
NEW_FILES = (NewFile("tests/distributed/test_fused_weight_sharding.py", TEST),)

FIX = Fix(
    id="transformers-fused-weight-sharding",
    distribution="transformers",
    kind="proposal",
    upstream="huggingface/transformers main (not reported upstream yet; still present in 5.25.0)",
    summary="""
        A WeightConverter that splits one checkpoint tensor into several params (HRM's attn.gqkv_proj chunked
        into gate/q/k/v, mlp.gate_up_proj into gate/up) gets the shard operation of its first target, and
        convert_and_load_state_dict_in_model applies it while reading: the fused [4h, d] tensor is cut in two
        halves (gate and q on rank 0, k and v on rank 1) and each half chunked in four, so with tp_size=2 or
        fsdp_size=2 every rank's projections hold the wrong rows and the model trains silently wrong (the first
        attention's output is 100 % off from one process).

        Read such a tensor whole (it differs from its first target along a dim the target is sharded on), run
        the conversion on whole tensors and shard each converted tensor by its own param's layout. This covers
        every DTensor layout (tensor parallelism from 5.16, FSDP); transformers 5.15's local-tensor TP layers
        need the same for their shard_tensor (shardadopt's patch does both). The test loads a one-layer HRM with
        fsdp_size=2 (gloo, CPU) and compares every projection with one process.
    """,
    variants=(
        # 5.15 builds 5.15's local-tensor TP layers next to the DTensor shard op: the same edits, other context
        Variant(since="5.15.0", edits=EDITS, new_files=NEW_FILES),
        Variant(since="5.16.1", edits=EDITS, new_files=NEW_FILES),
        # 5.25 rewrote the comment above the conversion spawn (force_cpu): the same edits, other context
        Variant(since="5.25.0", edits=EDITS, new_files=NEW_FILES),
    ),
)
