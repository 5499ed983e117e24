"""trl-rloo-data-parallel: RLOOTrainer seeds and sizes its generation batch by data-parallel rank where the ranks of
a model-parallel group (tensor parallelism) share one batch, and refuses what cannot train right there (the same
change as trl-grpo-data-parallel, in rloo_trainer.py)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("fix_trl_grpo_data_parallel_shared",
                                               Path(__file__).with_name("trl_grpo_data_parallel.py"))
_grpo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_grpo)

FIX = _grpo.fix("RLOOTrainer", "RLOOConfig", "rloo", _grpo.BEYOND)
