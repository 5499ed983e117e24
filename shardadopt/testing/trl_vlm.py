"""TRL's SFTTrainer on a vision-language model sharded at load time, and its reference: workers for
``tests/trl/test_vlm_sft.py`` (importable by RankPool workers).

What a user of TRL's vision-language SFT writes: ``AutoModelForImageTextToText.from_pretrained`` (sharded per
``layout``, or plain under DDP), ``AutoProcessor.from_pretrained(dir)`` as ``processing_class``, a ``datasets``
dataset of conversational ``"messages"`` (plain-string contents; TRL puts the image placeholders before the first
user turn) and an ``"images"`` column of PIL images, ``SFTConfig(max_length=None)`` (TRL's advice for VLMs:
truncation could cut image tokens) and ``train()``; TRL's ``DataCollatorForVisionLanguageModeling`` renders the
chat template and runs the image processor per batch.

The model is a tiny Gemma 3 (``shardadopt.testing.archs`` with the image-text-to-text task: SigLIP tower, pooled
image tokens, image tokens attending both ways). Its processor is built offline, as a hub checkpoint would ship it:
a word-level tokenizer whose ids are the tiny config's special ids (``<start_of_image>``, ``<image_soft_token>``,
``<end_of_image>``, pad/eos/bos), Gemma 3's PIL image processor set to the tower's image size, a chat template of
Gemma 3's shape, ``Gemma3Processor.save_pretrained(dir)``. Gemma 3 because its processor builds from local files
on transformers 5.15 and 5.25 alike (Qwen2.5-VL's did not build offline when tried: a video processor lookup).
"""

from __future__ import annotations

import os
from typing import Any

from shardadopt.testing.trl import GLOBAL_BATCH, LR, STEPS, logged_steps, plain_head_shard

MODEL_TYPE = "gemma3"
# Gemma 3's chat template, reduced to what the test rows hold (turns of text, images before the user's text)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}"
    "{{ '<end_of_turn>\n' }}{% endfor %}")
_ROLE_WORDS = ("<start_of_turn>", "<end_of_turn>", "user", "model")
# The plain DDP reference does not re-broadcast rank 0's buffers before each forward (DDP's default does). Gemma 3's
# buffers are constants each rank computes (rotary frequencies, the embedding scale, position ids), and transformers
# 5.15 registers its rotary buffers in ``list(set(config.layer_types))`` order, which follows each process's string
# hash seed: DDP's broadcast matches buffers by position, so a rank with the other order trained with the
# sliding-window frequencies in its full-attention buffer and the reverse (measured: rank 1's first loss 6.21832 for
# the 6.21445 its rows give on the plain model, in some runs only). 5.25 sorts them. Sharded loads have no DDP.
_DDP_REFERENCE = {"ddp_broadcast_buffers": False}


def tiny_vlm(root: str | os.PathLike) -> tuple[str, str]:
    """Write (once) the tiny Gemma 3 checkpoint and its processor under ``root``; (checkpoint dir, processor dir),
    each what ``from_pretrained`` loads."""
    import shutil
    import tempfile

    root = os.fspath(root)
    paths = []
    for name, build in (("checkpoint", _tiny_model), ("processor", _processor)):
        path = os.path.join(root, f"tiny-vlm-sft-{MODEL_TYPE}-{name}")
        if not os.path.exists(os.path.join(path, "config.json" if name == "checkpoint" else "processor_config.json")):
            os.makedirs(root, exist_ok=True)
            staging = tempfile.mkdtemp(prefix=f".tiny-{name}-", dir=root)
            build(*paths).save_pretrained(staging)
            try:
                os.rename(staging, path)
            except OSError:  # another process wrote it first; same seeds, identical
                shutil.rmtree(staging, ignore_errors=True)
        paths.append(path)
    return paths[0], paths[1]


def _tiny_model():
    """The tiny Gemma 3 (:func:`shardadopt.testing.archs.build_tiny`), its zero-initialised weights drawn at random
    as a trained checkpoint has them: Gemma 3 starts its projector (``mm_input_projection_weight``) at zero, which
    would leave the vision tower without a gradient on the first step."""
    import torch

    from shardadopt.testing.archs import IMAGE_TEXT, build_tiny

    model = build_tiny(MODEL_TYPE, task=IMAGE_TEXT)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2 and not parameter.any():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    return model


def _processor(checkpoint: str):
    """Gemma 3's processor for the tiny checkpoint (:func:`tiny_vlm`)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, Gemma3Processor, PreTrainedTokenizerFast

    from shardadopt.testing.vlm import image_processor

    config = AutoConfig.from_pretrained(checkpoint)
    text = config.get_text_config()
    named = {text.pad_token_id: "<pad>", text.eos_token_id: "<eos>", text.bos_token_id: "<bos>",
             config.image_token_index: "<image_soft_token>", config.boi_token_index: "<start_of_image>",
             config.eoi_token_index: "<end_of_image>"}
    free = iter(i for i in range(text.vocab_size) if i not in named)
    named.update({next(free): word for word in ("<unk>", *_ROLE_WORDS)})
    vocab = {named.get(i, f"w{i}"): i for i in range(text.vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>", bos_token="<bos>",
        extra_special_tokens={"image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
                              "eoi_token": "<end_of_image>", "start_of_turn": "<start_of_turn>",
                              "end_of_turn": "<end_of_turn>"})
    images, settings = image_processor(MODEL_TYPE, config)  # the tower's image size, no pan-and-scan crops
    for key, value in settings.items():
        setattr(images, key, value)
    return Gemma3Processor(image_processor=images, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE,
                           image_seq_length=config.mm_tokens_per_image)


def dataset(n: int = STEPS * GLOBAL_BATCH):
    """``n`` rows in TRL's conversational vision form: ``"messages"`` (a user question, the assistant's answer; the
    rows differ in length, so batches need padding) and ``"images"`` (one small random RGB image each, of several
    sizes: the processor resizes them)."""
    import random

    import numpy as np
    from datasets import Dataset
    from PIL import Image

    rng = random.Random(11)
    words = [f"w{i}" for i in range(16, 500)]
    rows: dict[str, list] = {"messages": [], "images": []}
    for i in range(n):
        question = " ".join(rng.choices(words, k=rng.randint(2, 6)))
        answer = " ".join(rng.choices(words, k=rng.randint(3, 10)))
        rows["messages"].append([{"role": "user", "content": question}, {"role": "assistant", "content": answer}])
        pixels = np.random.default_rng(i).integers(0, 256, (24 + 4 * (i % 3), 32, 3), dtype=np.uint8)
        rows["images"].append([Image.fromarray(pixels)])
    return Dataset.from_dict(rows)


def vlm_sft_log(checkpoint: str, processor: str, layout: str | None, world: int = 2) -> dict[str, Any]:
    """TRL's SFTTrainer for STEPS steps on the tiny VLM sharded per ``layout`` over ``world`` ranks, or
    (``layout=None``) plain under DDP over ``world`` ranks (``world=1``: one process), full fine-tuning in fp32
    (``bf16=False``), the same global batch (``GLOBAL_BATCH``) on every layout. ``{"log": [{"loss", "grad_norm"}
    per step], "dp": data-parallel size}`` or ``{"refused": shardadopt's error}``, and ``"plain_head_shard"``."""
    import tempfile

    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor, PrinterCallback
    from trl import SFTConfig, SFTTrainer

    import shardadopt
    from shardadopt import upstream
    from shardadopt.adopt import AdoptionError
    from shardadopt.testing.layouts import distributed_sizes

    shardadopt.enable()
    try:
        kwargs: dict[str, Any] = {"dtype": torch.float32}
        dp = world
        if layout is not None:
            from transformers.distributed import DistributedConfig

            sizes, dp = distributed_sizes(layout, world)
            kwargs["distributed_config"] = DistributedConfig(**sizes)
        model = AutoModelForImageTextToText.from_pretrained(checkpoint, **kwargs)
        upstream.reset_accelerate_state()  # pooled ranks run several trainers in one process
        result: dict[str, Any] = {"plain_head_shard": plain_head_shard(model), "dp": dp}
        with tempfile.TemporaryDirectory(prefix="shardadopt-trl-vlm-") as out:
            args = SFTConfig(output_dir=out, max_length=None, per_device_train_batch_size=GLOBAL_BATCH // dp,
                             max_steps=STEPS, learning_rate=LR["full"], lr_scheduler_type="constant",
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False, seed=0,
                             disable_tqdm=True, **(_DDP_REFERENCE if layout is None else {}))
            trainer = SFTTrainer(model=model, args=args, train_dataset=dataset(),
                                 processing_class=AutoProcessor.from_pretrained(processor))
            trainer.remove_callback(PrinterCallback)
            try:
                trainer.train()
            except AdoptionError as exc:
                return {**result, "refused": f"{type(exc).__name__}: {exc}"}
            return {**result, "log": logged_steps(trainer)}
    finally:
        shardadopt.disable()
