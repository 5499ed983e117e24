"""torch-cp-cpu-flash-attention: context parallelism's ring attention serves SDPA's CPU flash kernel."""

from upstream_diffs import Edit, Fix, NewFile, Variant

TEST = '''import os
import unittest

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import context_parallel_unshard

WORLD_SIZE = 2


def _ring_matches_full_attention(rank, port, is_causal, errors):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        generator = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 4, 16, 8, generator=generator) for _ in range(3))
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = F.scaled_dot_product_attention(*whole, is_causal=is_causal)
        expected.sum().backward()

        cp_q, cp_k, cp_v = (t.clone() for t in (q, k, v))
        with context_parallel(mesh, buffers=[cp_q, cp_k, cp_v], buffer_seq_dims=[2, 2, 2]):
            local = [t.detach().requires_grad_() for t in (cp_q, cp_k, cp_v)]
            # on CPU, SDPA runs aten._scaled_dot_product_flash_attention_for_cpu
            out = F.scaled_dot_product_attention(*local, is_causal=is_causal)
            out.sum().backward()
        if out.shape[2] != q.shape[2] // WORLD_SIZE:
            raise AssertionError(f"rank {rank} attended over {out.shape[2]} positions, not its chunk")
        got = context_parallel_unshard(mesh, [out.detach()] + [t.grad for t in local], [2, 2, 2, 2])
        for name, actual, reference in zip(("out", "grad_q", "grad_k", "grad_v"), got,
                                           [expected] + [t.grad for t in whole]):
            torch.testing.assert_close(actual, reference.detach(), msg=lambda m: f"{name}: {m}")
    except Exception as exc:  # noqa: BLE001 - reported to the parent process
        errors.put(f"rank {rank}: {exc!r}")
    finally:
        dist.destroy_process_group()


class RingAttentionCpuFlashTest(unittest.TestCase):
    def _run(self, is_causal):
        errors = mp.get_context("spawn").SimpleQueue()
        port = 29000 + os.getpid() % 1000
        mp.spawn(_ring_matches_full_attention, args=(port, is_causal, errors), nprocs=WORLD_SIZE)
        failures = []
        while not errors.empty():
            failures.append(errors.get())
        self.assertEqual(failures, [])

    def test_causal(self):
        # context_parallel balances the causal load by default (each rank holds a head and a tail chunk)
        self._run(True)


if __name__ == "__main__":
    unittest.main()
'''

_RING_FUNCTIONS_ANCHOR = '''

def _sdpa_handler(
'''

_RING_FUNCTIONS = '''

def _scaled_dot_product_ring_flash_attention_for_cpu(
    mesh: DeviceMesh,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, ...]:
    if attn_mask is not None:
        raise NotImplementedError("attn_mask is not supported yet")

    # TODO: remove this hardcoding
    seq_dim = 2
    group = mesh.get_group()
    return _templated_ring_attention(
        group,
        seq_dim,
        aten._scaled_dot_product_flash_attention_for_cpu,
        query=query,
        key=key,
        value=value,
        is_causal=is_causal,
        dropout_p=dropout_p,
        scale=scale,
    )


def _scaled_dot_product_ring_flash_attention_for_cpu_backward(
    mesh: DeviceMesh,
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, ...]:
    if attn_mask is not None:
        raise NotImplementedError("attn_mask is not supported yet")

    # TODO: remove this hardcoding
    seq_dim = 2
    group = mesh.get_group()
    return _templated_ring_attention_backward(
        group,
        seq_dim,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=grad_out,
        grad_out_name="grad_out",
        query=query,
        key=key,
        value=value,
        out=out,
        logsumexp=logsumexp,
        is_causal=is_causal,
        dropout_p=dropout_p,
        scale=scale,
    )


def _sdpa_handler(
'''

_CALL_MAPS_OLD = '''        aten._scaled_dot_product_cudnn_attention_backward.default: _scaled_dot_product_ring_cudnn_attention_backward,
    }
'''

_CALL_MAPS_NEW = '''        aten._scaled_dot_product_cudnn_attention_backward.default: _scaled_dot_product_ring_cudnn_attention_backward,
        aten._scaled_dot_product_flash_attention_for_cpu.default: _scaled_dot_product_ring_flash_attention_for_cpu,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _scaled_dot_product_ring_flash_attention_for_cpu_backward,
    }
'''

_CUSTOM_OPS_OLD = '''    aten._scaled_dot_product_cudnn_attention_backward.default: _sdpa_handler,
}
'''

_CUSTOM_OPS_NEW = '''    aten._scaled_dot_product_cudnn_attention_backward.default: _sdpa_handler,
    aten._scaled_dot_product_flash_attention_for_cpu.default: _sdpa_handler,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _sdpa_handler,
}
'''

_ATTENTION = "torch/distributed/tensor/experimental/_context_parallel/_attention.py"
_RULES = "torch/distributed/tensor/experimental/_context_parallel/_sharding_rules.py"

_ATTENTION_EDITS = (
    Edit(_ATTENTION, _RING_FUNCTIONS_ANCHOR, _RING_FUNCTIONS),
    Edit(_ATTENTION, _CALL_MAPS_OLD, _CALL_MAPS_NEW),
    Edit(_ATTENTION, _CUSTOM_OPS_OLD, _CUSTOM_OPS_NEW),
)

_STRATEGIES_ANCHOR = '''# Store context managers and original strategies
'''

# torch 2.13: op strategies expanded over the mesh by expand_to_full_mesh_op_strategy.
_STRATEGIES_213 = '''# ==================== CPU Flash Attention Strategies ====================


def _scaled_dot_product_flash_attention_for_cpu_cp_strategy(
    op_schema: OpSchema,
) -> OpStrategy:
    """
    Strategy for the CPU flash attention forward with Context Parallelism support.
    It returns the same (output, logsumexp) pair as the CUDA flash kernel.
    """
    mesh = op_schema.get_mesh_from_args()
    cp_strategy: PlacementList = [
        Shard(SEQ_DIM),  # output
        Shard(SEQ_DIM),  # logsumexp
        Shard(SEQ_DIM),  # q
        Shard(SEQ_DIM),  # k
        Shard(SEQ_DIM),  # v
    ]
    return expand_to_full_mesh_op_strategy(
        mesh, op_schema, [[Replicate()] * 5, cp_strategy], input_index=2
    )


def _scaled_dot_product_flash_attention_for_cpu_backward_cp_strategy(
    op_schema: OpSchema,
) -> OpStrategy:
    """
    Strategy for the CPU flash attention backward with Context Parallelism support.
    """
    mesh = op_schema.get_mesh_from_args(validate=False)
    # grad_q, grad_k, grad_v, then grad_out, q, k, v, out, logsumexp
    cp_strategy: PlacementList = [Shard(SEQ_DIM)] * 9
    return expand_to_full_mesh_op_strategy(
        mesh, op_schema, [[Replicate()] * 9, cp_strategy], input_index=3
    )


# Store context managers and original strategies
'''

# torch 2.15: single-mesh-dim strategies (the all-Replicate rule is implied).
_STRATEGIES_215 = '''# ==================== CPU Flash Attention Strategies ====================


def _scaled_dot_product_flash_attention_for_cpu_cp_single_dim_strategy(
    op: torch._ops.OpOverload,
    args_schema: ArgsType,
    kwargs_schema: KwargsType,
) -> list[SingleDimPlacementList]:
    # The CPU flash kernel returns the same (output, logsumexp) pair as the CUDA one.
    return [
        [
            _cp_sharding(),  # output
            _cp_sharding(),  # logsumexp
            _cp_sharding(),  # q
            _cp_sharding(),  # k
            _cp_sharding(),  # v
        ]
    ]


def _scaled_dot_product_flash_attention_for_cpu_backward_cp_single_dim_strategy(
    op: torch._ops.OpOverload,
    args_schema: ArgsType,
    kwargs_schema: KwargsType,
) -> list[SingleDimPlacementList]:
    # grad_q, grad_k, grad_v, then grad_out, q, k, v, out, logsumexp
    return [[_cp_sharding() for _ in range(9)]]


# Store context managers and original strategies
'''


def _register(strategy: str, backward: str) -> tuple[str, str]:
    old = f'''            aten._scaled_dot_product_cudnn_attention_backward.default,
            _scaled_dot_product_cudnn_attention_backward_{strategy},
            None,
        ),
    ]
'''
    new = f'''            aten._scaled_dot_product_cudnn_attention_backward.default,
            _scaled_dot_product_cudnn_attention_backward_{strategy},
            None,
        ),
        (
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            _scaled_dot_product_flash_attention_for_cpu_{strategy},
            None,
        ),
        (
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            _scaled_dot_product_flash_attention_for_cpu_backward_{backward},
            None,
        ),
    ]
'''
    return old, new


def _rules(strategies: str, strategy: str) -> tuple[Edit, ...]:
    return (Edit(_RULES, _STRATEGIES_ANCHOR, strategies), Edit(_RULES, *_register(strategy, strategy)))


FIX = Fix(
    id="torch-cp-cpu-flash-attention",
    distribution="torch",
    kind="proposal",
    upstream="pytorch main",
    summary="""
        context_parallel dispatches scaled_dot_product_attention to ring attention through a table of SDPA kernels
        (custom_ops, the handler's call map and the CP sharding rules) that lists the CUDA flash, efficient and
        cuDNN kernels only. On CPU, SDPA runs aten._scaled_dot_product_flash_attention_for_cpu, so the first forward
        under context_parallel raises "Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not
        have a sharding strategy registered", and context parallelism cannot run (or be tested) without a GPU.

        The CPU flash kernel returns the same (output, logsumexp) pair, in the same [batch, heads, sequence] layout,
        as the CUDA flash kernel, and its backward takes the same named inputs. Register both with the same
        templated ring forward and backward and the same sequence-sharded strategy, so CPU runs take the code path
        GPUs take. attn_mask stays unsupported, as attn_bias is for the other kernels.
    """,
    variants=(
        Variant(since="2.13.0", edits=_ATTENTION_EDITS + _rules(_STRATEGIES_213, "cp_strategy"),
                new_files=(NewFile("test/distributed/tensor/test_cp_cpu_flash_attention.py", TEST),)),
        Variant(since="2.15.0", edits=_ATTENTION_EDITS + _rules(_STRATEGIES_215, "cp_single_dim_strategy"),
                new_files=(NewFile("test/distributed/tensor/test_cp_cpu_flash_attention.py", TEST),)),
    ),
)
