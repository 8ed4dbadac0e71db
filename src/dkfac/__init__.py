"""dkfac: distributed K-FAC for PyTorch.

``dkfac.KFACPreconditioner`` is the one object a training loop needs::

    pre = dkfac.KFACPreconditioner(model, lr=0.1)
    loss.backward(); pre.step(); optimizer.step()
"""

from dkfac.config import KFACConfig
from dkfac.layer_table import SkippedModule
from dkfac.preconditioner import KFACPreconditioner

__version__ = "0.1.0"

__all__ = ["KFACConfig", "KFACPreconditioner", "SkippedModule", "__version__"]
