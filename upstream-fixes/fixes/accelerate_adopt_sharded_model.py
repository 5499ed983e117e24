"""accelerate-adopt-sharded-model: Accelerator.prepare trains a model that arrives already sharded as it is."""

from upstream_diffs import LICENSE_HEADER, Edit, Fix, NewFile, Variant

TEST = LICENSE_HEADER + '''\
import sys
import tempfile
import unittest

from accelerate.test_utils import execute_subprocess_async, get_torch_dist_unique_port, require_torch_min_version
from accelerate.test_utils.testing import require_transformers
from accelerate.utils import patch_environment


@require_torch_min_version(version="2.6.0")
class ShardedModelTester(unittest.TestCase):
    """A model sharded before `prepare` (FSDP2 or tensor parallel, no plugin) trains like one process on the global
    batch: each case runs on 2 CPU processes (gloo) and compares with that reference computed in the same script."""

    def run_case(self, *args):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            f"--master_port={get_torch_dist_unique_port()}",
            __file__,
            *args,
        ]
        with patch_environment(omp_num_threads=1):
            execute_subprocess_async(cmd)

    def test_fully_sharded_model(self):
        self.run_case("fsdp")

    def test_tensor_parallel_model(self):
        self.run_case("tp")

    @require_transformers
    def test_model_sharded_by_transformers(self):
        with tempfile.TemporaryDirectory() as checkpoint:
            self.run_case("transformers", checkpoint)


DATASET_SIZE, BATCH_SIZE, ACCUMULATION_STEPS, MAX_NORM, LR = 32, 4, 2, 0.05, 0.5


def make_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3), torch.nn.LayerNorm(3)
    )


def make_dataset():
    import torch
    from torch.utils.data import TensorDataset

    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(DATASET_SIZE, 4, generator=generator)
    return TensorDataset(inputs, torch.randn(DATASET_SIZE, 3, generator=generator))


def reference_step(model, optimizer, inputs, targets):
    import torch

    loss = torch.nn.functional.mse_loss(model(inputs), targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    optimizer.step()
    optimizer.zero_grad()


def full(tensor):
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def train_transformers_model(checkpoint):
    """A model that `transformers` shards while loading (tensor parallel over both processes) trains like one process
    on the same batches: the same losses, step by step."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.distributed import DistributedConfig

    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    if accelerator.is_main_process:
        config = LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2,
        )
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(checkpoint)
    accelerator.wait_for_everyone()
    sequences = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(1))

    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, distributed_config=DistributedConfig(tp_size=2), dtype=torch.float32
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(sequences, batch_size=BATCH_SIZE))
    losses, seen = [], []
    for batch in loader:
        seen.append(batch.tolist())
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    everyone = [None] * accelerator.num_processes
    dist.all_gather_object(everyone, seen)
    assert everyone[0] == everyone[1], "the ranks of a tensor parallel group got different batches"

    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    expected = []
    for batch in DataLoader(sequences, batch_size=BATCH_SIZE):
        loss = reference(input_ids=batch, labels=batch).loss
        loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        expected.append(loss.detach())
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected))
    accelerator.end_training()  # destroys the process group


def main(case):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils.data import DataLoader

    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION_STEPS)
    model = make_model()
    if case == "fsdp":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        data_parallel_size = 2
    else:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        # The LayerNorm stays a plain (replicated) module: gradients on a mesh and plain ones are clipped together.
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        data_parallel_size = 1
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    train_loader = DataLoader(make_dataset(), batch_size=BATCH_SIZE)
    eval_loader = DataLoader(make_dataset(), batch_size=BATCH_SIZE)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)

    seen = []
    for inputs, targets in train_loader:
        seen.append(inputs)
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
            optimizer.step()
            optimizer.zero_grad()

    model.eval()
    predictions = []
    with torch.no_grad():
        for inputs, _ in eval_loader:
            predictions.append(accelerator.gather_for_metrics(model(inputs)))
    predictions = torch.cat(predictions)

    # The batches: each data-parallel rank its own, the ranks of a tensor parallel group the same ones.
    everyone = [None] * accelerator.num_processes
    dist.all_gather_object(everyone, torch.cat(seen).tolist())
    if data_parallel_size == 1:
        assert everyone[0] == everyone[1], "the ranks of a tensor parallel group got different batches"
    else:
        assert not set(map(tuple, everyone[0])) & set(map(tuple, everyone[1])), "data-parallel ranks shared samples"

    # Reference: one process, the same model and data; each step sees the global batch (every data-parallel rank's
    # batches of all accumulation steps).
    reference = make_model()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    inputs, targets = make_dataset().tensors
    global_batch = BATCH_SIZE * data_parallel_size * ACCUMULATION_STEPS
    for start in range(0, DATASET_SIZE, global_batch):
        batch = slice(start, start + global_batch)
        reference_step(reference, reference_optimizer, inputs[batch], targets[batch])
    for (name, expected), param in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(full(param.detach()), expected.detach(), msg=lambda msg: f"{name}: {msg}")
    with torch.no_grad():
        torch.testing.assert_close(full(predictions), reference(inputs), msg=lambda msg: f"gather_for_metrics: {msg}")
    accelerator.end_training()  # destroys the process group


if __name__ == "__main__":
    if sys.argv[1] == "transformers":
        train_transformers_model(sys.argv[2])
    else:
        main(sys.argv[1])
'''

ACCELERATOR = "src/accelerate/accelerator.py"

STATE = Edit(
    ACCELERATOR,
    "        self._models = []\n        self._schedulers = []\n        self._dataloaders = []\n",
    "        self._models = []\n        self._schedulers = []\n        self._dataloaders = []\n"
    "        # Tensor parallel degree of the already-sharded model(s) prepared, see `_adopt_sharded_model`\n"
    "        self._sharded_model_tp_size = None\n",
)
FREE_STATE = Edit(
    ACCELERATOR,
    "        self._models = []\n        self._dataloaders = []\n        self.step = 0\n",
    "        self._models = []\n        self._dataloaders = []\n        self._sharded_model_tp_size = None\n"
    "        self.step = 0\n",
)
NO_SYNC = Edit(
    ACCELERATOR,
    "        if self.is_fsdp2:\n"
    "            model.set_requires_gradient_sync(False)\n"
    "            try:\n"
    "                yield\n"
    "            finally:\n"
    "                model.set_requires_gradient_sync(True)\n",
    "        if self.is_fsdp2:\n"
    "            model.set_requires_gradient_sync(False)\n"
    "            try:\n"
    "                yield\n"
    "            finally:\n"
    "                model.set_requires_gradient_sync(True)\n"
    "        elif self._sharded_model_tp_size is not None and model_has_dtensor(model):\n"
    "            # An already-sharded model's own FSDP2 modules (no FSDP plugin) reduce their gradients in backward\n"
    "            from torch.distributed.fsdp import FSDPModule\n"
    "\n"
    "            fsdp_modules = [module for module in model.modules() if isinstance(module, FSDPModule)]\n"
    "            for module in fsdp_modules:\n"
    "                module.set_requires_gradient_sync(False, recurse=False)\n"
    "            try:\n"
    "                yield\n"
    "            finally:\n"
    "                for module in fsdp_modules:\n"
    "                    module.set_requires_gradient_sync(True, recurse=False)\n",
)
MODELS_FIRST = Edit(
    ACCELERATOR,
    "                args, device_placement = self._prepare_msamp(*args, device_placement=device_placement)\n"
    "            result = tuple(\n",
    "                args, device_placement = self._prepare_msamp(*args, device_placement=device_placement)\n"
    "            # An already-sharded model decides how the dataloaders split the data, whatever the order of `args`\n"
    "            for obj in args:\n"
    "                if isinstance(obj, torch.nn.Module):\n"
    "                    self._adopt_sharded_model(obj)\n"
    "            result = tuple(\n",
)
ADOPT = Edit(
    ACCELERATOR,
    "        if not evaluation_mode:\n"
    "            if self.multi_device and not (self.parallelism_config and self.parallelism_config.tp_enabled):\n",
    "        # A model that arrives already sharded is trained as it is, see `_adopt_sharded_model`\n"
    "        if not evaluation_mode and not self._adopt_sharded_model(model):\n"
    "            if self.multi_device and not (self.parallelism_config and self.parallelism_config.tp_enabled):\n",
)
METHODS = Edit(
    ACCELERATOR,
    "    def prepare_data_loader(\n"
    "        self, data_loader: torch.utils.data.DataLoader, device_placement=None, slice_fn_for_dispatch=None\n"
    "    ):\n",
    '''\
    def _get_sharded_model_tp_size(self, model: torch.nn.Module) -> int | None:
        """
        Returns the tensor parallel degree of `model` if it arrives already sharded while no plugin or
        `ParallelismConfig` of this `Accelerator` shards models: sharded while loading by `transformers`
        (`from_pretrained(..., distributed_config=...)`) or by hand (`fully_shard`, `parallelize_module`). Returns
        `None` for a model that Accelerate distributes itself.

        In a model sharded by hand, tensor parallel mesh dimensions are the ones named "tp", as in a
        `ParallelismConfig` mesh; DTensor parameters outside FSDP2 modules must have one (their mesh could as well be
        a data-parallel one).
        """
        if self.parallelism_config or not (self.multi_device or self.distributed_type == DistributedType.MULTI_CPU):
            return None
        # `transformers` records the degree of a model it sharded while loading (its meshes have `tp` last)
        tp_size = get_model_tp_size(model)
        if (tp_size or 1) == 1 and not model_has_dtensor(model):
            return None
        if tp_size is None:
            tp_size = self._get_hand_sharded_tp_size(model)
        if self.num_processes % tp_size:
            raise ValueError(
                f"The model's tensor parallel degree {tp_size} does not divide the {self.num_processes} processes."
            )
        return tp_size

    def _get_hand_sharded_tp_size(self, model: torch.nn.Module) -> int:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        tp_size = 1
        fsdp_params = {
            id(param) for module in model.modules() if isinstance(module, FSDPModule) for param in module.parameters()
        }
        for name, param in model.named_parameters():
            if not isinstance(param, DTensor):
                continue
            mesh = param.device_mesh
            if "tp" in (mesh.mesh_dim_names or ()):
                tp_size = mesh["tp"].size()
                # Data is split as for a `ParallelismConfig` mesh: a tensor parallel group is consecutive processes
                if mesh["tp"].get_local_rank() != self.process_index % tp_size:
                    raise ValueError(
                        f"The tensor parallel groups of the model ({name} is sharded over a `tp` mesh dimension of "
                        f"size {tp_size}) must be consecutive processes, with `tp` as the last mesh dimension."
                    )
            elif id(param) not in fsdp_params:
                raise ValueError(
                    f"The parameter {name} is a DTensor outside any FSDP2 module on a mesh without a `tp` dimension "
                    f"(dimensions: {mesh.mesh_dim_names}): name the tensor parallel mesh dimension `tp`."
                )
        return tp_size

    def _adopt_sharded_model(self, model: torch.nn.Module) -> bool:
        """
        Returns whether `model` arrives already sharded (see `_get_sharded_model_tp_size`). Such a model is trained as
        it is: it is not wrapped in DDP, its FSDP2 modules reduce their own gradients, and the dataloaders prepared by
        this `Accelerator` give the processes of each tensor parallel group the same batches.
        """
        tp_size = self._get_sharded_model_tp_size(model)
        if tp_size is None:
            return False
        if self._sharded_model_tp_size not in (None, tp_size):
            raise ValueError(
                f"This `Accelerator` prepared a model of tensor parallel degree {self._sharded_model_tp_size}, this "
                f"one has {tp_size}: its dataloaders split the data one way. Use one `Accelerator` per layout."
            )
        if self._sharded_model_tp_size is None and tp_size > 1 and self._dataloaders:
            raise ValueError(
                "Dataloaders prepared before a tensor parallel model give each of its processes different batches: "
                "prepare them with the model (`accelerator.prepare(model, optimizer, dataloader)`) or after it."
            )
        self._sharded_model_tp_size = tp_size
        return True

    def prepare_data_loader(
        self, data_loader: torch.utils.data.DataLoader, device_placement=None, slice_fn_for_dispatch=None
    ):
''',
)
SPLIT = Edit(
    ACCELERATOR,
    "        device_mesh = self._prepare_device_mesh()\n"
    "\n"
    "        prepared_data_loader = prepare_data_loader(\n"
    "            data_loader,\n"
    "            self.device,\n"
    "            num_processes=self.num_processes,\n"
    "            process_index=self.process_index,\n",
    "        device_mesh = self._prepare_device_mesh()\n"
    "        num_processes, process_index = self.num_processes, self.process_index\n"
    "        if self._sharded_model_tp_size is not None:\n"
    "            # The processes of a tensor parallel group of an already-sharded model share each batch\n"
    "            num_processes //= self._sharded_model_tp_size\n"
    "            process_index //= self._sharded_model_tp_size\n"
    "            dispatches = self.dispatch_batches or (\n"
    "                self.dispatch_batches is None\n"
    "                and device_placement\n"
    "                and isinstance(data_loader.dataset, torch.utils.data.IterableDataset)\n"
    "            )\n"
    "            if self._sharded_model_tp_size > 1 and dispatches:\n"
    "                raise ValueError(\n"
    "                    \"`dispatch_batches` slices each batch over all processes, which gives the processes of a tensor \"\n"
    "                    \"parallel group different data: pass `DataLoaderConfiguration(dispatch_batches=False)`.\"\n"
    "                )\n"
    "\n"
    "        prepared_data_loader = prepare_data_loader(\n"
    "            data_loader,\n"
    "            self.device,\n"
    "            num_processes=num_processes,\n"
    "            process_index=process_index,\n",
)
GATHER_FOR_METRICS = Edit(
    ACCELERATOR,
    "        if use_gather_object:\n"
    "            data = gather_object(input_data)\n"
    "        else:\n"
    "            data = self.gather(input_data)\n",
    "        tp_size = self._sharded_model_tp_size or 1\n"
    "        if use_gather_object and tp_size > 1:\n"
    "            # The processes of a tensor parallel group hold the same samples: keep the first one's\n"
    "            data = [obj for objs in gather_object([input_data])[::tp_size] for obj in objs]\n"
    "        elif use_gather_object:\n"
    "            data = gather_object(input_data)\n"
    "        else:\n"
    "            data = self.gather(input_data)\n"
    "            if tp_size > 1:\n"
    "                data = recursively_apply(lambda t: torch.cat(t.chunk(self.num_processes)[::tp_size]), data)\n",
)
COMMON = (STATE, FREE_STATE, NO_SYNC, MODELS_FIRST, ADOPT, METHODS, SPLIT, GATHER_FOR_METRICS)

# accelerate 1.16 removed MS-AMP: the models are adopted right before the two-pass `_prepare_one`, as above.
MODELS_FIRST_116 = Edit(
    ACCELERATOR,
    "            old_named_params = self._get_parameters_to_remap(*args)\n"
    "            result = tuple(\n",
    "            old_named_params = self._get_parameters_to_remap(*args)\n"
    "            # An already-sharded model decides how the dataloaders split the data, whatever the order of `args`\n"
    "            for obj in args:\n"
    "                if isinstance(obj, torch.nn.Module):\n"
    "                    self._adopt_sharded_model(obj)\n"
    "            result = tuple(\n",
)
COMMON_116 = tuple(MODELS_FIRST_116 if edit is MODELS_FIRST else edit for edit in COMMON)

# accelerate 1.13 / 1.14: backport what 1.15 already has and the adoption relies on.
GET_MODEL_TP_SIZE = Edit(
    "src/accelerate/utils/other.py",
    "    return any(isinstance(p, DTensor) for p in model.parameters())\n\n\n",
    '''\
    return any(isinstance(p, DTensor) for p in model.parameters())


def get_model_tp_size(model: torch.nn.Module) -> Optional[int]:
    """
    Get the tensor parallel degree a `transformers` model was sharded with, or `None` if it was not sharded.

    Args:
        model (`torch.nn.Module`):
            The model to inspect.

    Returns:
        `Optional[int]`: The model's tensor parallel size.
    """
    # `transformers<5` records it on the model itself, while `transformers>=5` moved it to the
    # `DistributedConfig` held by the model config and left `model.tp_size` behind as a `None` stub.
    tp_size = getattr(model, "tp_size", None)
    if tp_size is not None:
        return tp_size

    distributed_config = getattr(getattr(model, "config", None), "distributed_config", None)
    if isinstance(distributed_config, dict):
        return distributed_config.get("tp_size")
    return getattr(distributed_config, "tp_size", None)


''',
)
EXPORT_TP_SIZE = Edit("src/accelerate/utils/__init__.py", "    extract_model_from_parallel,\n    get_module_children_bottom_up,\n",
                      "    extract_model_from_parallel,\n    get_model_tp_size,\n    get_module_children_bottom_up,\n")
IMPORT_TP_SIZE = Edit(ACCELERATOR, "    get_mixed_precision_context_manager,\n    get_pretty_name,\n",
                      "    get_mixed_precision_context_manager,\n    get_model_tp_size,\n    get_pretty_name,\n")
NO_DTENSOR_PLACEMENT = Edit(
    ACCELERATOR,
    "            device_placement = self.device_placement and self.distributed_type != DistributedType.FSDP\n",
    "            # DTensor-sharded models manage their own placement; `.to()` on FSDP2-managed or CPU-offloaded params raises `_apply(): Couldn't swap ...`\n"
    "            device_placement = (\n"
    "                self.device_placement\n"
    "                and self.distributed_type != DistributedType.FSDP\n"
    "                and not model_has_dtensor(model)\n"
    "            )\n",
)
CLIP_OVER_MESHES = Edit(
    ACCELERATOR,
    "        self.unscale_gradients()\n"
    "        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)\n"
    "\n",
    '''\
        self.unscale_gradients()
        return self._clip_grad_norm_dtensor_aware(list(parameters), max_norm, norm_type=norm_type)

    def _clip_grad_norm_dtensor_aware(self, parameters, max_norm, norm_type=2):
        is_dtensor_available = torch.distributed.is_available() and is_torch_version(">=", DTENSOR_PYTORCH_VERSION)
        if not is_dtensor_available:
            return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

        from torch.distributed.tensor import DTensor

        # `DTensor` is a subclass of `torch.Tensor`, so a plain gradient is anything that is not a `DTensor`.
        mesh_groups = {}
        plain_params = []
        for p in parameters:
            if p.grad is None:
                continue
            if isinstance(p.grad, DTensor):
                mesh_groups.setdefault(p.grad.device_mesh, []).append(p)
            else:
                plain_params.append(p)

        if len(mesh_groups) + bool(plain_params) <= 1:
            return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

        norm_groups = list(mesh_groups.values()) + ([plain_params] if plain_params else [])
        group_norms = [torch.nn.utils.get_total_norm([p.grad for p in group], norm_type) for group in norm_groups]
        # `full_tensor()` gathers each group norm on its own mesh, so the group norms can be combined as plain tensors.
        group_norms = [norm.full_tensor() if isinstance(norm, DTensor) else norm for norm in group_norms]
        total_norm = torch.linalg.vector_norm(torch.stack(group_norms), norm_type)
        for mesh, group in mesh_groups.items():
            d_total_norm = DTensor.from_local(total_norm, mesh)
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, d_total_norm)
        torch.nn.utils.clip_grads_with_norm_(plain_params, max_norm, total_norm)
        return total_norm

''',
)
BACKPORTS = (GET_MODEL_TP_SIZE, EXPORT_TP_SIZE, IMPORT_TP_SIZE, NO_DTENSOR_PLACEMENT, CLIP_OVER_MESHES)
TEST_FILE = NewFile("tests/test_sharded_model.py", TEST)

FIX = Fix(
    id="accelerate-adopt-sharded-model",
    distribution="accelerate",
    kind="proposal",
    upstream="huggingface/accelerate main (no upstream issue yet; context: huggingface/transformers#45662)",
    summary="""
        Accelerator.prepare has no path for a model that arrives already sharded, by transformers
        (from_pretrained(..., distributed_config=DistributedConfig(...))) or by hand (fully_shard,
        parallelize_module), when no FSDP / DeepSpeed / Megatron-LM plugin and no ParallelismConfig is in charge:
        prepare_model wraps it in DDP (CPU: "aten.cat.default got mixed torch.Tensor and DTensor"; GPU: "Your model
        contains DTensor parameters, which is incompatible with DDP"), and everything around the model assumes one
        batch per process.

        This change adopts such a model (_adopt_sharded_model): no DDP wrap (and no .to() of DTensor parameters),
        and its tensor parallel degree (transformers' DistributedConfig via get_model_tp_size, else the mesh dimension
        named "tp", as in a ParallelismConfig mesh; tensor parallel groups must be consecutive processes, which is
        checked) drives the rest: prepare_data_loader splits by data-parallel rank (process_index // tp_size), so the
        ranks of a tensor parallel group get identical batches, and refuses dispatch_batches for tp_size > 1; prepare
        adopts models before it prepares the dataloaders of the same call (dataloaders prepared in an earlier call
        are refused with a message); no_sync calls set_requires_gradient_sync on the model's FSDP2 modules;
        gather_for_metrics keeps one copy of each sample (the first rank of each tensor parallel group). On
        accelerate 1.13 and 1.14 the diff also backports from 1.15 get_model_tp_size, the DTensor device placement
        guard and _clip_grad_norm_dtensor_aware (clip_grad_norm_ over several meshes and plain tensors at once); 1.15
        has them. The test trains an FSDP2 model and a tensor parallel model (with a plain LayerNorm) on two CPU
        processes with gradient accumulation and clipping, and compares parameters and gathered predictions with one
        process training on the global batch, and a Llama model that transformers shards while loading
        (DistributedConfig(tp_size=2)) against the same model trained in one process, loss by loss; it checks that
        the ranks of each tensor parallel group get identical batches.

        Left out (the shardadopt runtime patch does these): an explicit layout for meshes this cannot read
        (AdoptionKwargs(topology=...)), e.g. an unnamed tensor parallel mesh or one whose tp dimension is not last;
        re-splitting dataloaders prepared before the model; one Accelerator adopting models of different layouts;
        refusing a model sharded over more processes than the Accelerator runs (on a machine without GPUs, torchrun
        processes without Accelerator(cpu=True) each run as a job of their own);
        splitting optimizer param groups by mesh so foreach/fused optimizers can step mixed DTensor/plain groups (the
        test uses SGD, which on CPU steps per tensor); counting the plain tensor-parallel shards of transformers
        5.15/5.16 by the ranks that hold them when clipping, and giving them contiguous storage for fused AdamW (both
        transformers-side issues of those releases); checkpointing (accelerate-sharded-checkpoint).
    """,
    variants=(
        Variant("1.13", edits=COMMON + BACKPORTS, new_files=(TEST_FILE,)),
        # 1.14 added compile_regions_fsdp2 next to the backported import (other context, same change)
        Variant("1.14", edits=COMMON + BACKPORTS, new_files=(TEST_FILE,)),
        # 1.15 has get_model_tp_size, the DTensor placement guard and _clip_grad_norm_dtensor_aware
        Variant("1.15", edits=COMMON, new_files=(TEST_FILE,)),
        # 1.16 removed MS-AMP (`_prepare_msamp`) next to where the models are adopted first
        Variant("1.16", edits=COMMON_116, new_files=(TEST_FILE,)),
    ),
)
