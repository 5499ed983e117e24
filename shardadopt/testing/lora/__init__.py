"""LoRA on load-time-sharded models against one process, scenario by scenario (workers importable by RankPool).

- ``common``: the constants, ``LoraConfig``, batches, model load and adapter comparisons every scenario shares;
- ``training``: the user's accelerate loop and its export, against the one-process run;
- ``resume``: ``save_state``/``load_state`` with two adapters trained in turn (its loop, ``straight_and_resumed``,
  also resumes the expert LoRA test);
- ``cases``: refusals, and initial values independent of each rank's seed;
- ``several``: several adapters on one model (``set_adapter``, ``add_weighted_adapter``, ``delete_adapter``).
"""
