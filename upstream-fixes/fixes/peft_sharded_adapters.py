"""peft-sharded-adapters: LoRA on models transformers shards while loading trains like one process."""

from upstream_diffs import Edit, Fix, NewFile, Variant

TEST = '''\
# Copyright 2026-present the HuggingFace Inc. team.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
import os
import subprocess
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def test_lora_on_fsdp_load_trains_like_one_process(tmp_path):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "base")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", __file__, str(tmp_path)]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _train(path, distributed, use_dora):
    from transformers import AutoModelForCausalLM

    from peft import LoraConfig, get_peft_model

    kwargs = {}
    if distributed:
        from transformers.distributed import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(fsdp_size=2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    torch.manual_seed(1234 + (torch.distributed.get_rank() if distributed else 0))  # ranks seeded differently
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "o_proj"], use_dora=use_dora)
    model = get_peft_model(model, config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    batch = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    if distributed:  # each rank its half of the global batch
        rank = torch.distributed.get_rank()
        batch = batch[2 * rank:2 * rank + 2]
    for _ in range(3):
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


if __name__ == "__main__":
    import torch.distributed as dist

    dist.init_process_group("gloo")
    path = os.path.join(sys.argv[1], "base")
    for use_dora in (False, True):  # DoRA: its magnitude vector too
        sharded = _train(path, distributed=True, use_dora=use_dora)
        assert any("lora_magnitude_vector" in name for name in sharded) == use_dora
        everyone = [None, None]
        dist.all_gather_object(everyone, sharded)
        for name, value in sharded.items():
            assert torch.equal(value, everyone[0][name]), f"{name} differs between the ranks"
        if dist.get_rank() == 0:
            for name, value in _train(path, distributed=False, use_dora=use_dora).items():
                torch.testing.assert_close(sharded[name], value, rtol=1e-4, atol=1e-6, msg=name)
    dist.destroy_process_group()
'''

TUNERS = "src/peft/tuners/tuners_utils.py"
LORA_MODEL = "src/peft/tuners/lora/model.py"
DORA = "src/peft/tuners/lora/dora.py"

GLOBAL_SHAPE = Edit(
    TUNERS,
    "            # Sharded weight. Under Tensor Parallel the module computes on its local shard, so the LoRA\n"
    "            # layers must match the local shape. Under FSDP2 (a mesh dimension named \"fsdp\") the storage is\n"
    "            # sharded but the module still computes the full projection, so the full shape is the right one.\n"
    "            # A mesh with no dimension names comes from plain `fully_shard(model)`, which builds its default\n"
    "            # mesh unnamed, so it is FSDP-sharded as well.\n"
    "            mesh_dim_names = module.weight.device_mesh.mesh_dim_names or ()\n"
    "            if set(mesh_dim_names) <= {\"fsdp\"}:\n"
    "                in_features, out_features = module.in_features, module.out_features\n"
    "            else:\n"
    "                out_features, in_features = module.weight.to_local().shape\n",
    "            # Sharded weight (FSDP2, Tensor Parallel or both): size the LoRA layers by the global shape. The TP\n"
    "            # styles then shard them like the base layer (`add_lora_tp_hooks_dtensor`), so the initialisation\n"
    "            # (its fan) and the declared in/out features do not depend on the TP size.\n"
    "            out_features, in_features = module.weight.shape\n")

HELPER = Edit(
    TUNERS,
    "def _get_in_out_features(module: nn.Module) -> tuple[int, int] | tuple[None, None]:\n",
    "def _sync_adapter_over_data_parallel(model: nn.Module, adapter_name: str) -> None:\n"
    "    \"\"\"Adapters of a model sharded while loading (`from_pretrained(..., distributed_config=...)`) are replicated\n"
    "    over its data-parallel ranks, which FSDP2 and TP do not reduce: start them from rank 0's values and average\n"
    "    their gradients over those ranks after each backward, as DDP would.\"\"\"\n"
    "    device_mesh = getattr(model, \"_device_mesh\", None)\n"
    "    if device_mesh is None or not torch.distributed.is_initialized():\n"
    "        return\n"
    "    names = device_mesh.mesh_dim_names or ()\n"
    "    dims = [n for n in (\"dp_replicate\", \"fsdp\") if n in names and device_mesh[n].size() > 1]\n"
    "    groups = [device_mesh.get_group(n) for n in dims]\n"
    "    dp_size = 1\n"
    "    for group in groups:\n"
    "        dp_size *= torch.distributed.get_world_size(group)\n"
    "\n"
    "    def average(param):\n"
    "        grad = param.grad.to_local() if isinstance(param.grad, torch.distributed.tensor.DTensor) else param.grad\n"
    "        for group in groups:\n"
    "            torch.distributed.all_reduce(grad, group=group)\n"
    "        grad.div_(dp_size)\n"
    "\n"
    "    for name, param in model.named_parameters():\n"
    "        if f\".{adapter_name}.\" not in name:\n"
    "            continue\n"
    "        if not isinstance(param, torch.distributed.tensor.DTensor):  # sharded factors: broadcast before sharding\n"
    "            with torch.no_grad():\n"
    "                torch.distributed.broadcast(param, src=0)\n"
    "        if dp_size > 1:  # an inactive adapter too: set_adapter makes it trainable later\n"
    "            frozen = not param.requires_grad\n"
    "            param.requires_grad_(True)  # torch hooks only parameters that require grad; the hook stays\n"
    "            param.register_post_accumulate_grad_hook(average)\n"
    "            param.requires_grad_(not frozen)\n"
    "\n"
    "\n"
    "def _get_in_out_features(module: nn.Module) -> tuple[int, int] | tuple[None, None]:\n")

CALL = Edit(
    TUNERS,
    "        ####################\n"
    "        # CHECK FOR ERRORS #\n"
    "        ####################\n",
    "        if _torch_supports_distributed:\n"
    "            _sync_adapter_over_data_parallel(model, adapter_name)\n"
    "\n"
    "        ####################\n"
    "        # CHECK FOR ERRORS #\n"
    "        ####################\n")

BROADCAST_BEFORE_SHARDING = Edit(
    LORA_MODEL,
    "            # The adapter was initialized with global dimensions, so we can shard it directly.\n"
    "            style.shard_param(tp_module, p_name, device_mesh)\n",
    "            # The adapter was initialized with global dimensions: every rank keeps its slice of rank 0's values\n"
    "            # (the ranks' random states may differ).\n"
    "            with torch.no_grad():\n"
    "                torch.distributed.broadcast(param, src=0)\n"
    "            style.shard_param(tp_module, p_name, device_mesh)\n")

DORA_WHOLE_WEIGHT_NORM = Edit(
    DORA,
    "            weight = dequantize_module_weight(base_layer)\n"
    "            if weight.data.ndim >= 3:  # For handling LoRAs applied to Conv layers.\n",
    "            weight = dequantize_module_weight(base_layer)\n"
    "            if isinstance(weight, torch.distributed.tensor.DTensor) and set(\n"
    "                weight.device_mesh.mesh_dim_names or ()\n"
    "            ) <= {\"dp_replicate\", \"fsdp\"}:\n"
    "                # FSDP2 shards the storage only: the magnitude is the norm of the whole weight, which the forward\n"
    "                # (inside FSDP's, on the unsharded weight) divides by\n"
    "                weight = weight.full_tensor()\n"
    "            if weight.data.ndim >= 3:  # For handling LoRAs applied to Conv layers.\n")

# peft 0.22 creates the adapter modules only after its checks (just before its housekeeping): sync them there.
CALL_0_22 = Edit(
    TUNERS,
    "        ################\n"
    "        # HOUSEKEEPING #\n"
    "        ################\n",
    "        if _torch_supports_distributed:\n"
    "            _sync_adapter_over_data_parallel(model, adapter_name)\n"
    "\n"
    "        ################\n"
    "        # HOUSEKEEPING #\n"
    "        ################\n")

# peft 0.22 sizes the factors of a transformers-TP base at full size and shards them in add_lora_tp_hooks_dtensor:
# the global-shape edit is upstream already; each rank's own random init still gets sharded.
BROADCAST_BEFORE_SHARDING_0_22 = Edit(
    LORA_MODEL,
    "        style.validate_param(tp_module, p_name, device_mesh, parameter_name=f\"{module_name}.{p_name}\")\n"
    "        style.shard_param(tp_module, p_name, device_mesh)\n",
    "        style.validate_param(tp_module, p_name, device_mesh, parameter_name=f\"{module_name}.{p_name}\")\n"
    "        # Initialized with global dimensions: every rank keeps its slice of rank 0's values (the ranks' random\n"
    "        # states may differ).\n"
    "        with torch.no_grad():\n"
    "            torch.distributed.broadcast(getattr(tp_module, p_name), src=0)\n"
    "        style.shard_param(tp_module, p_name, device_mesh)\n")


FIX = Fix(
    id="peft-sharded-adapters",
    distribution="peft",
    kind="proposal",
    upstream="huggingface/peft main (LoRA on transformers' load-time sharding: FSDP adapters never reduced, "
             "huggingface/transformers#48792 / #48873; TP factors sized by the local shard since #3079)",
    summary="""
        LoRA added to a model that transformers sharded while loading does not train like one process. Under
        FSDP2 the adapters are plain tensors that nothing reduces: each data-parallel rank trains its own adapter
        and rank 0's is saved. Under tensor parallelism the factors are sized by the local shard: the init scale
        changes with the TP size and a row-parallel lora_A declares its local in_features, so the first forward
        fails ("shape '[48, 24]' is invalid for input of size 2304"); a sharded factor keeps each rank's own
        random init. DoRA on an FSDP2 load fails when it is added: its initial magnitude adds a DTensor shard of
        the base weight and the plain B @ A.

        Size LoRA layers by the global shape of a DTensor base weight, broadcast rank 0's initial values before a
        factor is sharded, and average the gradients of the replicated adapters over the model's data-parallel
        mesh dims after every backward; DoRA's initial magnitude from the whole weight on an FSDP2 load, and its
        magnitude vector averaged like the factors. (shardadopt also lays DoRA out on TP, refuses what it cannot
        lay out, writes full tensors from rank 0 in save_pretrained, and refuses merging into shards.)
    """,
    variants=(
        Variant("0.21", edits=(GLOBAL_SHAPE, HELPER, CALL, BROADCAST_BEFORE_SHARDING, DORA_WHOLE_WEIGHT_NORM),
                new_files=(NewFile("tests/test_lora_sharded_data_parallel.py", TEST),)),
        Variant("0.22", edits=(HELPER, CALL_0_22, BROADCAST_BEFORE_SHARDING_0_22, DORA_WHOLE_WEIGHT_NORM),
                new_files=(NewFile("tests/test_lora_sharded_data_parallel.py", TEST),)),
    ),
)
