"""The WarmPool kind (pure): pre-warmed, model-agnostic engine pods (DeepServe §6.1)."""

from matrixserve.domain.warmpool.plan import Plan, plan
from matrixserve.domain.warmpool.view import PoolView, starved

__all__ = ["Plan", "PoolView", "plan", "starved"]
