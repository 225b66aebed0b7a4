"""Dynamic-batching settings chosen by measurement on a real Triton server (`trm tune-batching`).

``candidates``: the settings and the execution-time profile that prunes them; ``prober``: applying a
candidate through the load API and measuring it with the load generator; ``search``: the method and the
choice; ``report``: markdown, JSON and a plot; ``core``: the operations the command calls.
"""

from repo_manager.ops.tuning.candidates import Candidate, Profile
from repo_manager.ops.tuning.core import CheckResult, TuneRequest, TuneResult, check_batching, tune_batching

__all__ = ["Candidate", "CheckResult", "Profile", "TuneRequest", "TuneResult", "check_batching", "tune_batching"]
