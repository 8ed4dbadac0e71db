"""The one door to ``torch.distributed``.

The communicator, fusion plans, the cost model of the cluster, and the per-step recorder of
traffic and phase times.
"""

from dkfac.comm.communicator import Communicator
from dkfac.comm.cost_model import ClusterCostModel, CostModelCache
from dkfac.comm.groups import require_distributed
from dkfac.comm.recorder import StepRecorder
from dkfac.comm.shutdown import destroy_process_groups

__all__ = [
    "ClusterCostModel",
    "Communicator",
    "CostModelCache",
    "StepRecorder",
    "destroy_process_groups",
    "require_distributed",
]
