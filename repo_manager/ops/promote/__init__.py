"""Promotion between environments: gates on real data, a compare-and-swap move, an append-only history.

See ``core`` for the steps, ``gates`` for what each gate measures and ``latency`` for the latency gate; the
environments, gate settings and model specs they read are ``repo_manager.core.environments``.
"""

from repo_manager.ops.promote.core import (
    HistoryView,
    PlannedPromotion,
    PromotionPlan,
    PromotionRequest,
    PromotionResult,
    execute_promotion,
    plan_promotion,
    promote,
    read_history,
)
from repo_manager.ops.promote.history import HistoryRecord

__all__ = ["HistoryRecord", "HistoryView", "PlannedPromotion", "PromotionPlan", "PromotionRequest", "PromotionResult",
           "execute_promotion", "plan_promotion", "promote", "read_history"]
