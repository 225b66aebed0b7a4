"""Promotion between environments: gates on real data, a compare-and-swap move, an append-only history.

See ``core`` for the steps, ``gates`` for what each gate measures and ``latency`` for the latency gate.
"""

from repo_manager.promote.core import (
    HistoryView,
    PromotionPlan,
    PromotionRequest,
    PromotionResult,
    execute_promotion,
    plan_promotion,
    promote,
    read_history,
)
from repo_manager.promote.envs import GATES, ModelSpec, env_store, model_specs, parse_gates
from repo_manager.promote.history import HistoryRecord

__all__ = ["GATES", "HistoryRecord", "HistoryView", "ModelSpec", "PromotionPlan", "PromotionRequest", "PromotionResult",
           "env_store", "execute_promotion", "model_specs", "parse_gates", "plan_promotion", "promote",
           "read_history"]
