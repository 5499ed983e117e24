"""Context parallelism (torch's ring attention) runs SDPA's CPU flash kernel, as it runs the CUDA kernels.

torch 2.13 .. 2.15, ``torch/distributed/tensor/experimental/_context_parallel/_attention.py``::

    custom_ops = {
        aten._scaled_dot_product_flash_attention.default: _sdpa_handler,
        ...  # efficient and cuDNN, forward and backward: CUDA kernels only
    }

``context_parallel`` installs those handlers (``_enable_cp_dtensor_dispatcher``) and their sequence-sharded
strategies (``_sharding_rules.register_cp_sharding_rules``). On CPU, SDPA runs
``aten._scaled_dot_product_flash_attention_for_cpu``, which is in neither: the first forward under
``accelerator.maybe_context_parallel`` (and the Trainer with ``ParallelismConfig(cp_size=N)``) raised
``NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding
strategy registered``. The wrappers add the CPU kernel and its backward to upstream's templated ring code while
context parallelism is on (:mod:`shardadopt.parallel.ringcpu`). The probe reads ``custom_ops``: the CPU kernel missing
while the CUDA flash kernel is there is the gap; the CPU kernel in it, upstream's fix.
"""

from __future__ import annotations

from shardadopt import upstream
from shardadopt.patching.contract import Patch, Probe
from shardadopt.upstream.versions import supported


def probe() -> Probe:
    """Look the CPU and CUDA flash kernels up in ring attention's handler table."""
    from shardadopt.upstream.probing import undecided

    handled, kernels = upstream.cp_custom_ops(), upstream.sdpa_flash_kernels()
    if kernels["cpu"] in handled:
        return Probe(False, "torch's ring attention handles the CPU flash SDPA kernel")
    if kernels["cuda"] in handled:
        return Probe(True, "torch's ring attention handles the CUDA SDPA kernels only: on CPU the first forward "
                           "under context parallelism raises NotImplementedError (no sharding strategy for "
                           "aten._scaled_dot_product_flash_attention_for_cpu)")
    raise undecided("torch's context-parallel handler table (_context_parallel._attention.custom_ops)",
                    "the flash SDPA kernels (CUDA, or CPU: the fix)")


def _enable(wrapped, instance, args, kwargs):
    from shardadopt.parallel import ringcpu

    result = wrapped(*args, **kwargs)
    ringcpu.install()
    return result


def _disable(wrapped, instance, args, kwargs):
    from shardadopt.parallel import ringcpu

    result = wrapped(*args, **kwargs)
    ringcpu.uninstall()
    return result


PATCH = Patch(
    id="torch-cp-cpu-flash-attention",
    summary="context parallelism (torch's ring attention, accelerate's ParallelismConfig(cp_size=N), the Trainer) "
            "runs on CPU: the CPU flash SDPA kernel goes through the same ring code as the CUDA kernels",
    upstream="proposal for pytorch main",
    requires=supported("torch"),
    wrappers={upstream.CP_ENABLE_DISPATCHER: _enable, upstream.CP_DISABLE_DISPATCHER: _disable},
    probe=probe,
)
