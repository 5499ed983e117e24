"""transformers-tp-heads-refused: a tp_size that does not divide the heads of an attention projection the TP plan
splits colwise is refused at load, with the head counts and the fix, instead of failing at the first forward."""

from upstream_diffs import LICENSE_HEADER, Edit, Fix, NewFile, Variant

TEST = LICENSE_HEADER + '''\
import sys

from transformers.testing_utils import (
    TestCasePlus,
    execute_subprocess_async,
    get_torch_dist_unique_port,
    require_torch,
)


class TestTensorParallelHeads(TestCasePlus):
    @require_torch
    def test_indivisible_key_value_heads_are_refused_at_load(self):
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
    # Runs on each of 2 ranks (gloo, CPU): a multi-query Llama (one key/value head) loaded with tp_size=2 must be
    # refused at load on every rank, naming the heads; before the fix it loaded and its first forward failed to
    # reshape the half head each rank held.
    import torch
    import torch.distributed as dist

    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    checkpoint = sys.argv[1]
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        config = LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1,
        )
        LlamaForCausalLM(config).save_pretrained(checkpoint)
    dist.barrier()
    try:
        AutoModelForCausalLM.from_pretrained(checkpoint, distributed_config=DistributedConfig(tp_size=2))
    except ValueError as error:
        assert "num_key_value_heads=1" in str(error) and "tp_size=2" in str(error), error
    else:
        raise AssertionError("a tp_size that does not divide num_key_value_heads was accepted")
    dist.destroy_process_group()
'''

HELPER_ANCHOR = "class DistributedMixin:\n"
HELPER = '''def _verify_tp_head_split(model: "nn.Module", tp_plan: dict[str, str], tp_size: int) -> None:
    """
    Raise if `tp_plan` splits an attention projection by heads (`colwise` on `q_proj`/`k_proj`/`v_proj`) whose head
    count `tp_size` does not divide: each rank would hold part of a head, and the first forward would fail to reshape
    it (a multi-query model such as PaliGemma on tp_size=2).
    """
    heads_field = {"q_proj": "num_attention_heads", "k_proj": "num_key_value_heads", "v_proj": "num_key_value_heads"}
    for name, module in model.named_modules():
        parent, _, last = name.rpartition(".")
        style = tp_plan.get(name) or tp_plan.get(re.sub(r"\\.\\d+(\\.|$)", r".*\\1", name))
        if last not in heads_field or style != "colwise":
            continue
        head_dim = getattr(model.get_submodule(parent), "head_dim", None)
        out_features = getattr(module, "out_features", None)
        if not isinstance(head_dim, int) or not isinstance(out_features, int) or out_features % head_dim:
            continue
        heads = out_features // head_dim
        if heads % tp_size:
            raise ValueError(
                f"{model.__class__.__name__}: tp_size={tp_size} does not divide {heads_field[last]}={heads} of "
                f"`{name}`, which the tensor parallel plan splits by heads. Use a tp_size that divides the heads, or "
                "shard the model with `fsdp_size` instead."
            )


''' + HELPER_ANCHOR


def _check_before(apply: str, plan: str, indent: str) -> Edit:
    return Edit("src/transformers/distributed/mixin.py", apply,
                f"{indent}_verify_tp_head_split(model, {plan}, distributed_config.tp_size)\n" + apply)


HELPER_EDIT = Edit("src/transformers/distributed/mixin.py", HELPER_ANCHOR, HELPER)
# transformers 5.15: the plan is the config's, else the model's
APPLY_515 = "                model = apply_tensor_parallelism(\n"
PLAN_515 = "distributed_config.tp_plan if isinstance(distributed_config.tp_plan, dict) else model.tp_plan or {}"
# 5.16 - 5.18: the config's plan is set on the model first
APPLY_516 = "                model = apply_tensor_parallelism(model, tp_mesh)\n"
# 5.19+: the resolved plan
APPLY_519 = '            model = apply_tensor_parallelism(model, mesh_manager.get_mesh("tp"), tp_plan)\n'

FIX = Fix(
    id="transformers-tp-heads-refused",
    distribution="transformers",
    kind="proposal",
    upstream="huggingface/transformers main (not reported upstream yet; still present in 5.25.0)",
    summary="""
        A tensor parallel plan that shards q_proj / k_proj / v_proj colwise splits their output features evenly
        over the TP ranks, and attention views each rank's slice as whole heads. Nothing checks that tp_size divides
        the heads: a multi-query model (PaliGemma, whose Gemma 2B language model has one key/value head) loads with
        DistributedConfig(tp_size=2), and its first forward fails with "RuntimeError: shape '[2, 28, -1, 16]' is
        invalid", which names neither the heads nor the fix (get_kv_heads_per_rank only serves the static cache).

        maybe_distribute_model now checks every projection the plan splits colwise against its attention module's
        head_dim before applying tensor parallelism, and raises a ValueError naming the projection, its head count
        and tp_size. The test loads a Llama with one key/value head with tp_size=2 on 2 gloo ranks and expects the
        error on every rank.
    """,
    variants=(
        Variant(since="5.15.0", edits=(HELPER_EDIT, _check_before(APPLY_515, PLAN_515, " " * 16)),
                new_files=(NewFile("tests/tensor_parallel/test_tp_heads.py", TEST),)),
    ) + tuple(
        # the same change; upstream changed the code around it in 5.18
        Variant(since=since, edits=(HELPER_EDIT, _check_before(APPLY_516, "model.tp_plan or {}", " " * 16)),
                new_files=(NewFile("tests/tensor_parallel/test_tp_heads.py", TEST),))
        for since in ("5.16.1", "5.18.0")
    ) + tuple(
        # the same change; upstream changed the code around it in 5.23
        Variant(since=since, edits=(HELPER_EDIT, _check_before(APPLY_519, "tp_plan", " " * 12)),
                new_files=(NewFile("tests/tensor_parallel/test_tp_heads.py", TEST),))
        for since in ("5.19.0", "5.23.0")
    ),
)
