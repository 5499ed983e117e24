"""PEFT LoRA through the ordinary accelerate loop on 4 ranks: HSDP and 2-D (fsdp x tp) loads equal one process.

The same checks as ``tests/test_adapters.py`` (``shardadopt.testing.lora.check_lora_training``). transformers 5.15
can load neither layout (no ``dp_replicate_size``; ``fsdp_size`` with ``tp_size`` refused): skipped with the reason.
"""

from __future__ import annotations

import pytest

from shardadopt.selftest.trainer import LayoutUnsupported, distributed_sizes
from shardadopt.testing.lora import check_lora_training, reference_cache

pytest.importorskip("peft", reason="the adapter tests need peft (shardadopt[peft])")

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def references(tiny_models):
    return reference_cache(tiny_models)


@pytest.mark.parametrize("layout, model", [("hsdp", "llama"), ("2d", "qwen3")])
def test_lora_four_ranks_match_single_process(request, tiny_models, references, tmp_path, layout, model):
    try:
        sizes, dp = distributed_sizes(layout, world=4)
    except LayoutUnsupported as exc:
        pytest.skip(f"{layout}: {exc}")
    pool = request.getfixturevalue("pool4")  # started only when a layout can load
    check_lora_training(pool, tiny_models[model], model, sizes, dp, references, str(tmp_path))


@pytest.mark.parametrize("case, layout, message", [
    ("dora", "2d", "DoRA (use_dora=True) on a fsdp x tp load"),
    ("modules-to-save", "hsdp", "modules_to_save=['lm_head'] on a HSDP (dp_replicate_size > 1) load"),
])
def test_dora_and_modules_to_save_refused_on_untested_layouts(request, tiny_models, case, layout, message):
    from shardadopt.testing.lora import adapter_case

    try:
        sizes, _ = distributed_sizes(layout, world=4)
    except LayoutUnsupported as exc:
        pytest.skip(f"{layout}: {exc}")
    pool = request.getfixturevalue("pool4")
    model = "qwen3" if layout == "2d" else "llama"
    for result in pool.run(adapter_case, tiny_models[model], sizes, case):
        assert result["error"] and result["error"].startswith("AdapterLayoutError: LoraConfig: "), result
        assert message in result["error"], result
