"""Boxing: change a global tensor's layout (nd-SBP, placement, device type).

``plan_boxing`` makes a :class:`Plan` (data, cached, costed in bytes); ``run_plan``
runs it on a local shard with autograd (each step's backward is its dual transition).
See :mod:`sbpflow.boxing.plan` for the transition table. :mod:`sbpflow.boxing.convert`
turns the ranks' local tensors into the shards of a global tensor (and back to a whole
value); like the rest of this package it works on torch tensors, below
:class:`sbpflow.Tensor`.
"""

from .convert import gather_whole, global_to_global, local_to_global
from .plan import Plan, Step, axis_collective, plan_boxing, transition_cost
from .steps import apply_axis, backend_of, broadcast_from_first, run_plan

__all__ = [
    "Plan",
    "Step",
    "apply_axis",
    "axis_collective",
    "backend_of",
    "broadcast_from_first",
    "gather_whole",
    "global_to_global",
    "local_to_global",
    "plan_boxing",
    "run_plan",
    "transition_cost",
]
