"""Summed (not averaged) gradients for FSDP2 modules.

FSDP2 averages gradients over the data-parallel ranks by default, so a rank's batch weighs
less as the group grows. Training that defines its loss per sample (a sum over the global
batch) wants the sum at every world size. On gloo, which has no pre-multiplied sum, that
takes two settings, and each applies to one FSDP module's own parameters only: this sets
both on every FSDP module of a model. Call it in ``parallelize`` (every generation builds a
new module, which does not inherit the settings).
"""

from __future__ import annotations

from torch import nn

__all__ = ["sum_gradients"]


def sum_gradients(model: nn.Module) -> nn.Module:
    """Make every FSDP2 module of ``model`` sum its gradients over the data-parallel ranks."""
    from torch.distributed.fsdp import FSDPModule

    found = False
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)
            found = True
    if not found:
        raise ValueError("sum_gradients: the model has no FSDP module (apply fully_shard first)")
    return model
