"""``peft-sharded-adapters``' probe answers for the right reason on each peft release, each of its halves read apart.

The probe has two halves: LoRA factors of a transformers tensor-parallel base sized by the local shard (peft 0.21;
peft 0.22 sizes them at full size and shards them itself, reading the local shape only for a TP mesh without a
transformers plan) and no adapter gradient reduced over the data-parallel ranks (both releases). The first test asks
the installed peft; the others give the probe synthetic upstream functions of each shape (0.21's and 0.22's sizing,
an injection that reduces or not), so both halves are read on either dependency set.
"""

from __future__ import annotations

import pytest

from shardadopt.patching.registry import APPLIED, NOT_NEEDED, UNSUPPORTED
from shardadopt.testing.patching import probe_state

PID = "peft-sharded-adapters"
LOCAL = "sizes LoRA factors of a tensor-parallel base by its local shard"
UNREDUCED = "reduces no adapter gradient over the data-parallel ranks"

peft = pytest.importorskip("peft")




def test_the_installed_peft_gets_the_halves_it_needs():
    """peft 0.21 needs both halves; 0.22 (full-size TP adapters, sharded by peft) the gradient reduction only, and the
    reason says so."""
    from packaging.version import Version

    state, reason = probe_state(PID)
    assert state == APPLIED, reason
    assert UNREDUCED in reason, reason
    if Version(peft.__version__) >= Version("0.22.0"):
        assert LOCAL not in reason and "at full size itself" in reason, reason
    else:
        assert LOCAL in reason, reason


# the shapes of peft/tuners/tuners_utils.py:_get_in_out_features (the Linear branch) on 0.21.2 and 0.22.0
def sized_like_0_21(module):
    if isinstance(module.weight, DTensor):  # noqa: F821  (never run: the probe reads the source)
        mesh_dim_names = module.weight.device_mesh.mesh_dim_names or ()
        if set(mesh_dim_names) <= {"fsdp"}:
            in_features, out_features = module.in_features, module.out_features
        else:
            out_features, in_features = module.weight.to_local().shape
    else:
        in_features, out_features = module.in_features, module.out_features
    return in_features, out_features


def sized_like_0_22(module):
    in_features, out_features = module.in_features, module.out_features
    if isinstance(module.weight, DTensor):  # noqa: F821  (as above)
        names = module.weight.device_mesh.mesh_dim_names
        has_tp_dim = any(TpMeshDimRegistry.is_registered(n) for n in names)  # noqa: F821
        # upstream-private: the transformers TP plan peft 0.22 stamps on a base layer (what the probe reads)
        if has_tp_dim and getattr(module, "_hf_tp_plan", None) is None:
            out_features, in_features = module.weight.to_local().shape
    return in_features, out_features


# BaseTuner.inject_adapter: without a reduction (both releases), and with the fix's shape (the adapters' gradients
# averaged over the data-parallel ranks after injection)
def inject_unreduced(self, model, adapter_name, autocast_adapter_dtype=True, low_cpu_mem_usage=False,
                     state_dict=None):
    for key, module in model.named_modules():
        replace_with_lora(model, key, module, self.peft_config[adapter_name], adapter_name)  # noqa: F821  (as above)


def inject_reduced(self, model, adapter_name, autocast_adapter_dtype=True, low_cpu_mem_usage=False,
                   state_dict=None):
    for key, module in model.named_modules():
        replace_with_lora(model, key, module, self.peft_config[adapter_name], adapter_name)  # noqa: F821  (as above)
    for param in model.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(lambda p: torch.distributed.all_reduce(p.grad))  # noqa: F821


@pytest.mark.parametrize("sizing,inject,state,said,not_said", [
    (sized_like_0_21, inject_unreduced, APPLIED, [LOCAL, UNREDUCED], []),
    (sized_like_0_22, inject_unreduced, APPLIED, [UNREDUCED, "at full size itself"], [LOCAL]),
    (sized_like_0_21, inject_reduced, APPLIED, [LOCAL], [UNREDUCED]),
    (sized_like_0_22, inject_reduced, NOT_NEEDED, ["global shape", "reduces their gradients"], []),
], ids=["0.21-sizing-unreduced", "0.22-sizing-unreduced", "0.21-sizing-reduced", "0.22-sizing-reduced"])
def test_each_half_is_read_on_its_own(monkeypatch, sizing, inject, state, said, not_said):
    from peft.tuners import tuners_utils

    # upstream-private: the function the probe reads, replaced by a release's shape
    monkeypatch.setattr(tuners_utils, "_get_in_out_features", sizing)
    monkeypatch.setattr(tuners_utils.BaseTuner, "inject_adapter", inject)
    found, reason = probe_state(PID)
    assert found == state, reason
    assert all(s in reason for s in said) and not any(s in reason for s in not_said), reason


def test_a_sizing_without_linear_shapes_is_not_read_as_fixed(monkeypatch):
    """A ``_get_in_out_features`` the probe cannot find is unsupported, not a guess."""
    from peft.tuners import tuners_utils

    # upstream-private: as above, here removed
    monkeypatch.delattr(tuners_utils, "_get_in_out_features")
    found, reason = probe_state(PID)
    assert found == UNSUPPORTED, reason
