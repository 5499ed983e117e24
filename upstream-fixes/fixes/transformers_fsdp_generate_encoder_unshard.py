"""transformers-fsdp-generate-encoder-unshard: generate() with images on a model sharded with FSDP2 at load gathers
the FSDP units enclosing the image encoder for the encoding it runs before the prefill, and reshards them after."""

from upstream_diffs import LICENSE_HEADER, Edit, Fix, NewFile

TEST = LICENSE_HEADER + '''\
import sys

from transformers.testing_utils import (
    TestCasePlus,
    execute_subprocess_async,
    get_torch_dist_unique_port,
    require_torch,
)


class TestFsdpGenerateWithImages(TestCasePlus):
    @require_torch
    def test_generate_with_images_matches_one_process(self):
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
    # Runs on each of 2 ranks (gloo, CPU): a tiny Qwen2.5-VL loaded with fsdp_size=2 generates from an image the
    # tokens the same checkpoint generates in one process. Before the fix, generate raised: its image encoding runs
    # before the prefill, outside any forward, so the root unit's patch embedding was still sharded.
    import torch
    import torch.distributed as dist

    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.distributed import DistributedConfig

    checkpoint = sys.argv[1]
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(
        text_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "vocab_size": 64,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
        },
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 32},
        image_token_id=60,
        video_token_id=61,
        vision_start_token_id=62,
        vision_end_token_id=63,
    )
    if dist.get_rank() == 0:
        Qwen2_5_VLForConditionalGeneration(config).save_pretrained(checkpoint)
    dist.barrier()
    # one 56x56 image: a 4x4 grid of 14-pixel patches, merged 2x2 into 4 image tokens
    inputs = {
        "input_ids": torch.tensor([[5, 62, 60, 60, 60, 60, 63, 7, 9, 11]]),
        "pixel_values": torch.randn(16, 3 * 2 * 14 * 14),
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
    }
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    expected = AutoModelForImageTextToText.from_pretrained(checkpoint).generate(
        **inputs, do_sample=False, max_new_tokens=6
    )
    model = AutoModelForImageTextToText.from_pretrained(
        checkpoint, distributed_config=DistributedConfig(fsdp_size=2)
    )
    tokens = model.generate(**inputs, do_sample=False, max_new_tokens=6)
    assert tokens.tolist() == expected.tolist(), f"{tokens.tolist()} != one process {expected.tolist()}"
    dist.destroy_process_group()
'''

HELPER_ANCHOR = "class GenerationMixin(ContinuousMixin):\n"
HELPER = '''@contextmanager
def _fsdp_units_unsharded(model: nn.Module, submodule: nn.Module):
    """
    Unshard the FSDP2 units of `model` that enclose `submodule` while a call into `submodule` that runs no forward of
    theirs (`get_image_features` before the prefill) reads their parameters, and reshard them afterwards. FSDP2
    gathers a unit's parameters in its own pre-forward hook only; units the call runs a forward of gather themselves.
    """
    from torch.distributed.fsdp import FSDPModule

    units = []
    name = next((n for n, m in model.named_modules() if m is submodule), None)
    if name is not None and is_fsdp_managed_module(model):
        parts = name.split(".") if name else []
        path = [model.get_submodule(".".join(parts[:i])) for i in range(len(parts) + 1)]
        units = [module for module in path if isinstance(module, FSDPModule)]
    if units:
        # FSDP2 picks its root at the first forward it sees: a unit inside the call must not take that role
        units[0]._get_fsdp_state()._lazy_init()
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in reversed(units):
            unit.reshard()


''' + HELPER_ANCHOR

ENCODE = '''                    encoder_kwargs["return_dict"] = True
                    model_kwargs["mm_encoder_outputs"][modality] = encoder_fn(**encoder_kwargs)
'''
ENCODE_GATHERED = '''                    encoder_kwargs["return_dict"] = True
                    # No forward of the model runs here: under FSDP2 the units holding the encoder's first layers
                    # (the root: a patch embedding, a projector) are gathered for the call only.
                    with _fsdp_units_unsharded(self, self.base_model):
                        model_kwargs["mm_encoder_outputs"][modality] = encoder_fn(**encoder_kwargs)
'''

FIX = Fix(
    id="transformers-fsdp-generate-encoder-unshard",
    distribution="transformers",
    kind="proposal",
    upstream="huggingface/transformers main (not reported upstream yet; still present in 5.25.0)",
    summary="""
        generate() encodes the images (and videos) of a vision-language model itself before the prefill:
        _prepare_multimodal_encoder_kwargs_for_generation calls self.base_model.get_image_features(...) and passes
        the result to the forward as mm_encoder_outputs. That call is no forward of the model, so on a model loaded
        with DistributedConfig(fsdp_size=N) FSDP2's root pre-forward hook never all-gathers the root unit's
        parameters (the vision patch embedding, the merger or projector): the first layer meets DTensor shards and
        generate raises "aten.convolution.default: got mixed torch.Tensor and DTensor" (Qwen2.5-VL, Gemma 3).

        The encoding now runs with the FSDP2 units that enclose base_model unsharded (FSDPModule.unshard, after
        the root's lazy initialisation, which its first forward would have done: otherwise a vision block run
        first takes the root role and the prefill raises), and resharded after. Units the encoder runs a forward
        of gather themselves as usual. The test loads a tiny Qwen2.5-VL with fsdp_size=2 on 2 gloo ranks and
        checks that generate with an image gives the tokens of a one-process load.
    """,
    edits=(
        Edit("src/transformers/generation/utils.py", HELPER_ANCHOR, HELPER),
        Edit("src/transformers/generation/utils.py", ENCODE, ENCODE_GATHERED),
    ),
    new_files=(NewFile("tests/models/qwen2_5_vl/test_fsdp_generate.py", TEST),),
)
