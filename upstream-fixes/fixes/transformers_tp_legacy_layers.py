"""transformers-tp-legacy-layers: 5.15's vocab-parallel embedding makes padding_idx local to its shard, and its
rowwise layer keeps the bias registered as ``bias``."""

from upstream_diffs import LICENSE_HEADER, Edit, Fix, NewFile

TEST = LICENSE_HEADER + '''\
import sys

from transformers.testing_utils import (
    TestCasePlus,
    execute_subprocess_async,
    get_torch_dist_unique_port,
    require_torch,
)


class TestTensorParallelEmbeddingPaddingAndRowwiseBias(TestCasePlus):
    @require_torch
    def test_gradients_and_names_match_single_process(self):
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
    # Runs on each of 2 ranks (gloo, CPU), tp_size=2. The tied embedding is vocab-parallel: rank 1 holds tokens
    # 32..63 at local rows 0..31, so a global padding_idx of 0 would zero the gradient of token 32. The rowwise
    # o_proj/down_proj biases must keep their names after a forward.
    import torch
    import torch.distributed as dist

    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    checkpoint = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, pad_token_id=0, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
        )
        LlamaForCausalLM(config).save_pretrained(checkpoint)
    dist.barrier()
    input_ids = torch.tensor([[1, 32, 5, 40, 32, 9, 33, 2]])

    model = AutoModelForCausalLM.from_pretrained(checkpoint, distributed_config=DistributedConfig(tp_size=2))
    reference = AutoModelForCausalLM.from_pretrained(checkpoint)
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    reference(input_ids=input_ids, labels=input_ids).loss.backward()

    names = {name for name, _ in model.named_parameters()}
    assert names == {name for name, _ in reference.named_parameters()}, sorted(names ^ set(reference.state_dict()))
    embedding = model.get_input_embeddings().weight.grad
    shards = [torch.empty_like(embedding) for _ in range(2)]
    dist.all_gather(shards, embedding.contiguous())
    expected = reference.get_input_embeddings().weight.grad
    assert torch.allclose(torch.cat(shards), expected, rtol=1e-5, atol=1e-6), f"rank {rank}: embedding gradient"
    for name, param in model.named_parameters():
        if name.endswith(("o_proj.bias", "down_proj.bias")):
            want = reference.get_parameter(name).grad
            assert torch.allclose(param.grad, want, rtol=1e-5, atol=1e-7), f"rank {rank}: {name}"
    dist.destroy_process_group()
'''

EMBEDDING_OLD = """            vocab_end_index = vocab_start_index + per_partition_size

"""
EMBEDDING_NEW = """            vocab_end_index = vocab_start_index + per_partition_size

            # `padding_idx` indexes the full table: nn.Embedding would zero the gradient of this shard's row with
            # that local index (a real token on every rank but the first) or reject an index past the shard
            if not hasattr(mod, "_tp_global_padding_idx"):
                mod._tp_global_padding_idx = mod.padding_idx
            padding_idx = mod._tp_global_padding_idx
            if padding_idx is not None and vocab_start_index <= padding_idx < vocab_end_index:
                mod.padding_idx = padding_idx - vocab_start_index
            else:
                mod.padding_idx = None

"""
ROWWISE_IN_OLD = """    def _prepare_input_fn(self, mod, inputs, device_mesh):
        if hasattr(mod, "bias") and mod.bias is not None:
            mod._bias = mod.bias
            mod.bias = None
"""
ROWWISE_IN_NEW = """    def _prepare_input_fn(self, mod, inputs, device_mesh):
        # The bias is added once, after the all-reduce. Hide it from the matmul for this forward only: it stays
        # registered as `bias`, so parameter names, state dicts and checkpoints keep it.
        if isinstance(mod._parameters.get("bias"), nn.Parameter):
            mod.__dict__["_tp_bias"] = mod._parameters["bias"]
            mod._parameters["bias"] = None
"""
ROWWISE_OUT_OLD = """        outputs = all_reduce_forward(outputs, device_mesh)
        if hasattr(mod, "_bias") and mod._bias is not None:
            outputs = outputs + mod._bias
        return outputs
"""
ROWWISE_OUT_NEW = """        outputs = all_reduce_forward(outputs, device_mesh)
        bias = mod.__dict__.pop("_tp_bias", None)
        if bias is not None:
            mod._parameters["bias"] = bias
            outputs = outputs + bias
        return outputs
"""
PATH = "src/transformers/integrations/tensor_parallel.py"

FIX = Fix(
    id="transformers-tp-legacy-layers",
    distribution="transformers",
    kind="backport",
    upstream="the DTensor tensor-parallel layers (distributed/tensor_parallel.py; PR not identified), released in 5.16",
    summary="""
        Two problems of the local-tensor TP layers. EmbeddingParallel (vocab-parallel, which every tied-embedding
        model gets) shifts token ids into the rank's shard but leaves padding_idx global: with pad_token_id=0 rank
        1's local row 0, a real token, never gets an embedding gradient (silently wrong training), and a padding id
        past the shard makes the lookup raise "Padding_idx must be within num_embeddings". RowwiseParallel moves the
        bias to a new parameter `_bias` at the first forward, so from then on the model's parameters and state dict
        name every rowwise bias `..._bias` and checkpoints written after training lack them.

        Make padding_idx local to the shard (None where the shard does not hold it), and keep the bias registered
        under its name, out of the matmul for the forward only. The test compares a tied, biased two-layer Llama
        with tp_size=2 (gloo, CPU) with one process: the embedding and bias gradients and the parameter names.
    """,
    edits=(
        Edit(PATH, EMBEDDING_OLD, EMBEDDING_NEW),
        Edit(PATH, ROWWISE_IN_OLD, ROWWISE_IN_NEW),
        Edit(PATH, ROWWISE_OUT_OLD, ROWWISE_OUT_NEW),
    ),
    new_files=(NewFile("tests/tensor_parallel/test_tensor_parallel_embedding_padding.py", TEST),),
)
