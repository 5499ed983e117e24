"""TRL's online trainers (GRPO, RLOO, Distillation) on a model-parallel layout: each sees the data-parallel ranks
and sizes (``view``: light, imported by the patch modules before any trainer runs) and generates, seeds and counts
once per replica (``trainers``).
"""
