"""Boxing: change a global tensor's layout (nd-SBP, placement, device type).

``plan_boxing`` makes a :class:`Plan` (data, cached, costed in bytes); ``run_plan``
runs it on a local shard with autograd (each step's backward is its dual transition).
See :mod:`sbpflow.boxing.plan` for the transition table.
"""

from .plan import Plan, Step, axis_collective, plan_boxing, transition_cost
from .steps import apply_axis, backend_of, broadcast_from_first, run_plan

__all__ = [
    "Plan",
    "Step",
    "apply_axis",
    "axis_collective",
    "backend_of",
    "broadcast_from_first",
    "plan_boxing",
    "run_plan",
    "transition_cost",
]
