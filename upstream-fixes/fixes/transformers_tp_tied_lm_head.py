"""transformers-tp-tied-lm-head: a vision-language model's LM head tied to the vocabulary-sharded embedding gets the
TP plan entry a causal LM's has, so its logits are gathered over the whole vocabulary."""

from upstream_diffs import LICENSE_HEADER, Edit, Fix, NewFile, Variant

TEST = LICENSE_HEADER + '''\
import unittest

from transformers import Gemma3Config, Gemma3ForConditionalGeneration
from transformers.testing_utils import require_torch


@require_torch
class Gemma3TiedHeadTpPlanTest(unittest.TestCase):
    def test_tied_lm_head_is_sharded_and_gathered(self):
        config = Gemma3Config(
            text_config={
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "vocab_size": 128,
            },
            vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2},
        )
        model = Gemma3ForConditionalGeneration(config)
        plan = model.tp_plan
        # tying shards the shared table by vocabulary rows
        self.assertEqual(plan.get("model.language_model.embed_tokens"), "embedding_rowwise")
        # so the head that shares it is sharded the same way and its logits are gathered
        self.assertEqual(plan.get("lm_head"), "colwise_gather_output")
'''

MERGE = '                self._fsdp_plan.update({f"{name}.{k}": v for k, v in plan.copy().items()})\n'
MERGE_NEW = MERGE + '''
        # A head tied to the input embeddings, whose table tying shards by vocabulary, is sharded the same way and its
        # logits gathered, as a causal LM's own plan does.
        tied_embedding = self.get_expanded_tied_weights_keys().get("lm_head.weight", "").removesuffix(".weight")
        if "lm_head" not in self._tp_plan and self._tp_plan.get(tied_embedding) == "embedding_rowwise":
            self._tp_plan["lm_head"] = "colwise_gather_output"
'''

EDITS = (Edit("src/transformers/distributed/mixin.py", MERGE, MERGE_NEW),)
NEW_FILES = (NewFile("tests/models/gemma3/test_tp_plan_tied_head.py", TEST),)

FIX = Fix(
    id="transformers-tp-tied-lm-head",
    distribution="transformers",
    kind="backport",
    upstream="lm_head entries in each vision-language class's _tp_plan (PR not identified), released in 5.20",
    summary="""
        Tying the word embeddings adds "embed_tokens": "embedding_rowwise" to the TP plan, splitting the shared
        table by vocabulary rows. Causal-LM classes plan their tied lm_head "colwise_gather_output"; most
        vision-language classes (Gemma3ForConditionalGeneration, PaliGemma, LLaVA-style models with a tied text
        model) have no entry before 5.20, so with tp_size=2 the head holds this rank's rows of the table and its
        logits cover half the vocabulary: Gemma 3's loss raises "Expected input batch_size (17) to match target
        batch_size (34)", and generate picks tokens from a rank's half of the vocabulary without an error.

        init_parallel_plans gives a tied lm_head without an entry the causal-LM entry where the embedding it shares
        is sharded by vocabulary (5.20 adds the entry to each class instead). The test builds a tiny Gemma 3 and
        checks the head's entry.
    """,
    # the same change; upstream changed the code around it in 5.19 (mixin.py)
    variants=tuple(Variant(since=since, edits=EDITS, new_files=NEW_FILES) for since in ("5.15.0", "5.19.0")),
)
