"""The ExpertPool kind (pure): MoE experts as a service (EaaS; xDeepServe §4.5)."""

from matrixserve.domain.expertpool.expertmap import ExpertMap
from matrixserve.domain.expertpool.plan import Plan, plan
from matrixserve.domain.expertpool.view import PoolView

__all__ = ["ExpertMap", "Plan", "PoolView", "plan"]
