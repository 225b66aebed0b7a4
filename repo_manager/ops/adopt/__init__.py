"""`trm adopt`: an existing Triton model repository becomes trm versions (plan first, then execute).

``plan_adoption`` reads the repository and decides, writing nothing; ``execute_adoption`` verifies what the
embedded server can run and adds manifests (in place) or copies versions into a target repository.
"""

from repo_manager.ops.adopt.execute import AdoptedVersion, AdoptResult, execute_adoption
from repo_manager.ops.adopt.plan import AdoptPlan, ModelPlan, VersionPlan, plan_adoption

__all__ = ["AdoptPlan", "AdoptResult", "AdoptedVersion", "ModelPlan", "VersionPlan", "execute_adoption",
           "plan_adoption"]
