"""A DTensor redistribution whose output got no gradient (TRL distillation's teacher head) no longer fails backward.

torch 2.13 .. 2.15, ``torch/distributed/tensor/_redistribute.py``::

    class Redistribute(torch.autograd.Function):
        ...
        @staticmethod
        def backward(ctx, grad_output: "dtensor.DTensor"):
            output_dtensor = NestedRedistribute.apply(grad_output, ctx.current_spec, ...)

When nothing differentiated the output, autograd passes zeros it made from the output's options: a plain tensor,
and ``NestedRedistribute.forward`` reads ``grad_output._local_tensor`` (``AttributeError``). The wrapper returns no
gradient for such a call (:mod:`shardadopt.parallel.dtensor_grads`) and leaves every DTensor gradient to upstream. The
probe reads ``Redistribute.backward``: an unconditional ``NestedRedistribute.apply(grad_output, ...)`` is the broken
shape; a check of ``grad_output`` first (None or not a DTensor) is the fix.
"""

from __future__ import annotations

import ast

from shardadopt import upstream
from shardadopt.patching.contract import Patch, Probe
from shardadopt.upstream.versions import supported


def _checks_grad_output(tree: ast.AST) -> bool:
    """Whether a function tests ``grad_output`` (``is None`` or ``isinstance``) before using it."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == "grad_output":
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance" and \
                node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "grad_output":
            return True
    return False


def _redistributes_grad_output(tree: ast.AST) -> bool:
    """Whether a function calls ``NestedRedistribute.apply(grad_output, ...)``."""
    return any(isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "apply"
               and isinstance(node.func.value, ast.Name) and node.func.value.id == "NestedRedistribute"
               and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "grad_output"
               for node in ast.walk(tree))


def probe() -> Probe:
    """Parse ``Redistribute.backward``."""
    from shardadopt.upstream.probing import source_tree, undecided

    where = "torch's DTensor Redistribute.backward"
    tree = source_tree(upstream.upstream_method(upstream.REDISTRIBUTE_BACKWARD, "torch-dtensor-redistribute-no-grad"))
    if _checks_grad_output(tree):
        return Probe(False, "Redistribute.backward checks its grad_output before redistributing it")
    if _redistributes_grad_output(tree):
        return Probe(True, "Redistribute.backward redistributes whatever autograd hands it: the plain zeros "
                           "materialised for an output nothing differentiated fail with AttributeError")
    raise undecided(where, "NestedRedistribute.apply(grad_output, ...) (the unfixed shape) nor a check of "
                           "grad_output (the fix)")


def _backward(wrapped, instance, args, kwargs):
    from shardadopt.parallel.dtensor_grads import no_gradient_from_below, no_gradients

    ctx, grad_output = args[0], args[1] if len(args) > 1 else kwargs.get("grad_output")
    if no_gradient_from_below(grad_output):
        return no_gradients(ctx)
    return wrapped(*args, **kwargs)


PATCH = Patch(
    id="torch-dtensor-redistribute-no-grad",
    summary="backward through DTensor.full_tensor()/redistribute whose output got no gradient (TRL distillation's "
            "tensor-parallel teacher head) passes none back instead of failing with AttributeError",
    upstream="proposal for pytorch main",
    requires=supported("torch"),
    wrappers={upstream.REDISTRIBUTE_BACKWARD: _backward},
    probe=probe,
)
