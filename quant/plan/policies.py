"""The plan policies, registered by name (``plan.policy``): each is an expert policy (``expert_policy``: experts at
high or low bits from per-expert scores) or a layer policy (``layer_policy``, ``joint_policy``: each MoE layer's
expert scheme groups from measured layer damage), with the words the model card describes it in. Code outside a
policy's own module asks the registered object, never the policy's name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from quant.errors import PlanError
from quant.plan import expert_policy, joint_policy, layer_policy
from quant.recipe import PlanSpec


@dataclass(frozen=True)
class Policy:
    """One plan policy: exactly one of ``experts`` (profile, modules, spec -> ``expert_policy.Choice``) or
    ``layers`` (profile, modules, spec -> MoE layer -> ``layer_policy.LayerGroups``); ``describe``: the model
    card's words after the policy's name; ``splits_layers``: a layer policy that may give one MoE layer's experts
    two scheme groups (served by quant's vLLM plugin only)."""

    describe: Callable[[PlanSpec], str]
    experts: Callable | None = None
    layers: Callable | None = None
    splits_layers: bool = False

    def __post_init__(self):
        assert (self.experts is None) != (self.layers is None), "a policy decides experts or layers, not both"


POLICIES = {
    "top_fraction": Policy(expert_policy.describe_fraction, experts=expert_policy.top_fraction),
    "budget": Policy(expert_policy.describe_budget, experts=expert_policy.budget),
    "sensitivity": Policy(expert_policy.describe_nothing, experts=expert_policy.sensitivity),
    "random": Policy(expert_policy.describe_fraction, experts=expert_policy.random),
    "inverse": Policy(expert_policy.describe_fraction, experts=expert_policy.inverse),
    "uniform": Policy(expert_policy.describe_nothing, experts=expert_policy.uniform),
    "layer_sensitivity": Policy(layer_policy.describe, layers=layer_policy.layer_sensitivity),
    "joint": Policy(joint_policy.describe, layers=joint_policy.joint, splits_layers=True),
}


def policy(name: str) -> Policy:
    """The registered policy ``name``; a miss names the valid ones."""
    try:
        return POLICIES[name]
    except KeyError:
        raise PlanError(f"unknown plan.policy {name!r}; valid: {', '.join(POLICIES)}") from None
