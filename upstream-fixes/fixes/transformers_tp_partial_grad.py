"""transformers-tp-partial-grad: Apertus' TP plan lists the xIELU activation (scalar parameters inside the
colwise -> rowwise MLP), so its partial gradients are summed over the TP mesh."""

from upstream_diffs import LICENSE_HEADER, Edit, Fix, NewFile

TEST = LICENSE_HEADER + '''\
import sys

from transformers.testing_utils import (
    TestCasePlus,
    execute_subprocess_async,
    get_torch_dist_unique_port,
    require_torch,
)


class TestApertusTensorParallelActivationGradients(TestCasePlus):
    @require_torch
    def test_xielu_gradients_match_single_process(self):
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
    # Runs on each of 2 ranks (gloo, CPU), tp_size=2: the xIELU activation sits between the colwise up_proj and the
    # rowwise down_proj, so each rank's alpha_p/alpha_n gradient covers only its half of the intermediate features.
    import torch
    import torch.distributed as dist

    from transformers import ApertusConfig, ApertusForCausalLM, AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    checkpoint = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        torch.manual_seed(0)
        config = ApertusConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2,
        )
        ApertusForCausalLM(config).save_pretrained(checkpoint)
    dist.barrier()
    input_ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    model = AutoModelForCausalLM.from_pretrained(checkpoint, distributed_config=DistributedConfig(tp_size=2))
    reference = AutoModelForCausalLM.from_pretrained(checkpoint)
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    reference(input_ids=input_ids, labels=input_ids).loss.backward()

    reference_grads = {name: param.grad for name, param in reference.named_parameters()}
    activations = [name for name, _ in model.named_parameters() if ".act_fn." in name]
    assert len(activations) == 4, activations
    mismatched = [
        name
        for name in activations
        if not torch.allclose(model.get_parameter(name).grad, reference_grads[name], rtol=1e-5, atol=1e-7)
    ]
    assert not mismatched, f"rank {rank}: xIELU gradients differ from a single process in {mismatched}"
    dist.destroy_process_group()
'''

PLAN_OLD = '        "layers.*.mlp.up_proj": "colwise",\n        "layers.*.mlp.down_proj": "rowwise",\n    }\n'
PLAN_NEW = (
    '        "layers.*.mlp.up_proj": "colwise",\n'
    '        # xIELU keeps scalar parameters whole on every rank but sees only this rank\'s intermediate features\n'
    '        "layers.*.mlp.act_fn": "replicated_with_grad_allreduce",\n'
    '        "layers.*.mlp.down_proj": "rowwise",\n'
    "    }\n"
)

FIX = Fix(
    id="transformers-tp-partial-grad",
    distribution="transformers",
    kind="proposal",
    upstream="huggingface/transformers main (not reported upstream yet; still present in 5.24.0)",
    summary="""
        Apertus' MLP applies the xIELU activation, whose scalar parameters alpha_p and alpha_n every rank holds
        whole, between the colwise up_proj and the rowwise down_proj. Under tensor parallelism each rank's
        activation sees only its own intermediate features, so each rank's alpha_p/alpha_n gradient is a partial
        sum, and the plan leaves the module out: nothing sums them, every rank trains its own values and the
        model drifts away from one process (tiny Apertus, tp_size=2: first-step gradients off by up to 10^4 times
        fp32 noise).

        List the activation as replicated_with_grad_allreduce, the style Qwen3's q_norm/k_norm use for the same
        situation. Apertus 1.5 (added after 5.15) has the same MLP and the same plan gap. The test compares the
        xIELU gradients of a two-layer Apertus with tp_size=2 (gloo, CPU) with one process.
    """,
    edits=(
        Edit("src/transformers/models/apertus/modular_apertus.py", PLAN_OLD, PLAN_NEW),
        Edit("src/transformers/models/apertus/configuration_apertus.py", PLAN_OLD, PLAN_NEW),
    ),
    new_files=(NewFile("tests/models/apertus/test_tensor_parallel_activation.py", TEST),),
)
