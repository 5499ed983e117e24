"""A DTensor redistribution whose output got no gradient passes none back, instead of failing in backward.

``DTensor.redistribute`` and ``full_tensor`` record torch's ``Redistribute`` function. When nothing below needs the
gradient of its output (a custom autograd Function that returns None for that input: TRL's distillation loss does
so for the teacher's LM head, which it reads through ``full_tensor()``), autograd still calls
``Redistribute.backward``, with zeros it materialises from the output's tensor options: a plain tensor, no DTensor
spec. ``Redistribute.backward`` (torch 2.13 .. 2.15) hands it to ``NestedRedistribute``, which fails with
``AttributeError: 'Tensor' object has no attribute '_local_tensor'``: a tensor-parallel teacher crashes the
student's backward. A real gradient of a DTensor output is always a DTensor (``to_local``'s backward wraps it), so a
plain one is that made-up zero, and no gradient is the same answer.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import DTensor

__all__ = ["no_gradient_from_below", "no_gradients"]


def no_gradient_from_below(grad_output: Any) -> bool:
    """Whether ``grad_output``, handed to the backward of a function whose output is a DTensor, is autograd's
    materialised zero for an output nothing differentiated (a plain tensor, or None)."""
    return not isinstance(grad_output, DTensor)


def no_gradients(ctx: Any) -> tuple[None, ...]:
    """No gradient for any input of the forward that recorded ``ctx``: what a backward returns when none flows."""
    return (None,) * len(ctx.needs_input_grad)
