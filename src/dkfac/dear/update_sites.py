"""Before which modules' forward each parameter's deferred update must be applied.

DeAR applies a parameter's update in the forward pre-hook of the modules that hold it. Some
modules use a child's parameter without calling the child (``nn.MultiheadAttention`` applies
``out_proj.weight`` itself; fused fast paths; ``nn.ParameterList``): those parameters are
found after the first forward/backward and also get the nearest ancestor whose forward ran.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from torch import nn

logger = logging.getLogger(__name__)


class UpdateSites:
    """The modules before whose forward each parameter must be up to date.

    Args:
        model: the root module.
        params: the parameters that get deferred updates.
    """

    def __init__(self, model: nn.Module, params: Sequence[nn.Parameter]) -> None:
        self._model = model
        self._params = list(params)
        self._sites: dict[int, list[nn.Module]] = {id(p): [] for p in self._params}
        for module in model.modules():
            for param in module.parameters(recurse=False):
                if id(param) in self._sites:
                    self._sites[id(param)].append(module)
        self._parent: dict[int, nn.Module] = {
            id(child): module for module in model.modules() for child in module.children()
        }
        self._fired: set[int] | None = set()  # modules whose forward ran, until learned

    @property
    def learning(self) -> bool:
        """Whether forward passes are still being watched (until :meth:`learn` succeeds)."""
        return self._fired is not None

    def saw_forward(self, module: nn.Module) -> None:
        """``module``'s forward is about to run (called from its pre-hook)."""
        if self._fired is not None:
            self._fired.add(id(module))

    def modules_of(self, param: nn.Parameter) -> list[nn.Module]:
        """The modules before whose forward ``param`` must be up to date."""
        return self._sites[id(param)]

    def learn(self) -> bool:
        """After a forward and backward: add ancestors for parameters used outside their module.

        A parameter with a gradient whose holding modules never ran their forward is used by
        an ancestor directly: its update is also due before the nearest ancestor that ran.
        Returns whether any site was added. With no forward seen yet, watches the next one.
        """
        fired, self._fired = self._fired, None
        if not fired:
            self._fired = fired
            return False
        learned = []
        for param in self._params:
            sites = self._sites[id(param)]
            if param.grad is None or any(id(m) in fired for m in sites):
                continue
            ancestor = sites[0] if sites else self._model
            while ancestor is not self._model and id(ancestor) not in fired:
                ancestor = self._parent.get(id(ancestor), self._model)
            sites.append(ancestor)
            learned.append(type(ancestor).__name__)
        if learned:
            logger.info(
                "DeAR: %d parameter(s) used outside their module's forward are updated before "
                "their ancestor runs (%s)",
                len(learned),
                ", ".join(sorted(set(learned))),
            )
        return bool(learned)
