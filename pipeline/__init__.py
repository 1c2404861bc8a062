"""Pipeline parallelism: schedules as data, their simulation, p2p and a small executor.

Names are imported lazily (PEP 562): the pure schedule/simulation modules never pull in
``torch.distributed``.
"""
from tpfuse._lazy import lazy_exports

_EXPORTS = {
    "Action": "schedules", "build_schedule": "schedules",
    "build_no_pipelining_schedule": "schedules", "bubble_fraction_formula": "schedules",
    "build_zb_h1_schedule": "zero_bubble",
    "rank_plan": "plan", "RankPlan": "plan", "SCHEDULE_KINDS": "plan",
    "simulate": "simulate", "SimulationResult": "simulate",
    "get_forward_backward_func": "executor", "schedule_for": "executor",
    "forward_backward_no_pipelining": "executor",
    "forward_backward_pipelining_without_interleaving": "executor",
    "forward_backward_pipelining_with_interleaving": "executor",
    "forward_backward_pipelining_zb_h1": "executor",
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS, globals())
