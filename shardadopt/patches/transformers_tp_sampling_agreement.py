"""Tensor parallelism: the ranks of a TP group sample the same tokens in ``generate``.

Upstream: not reported yet (proposal, ``upstream-fixes/transformers-tp-sampling-agreement.diff``). ``generate(do_sample=
True)`` draws each token with ``torch.multinomial`` from this process's generator. TRL's GRPO and RLOO trainers seed
every process differently (``set_seed(args.seed, device_specific=True)``), and so does a user loop that seeds by
rank, so the two ranks of a ``tp_size=2`` model sample different completions from the same logits: the TP forward
and backward then mix two batches, and TRL's logged reward averages completions one replica never trained on
(GRPO ``tp_size=2``: step-1 grad norm 4.85 where one process gives 3.05). transformers 5.15 .. 5.25 sample this way.

The wrapper calls :func:`shardadopt.parallel.sampling.agree_sampling_rng` on the model before
``GenerationMixin.generate``
runs: every rank of the TP group takes the random state of the group's first rank, and data-parallel ranks keep
their own streams. The probe reads ``GenerationMixin.generate`` and ``_sample``: ``multinomial`` sampling with no
random state shared (``set_rng_state`` / a broadcast) means ``needed``; generate sharing it means ``not-needed``.
No ``needed_by``: a TP model that never samples trains right without it, so an ``unsupported`` probe refuses
nothing (it warns, as every unsupported patch does).
"""

from __future__ import annotations

from shardadopt import upstream
from shardadopt.patching.contract import Patch, Probe, Target
from shardadopt.upstream.versions import supported

GENERATE = Target("transformers.generation.utils", "GenerationMixin.generate")
# What a generate that makes a model-parallel group's random state agree would call.
_SHARED_STATE = {"set_rng_state", "broadcast", "broadcast_object_list"}


def probe() -> Probe:
    from shardadopt.upstream.probing import calls, names, source_tree, undecided

    where = "transformers-tp-sampling-agreement probe"
    generate = source_tree(upstream.upstream_method(GENERATE, where))
    sample = source_tree(upstream.upstream_method(upstream.GENERATION_SAMPLE, where))
    shared = _SHARED_STATE & (names(generate) | names(sample))
    if shared:
        return Probe(False, f"generate shares the random state before sampling ({', '.join(sorted(shared))})")
    if calls(sample, "multinomial"):
        return Probe(True, "generate samples with this process's generator (torch.multinomial in _sample) and "
                           "never makes a tensor-parallel group's random state agree: per-process seeds give the "
                           "TP ranks different tokens")
    raise undecided(upstream.GENERATION_SAMPLE.qualname,
                    "torch.multinomial sampling (the gap) nor a shared random state (the fix)")


def _generate(wrapped, instance, args, kwargs):
    from shardadopt.parallel.sampling import agree_sampling_rng
    from shardadopt.parallel.topology import TopologyError

    try:
        agree_sampling_rng(instance)
    except TopologyError:  # a layout shardadopt cannot read has no TP group it knows: generate as upstream does
        pass
    return wrapped(*args, **kwargs)


PATCH = Patch(
    id="transformers-tp-sampling-agreement",
    summary="TP: generate() gives every rank of a tensor-parallel group its first rank's random state, so "
            "per-process seeds (TRL GRPO/RLOO, a user's per-rank seed) sample the same tokens on one replica",
    upstream="proposal for transformers main (not reported yet)",
    requires=supported("transformers"),
    wrappers={GENERATE: _generate},
    probe=probe,
)
