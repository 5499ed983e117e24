"""transformers-tp-replicated-grad-accumulation: the TP style ``replicated_with_grad_allreduce`` reduces each
backward's gradient once, so gradient accumulation gives the single-process gradient."""

from upstream_diffs import LICENSE_HEADER, Edit, Fix, NewFile, Variant

TEST = LICENSE_HEADER + '''\
import sys

from transformers.testing_utils import (
    TestCasePlus,
    execute_subprocess_async,
    get_torch_dist_unique_port,
    require_torch,
)


class TestReplicatedWithGradAllReduceAccumulation(TestCasePlus):
    @require_torch
    def test_accumulated_gradients_match_single_process(self):
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
    # Runs on each of 2 ranks (gloo, CPU), tp_size=2: Qwen3's q_norm/k_norm are `replicated_with_grad_allreduce`
    # (each rank's gradient covers its own heads). Two accumulated micro-batches must give their single-process
    # gradient, not one where the first micro-batch is summed over the ranks twice.
    import torch
    import torch.distributed as dist

    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM
    from transformers.distributed import DistributedConfig

    checkpoint = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        torch.manual_seed(0)
        config = Qwen3Config(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8,
        )
        Qwen3ForCausalLM(config).save_pretrained(checkpoint)
    dist.barrier()
    micro_batches = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0)).chunk(2)

    model = AutoModelForCausalLM.from_pretrained(checkpoint, distributed_config=DistributedConfig(tp_size=2))
    reference = AutoModelForCausalLM.from_pretrained(checkpoint)
    for input_ids in micro_batches:
        (model(input_ids=input_ids, labels=input_ids).loss / len(micro_batches)).backward()
        (reference(input_ids=input_ids, labels=input_ids).loss / len(micro_batches)).backward()

    reference_grads = {name: param.grad for name, param in reference.named_parameters()}
    norms = [name for name, _ in model.named_parameters() if ".q_norm." in name or ".k_norm." in name]
    assert len(norms) == 4, norms
    mismatched = [
        name
        for name in norms
        if not torch.allclose(model.get_parameter(name).grad, reference_grads[name], rtol=1e-5, atol=1e-7)
    ]
    assert not mismatched, f"rank {rank}: accumulated gradients differ from a single process in {mismatched}"
    dist.destroy_process_group()
'''

TEST_FILE = NewFile("tests/tensor_parallel/test_replicated_with_grad_allreduce.py", TEST)

# 5.15 .. 5.21: a module full backward hook all-reduces the accumulated `.grad` after every backward
HOOK_FIRST_FORWARD = '''\
        # Params are replaced during weight loading, which happens after TP is applied and would drop a
        # param-level hook, so the hooks go on the params seen by the first forward that records autograd.
        is_already_hooked: dict[str, torch.nn.Parameter] = {}

        def _all_reduce_grad(grad):
            # Reduce this backward's gradient before it is accumulated into `param.grad`: reducing `param.grad`
            # itself would sum the gradients accumulated from earlier micro-batches over the mesh again.
            grad = grad.clone(memory_format=torch.contiguous_format)
            dist.all_reduce(grad, group={mesh}.get_group())
            return grad

        def _hook_params(mod, args):
            if torch.is_grad_enabled():
                for name, param in mod.named_parameters({recurse}):
                    if param.requires_grad and is_already_hooked.get(name) is not param:
                        param.register_hook(_all_reduce_grad)
                        is_already_hooked[name] = param

        module.register_forward_pre_hook(_hook_params)
'''

V515 = Edit(
    "src/transformers/integrations/tensor_parallel.py",
    "    def prepare_module_tp(self, module, device_mesh, **kwargs):\n"
    "        # Use a module-level backward hook (not param.register_hook) because parameters are replaced during"
    " weight loading after this method runs.\n"
    "        # Module hooks survive parameter replacement.\n"
    "        def _backward_hook(mod, grad_input, grad_output, mesh=device_mesh):\n"
    "            for param in mod.parameters():\n"
    "                if param.grad is not None:\n"
    "                    all_reduce_forward(param.grad, mesh)\n"
    "\n"
    "        module.register_full_backward_hook(_backward_hook)\n",
    "    def prepare_module_tp(self, module, device_mesh, **kwargs):\n"
    + HOOK_FIRST_FORWARD.replace("{mesh}", "device_mesh").replace("{recurse}", ""),
)

V516 = Edit(
    "src/transformers/distributed/tensor_parallel.py",
    "    def install_forward(self, module, mesh):\n"
    "        # A module hook rather than `param.register_hook`: params are replaced during weight\n"
    "        # loading, which happens after TP is applied, and would drop a param-level hook.\n"
    "        def _all_reduce_grads(mod, grad_input, grad_output):\n"
    "            for param in mod.parameters(recurse=False):\n"
    "                if param.grad is not None:\n"
    "                    dist.all_reduce(param.grad, group=mesh.get_group())\n"
    "\n"
    "        module.register_full_backward_hook(_all_reduce_grads)\n"
    "        return module\n",
    "    def install_forward(self, module, mesh):\n"
    + HOOK_FIRST_FORWARD.replace("{mesh}", "mesh").replace("{recurse}", "recurse=False")
    + "        return module\n",
)

# 5.22 (and main): a post-accumulate-grad hook all-reduces the accumulated `.grad` after every backward
V522 = (
    Edit(
        "src/transformers/distributed/tensor_parallel.py",
        "        def _all_reduce_grad(param):\n"
        "            dist.all_reduce(param.grad, group=mesh.get_group())\n",
        "        def _all_reduce_grad(grad):\n"
        "            # Reduce this backward's gradient before it is accumulated into `param.grad`: reducing"
        " `param.grad`\n"
        "            # itself would sum the gradients accumulated from earlier micro-batches over the mesh again.\n"
        "            grad = grad.clone(memory_format=torch.contiguous_format)\n"
        "            dist.all_reduce(grad, group=mesh.get_group())\n"
        "            return grad\n",
    ),
    Edit(
        "src/transformers/distributed/tensor_parallel.py",
        "                        param.register_post_accumulate_grad_hook(_all_reduce_grad)\n",
        "                        param.register_hook(_all_reduce_grad)\n",
    ),
)

FIX = Fix(
    id="transformers-tp-replicated-grad-accumulation",
    distribution="transformers",
    kind="proposal",
    upstream="huggingface/transformers main (not reported upstream yet; still present in 5.25.0)",
    summary="""
        The TP style replicated_with_grad_allreduce (Qwen3, Qwen3-MoE, Gemma3, ... q_norm/k_norm) keeps a parameter
        whole on every rank while each rank's gradient covers only its own heads, and sums the gradients over the
        TP mesh. It sums the accumulated param.grad after every backward (a post-accumulate-grad hook; a module full
        backward hook before 5.22). Without gradient accumulation that is right; with it, each backward sums the
        gradient of the earlier micro-batches, already summed, over the mesh again: with 2 micro-batches on 2 ranks
        the first one counts twice (tiny Qwen3: q_norm/k_norm gradients 58-110 % off, and Trainer's grad_norm with
        them).

        Sum the gradient of each backward before it is accumulated: a tensor hook on the parameter, registered on
        the first forward that records autograd (as 5.22 already does for its hook, since loading replaces the
        parameters). The 5.15 .. 5.21 variants move from the module backward hook to the same hook. The test
        accumulates 2 micro-batches on a two-layer Qwen3 with tp_size=2 (gloo, CPU) and compares the q_norm/k_norm
        gradients with one process doing the same.
    """,
    variants=(
        Variant("5.15", edits=(V515,), new_files=(TEST_FILE,)),
        Variant("5.16", edits=(V516,), new_files=(TEST_FILE,)),
        Variant("5.22", edits=V522, new_files=(TEST_FILE,)),
        # 5.25 installs the TP style through a forward pre-hook: the same gradient hook, other context
        Variant("5.25", edits=V522, new_files=(TEST_FILE,)),
    ),
)
