"""A tiny word-level tokenizer and text samples, offline, for TRL runs on the tiny checkpoints.

TRL's trainers need a ``processing_class`` (the tiny checkpoints have no tokenizer, and nothing may be downloaded):
:func:`tiny_tokenizer` writes a ``PreTrainedTokenizerFast`` whose vocabulary fits the tiny models' 512 ids.
"""

from __future__ import annotations

import os

from shardadopt.testing.models import VOCAB_SIZE

SPECIAL_TOKENS = ("<pad>", "<unk>", "<eos>")
WORDS = tuple(f"w{i}" for i in range(VOCAB_SIZE - len(SPECIAL_TOKENS)))


def tiny_tokenizer(root: str | os.PathLike) -> str:
    """Write (once) a word-level tokenizer for the tiny models under ``root``; its directory, which
    ``AutoTokenizer.from_pretrained`` loads."""
    import tempfile

    path = os.path.join(os.fspath(root), "tiny-tokenizer")
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return path
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                        eos_token="<eos>", model_input_names=["input_ids", "attention_mask"])
    os.makedirs(os.fspath(root), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".tiny-tokenizer-", dir=os.fspath(root))
    tokenizer.save_pretrained(staging)
    try:
        os.rename(staging, path)
    except OSError:  # another process won the race; its copy is identical
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return path


def sentences(n: int, seed: int, min_words: int = 4, max_words: int = 12) -> list[str]:
    """``n`` deterministic random sentences of different lengths (so batches need padding)."""
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))) for _ in range(n)]
