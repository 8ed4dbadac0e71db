"""dkfac: distributed K-FAC for PyTorch.

``dkfac.KFACPreconditioner`` is the one object a training loop needs::

    pre = dkfac.KFACPreconditioner(model, lr=0.1)
    loss.backward(); pre.step(); optimizer.step()

``dkfac.DeAR`` replaces DDP + ``optimizer.step()`` with decoupled, overlapped gradient
aggregation (reduce-scatter under backward, all-gather under the next forward).
"""

from dkfac.adaptive import AdaptiveOptions, AdaptiveReport
from dkfac.auto import AutoOptions
from dkfac.autograd_engine import ReturnedGradientsWarning, SeparateBackwardCallsWarning
from dkfac.config import KFACConfig
from dkfac.curvature.block_types import BlockRegistration, register_block
from dkfac.curvature.layer import LayerHealth
from dkfac.dear.averaging import DeAR
from dkfac.health import Health
from dkfac.layer_table import SkippedModule
from dkfac.preconditioner import KFACPreconditioner
from dkfac.recipes import fast_to_target
from dkfac.strategies.plan_report import PlanReport
from dkfac.update_intervals import IntervalBudget

__version__ = "0.1.0"

__all__ = [
    "AdaptiveOptions",
    "AdaptiveReport",
    "AutoOptions",
    "BlockRegistration",
    "DeAR",
    "Health",
    "IntervalBudget",
    "KFACConfig",
    "KFACPreconditioner",
    "LayerHealth",
    "PlanReport",
    "ReturnedGradientsWarning",
    "SeparateBackwardCallsWarning",
    "SkippedModule",
    "__version__",
    "fast_to_target",
    "register_block",
]
