"""torch-dtensor-redistribute-no-grad: backward through a redistribution whose output got no gradient passes none."""

from upstream_diffs import Edit, Fix, NewFile

TEST = '''import os
import unittest

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor


class _FirstInputOnly(torch.autograd.Function):
    """Differentiates its first input only (returns None for the second), as a distillation loss does for the
    frozen teacher's head."""

    @staticmethod
    def forward(ctx, hidden, weight):
        ctx.save_for_backward(weight)
        return hidden @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return grad @ weight, None


class RedistributeWithoutGradientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29581")
        dist.init_process_group("gloo", rank=0, world_size=1)
        cls.mesh = init_device_mesh("cpu", (1,))

    @classmethod
    def tearDownClass(cls):
        dist.destroy_process_group()

    def test_output_without_gradient(self):
        # autograd materializes a plain zero tensor for the full_tensor() output nothing differentiated; the
        # backward must pass no gradient instead of reading `_local_tensor` from it
        weight = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), self.mesh, [Shard(0)]))
        hidden = torch.randn(5, 3, requires_grad=True)
        _FirstInputOnly.apply(hidden, weight.full_tensor()).sum().backward()
        torch.testing.assert_close(hidden.grad, torch.ones(5, 4) @ weight.full_tensor().detach())
        self.assertIsNone(weight.grad)

    def test_real_gradient_still_flows(self):
        weight = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), self.mesh, [Shard(0)]))
        scale = torch.randn(4, 3)
        (weight.full_tensor() * scale).sum().backward()
        torch.testing.assert_close(weight.grad.full_tensor(), scale)


if __name__ == "__main__":
    unittest.main()
'''

OLD = '''    def backward(ctx, grad_output: "dtensor.DTensor"):  # type: ignore[override]
        output_dtensor = NestedRedistribute.apply(
'''

NEW = '''    def backward(ctx, grad_output: "dtensor.DTensor"):  # type: ignore[override]
        if not isinstance(grad_output, dtensor.DTensor):
            # Nothing differentiated the output (a custom Function returned None for it): autograd materialized
            # zeros from its options, a plain tensor with no spec. No gradient flows back.
            return (None,) * len(ctx.needs_input_grad)
        output_dtensor = NestedRedistribute.apply(
'''

FIX = Fix(
    id="torch-dtensor-redistribute-no-grad",
    distribution="torch",
    kind="proposal",
    upstream="pytorch main",
    summary="""
        DTensor.full_tensor() and redistribute() record Redistribute. When nothing differentiates their output, for
        example a custom autograd Function that returns None for that input (TRL's distillation loss reads a
        tensor-parallel teacher's LM head through full_tensor() and returns no gradient for it), autograd still
        calls Redistribute.backward, with zeros it materializes from the output's tensor options: a plain tensor.
        Redistribute.backward hands it to NestedRedistribute, whose forward reads grad_output._local_tensor and
        fails with AttributeError, so the student's backward crashes.

        A real gradient of a DTensor output is a DTensor (to_local's backward wraps it), so a plain one can only be
        that made-up zero: return no gradient for it. Gradients that are DTensors are redistributed as before.
    """,
    edits=(Edit("torch/distributed/tensor/_redistribute.py", OLD, NEW),),
    new_files=(NewFile("test/distributed/tensor/test_redistribute_without_gradient.py", TEST),),
)
