"""K-FAC's step run by an optimizer's own ``step()``: a step pre-hook on the optimizer.

Frameworks that own the training loop (a Hugging Face ``Trainer``, Lightning, accelerate) and
``GradScaler.step(optimizer)`` all end an iteration with ``optimizer.step()``; a pre-hook
there preconditions the gradients first, wherever that call comes from (after the step's
closure, when it is given one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle


class OptimizerHook:
    """Runs ``run_step`` before every ``optimizer.step()``; reads the optimizer's learning rate.

    Args:
        optimizer: the optimizer that steps the model.
        parameters: the preconditioned parameters (at least one must be in ``optimizer``).
        run_step: K-FAC's step.

    Raises:
        ValueError: ``optimizer`` is not a ``torch.optim.Optimizer``, or holds none of
            ``parameters``.
    """

    def __init__(
        self,
        optimizer: Any,
        parameters: Sequence[Tensor],
        run_step: Callable[[], None],
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                f"optimizer={optimizer!r} is not allowed: expected a torch.optim.Optimizer"
            )
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(
                "optimizer=LBFGS is not allowed: it evaluates its closure several times per "
                "step (a line search), and K-FAC preconditions one gradient per step"
            )
        held = {id(p) for p in parameters}
        groups = [
            index
            for index, group in enumerate(optimizer.param_groups)
            if any(id(p) in held for p in group["params"])
        ]
        if not groups:
            raise ValueError(
                f"optimizer={type(optimizer).__name__} is not allowed: it holds none of the "
                "preconditioned layers' parameters (build it from model.parameters())"
            )
        self.optimizer = optimizer
        #: The parameter group whose learning rate KL clipping uses (the first layer's).
        self.group = groups[0]
        self.running = False
        self._run_step = run_step
        self._handle: RemovableHandle | None = optimizer.register_step_pre_hook(self._before)

    def _before(
        self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """K-FAC now, or, when the step gets a closure, right after the closure has run.

        Lightning (automatic optimization) and others call ``optimizer.step(closure)``: the
        closure computes the gradients inside the step, so K-FAC must follow it, not precede
        it; the hook hands the optimizer a closure that runs both.
        """
        # ``args`` are the step's positional arguments with the optimizer first.
        closure = kwargs["closure"] if "closure" in kwargs else (args[1] if len(args) > 1 else None)
        if closure is None:
            self._run()
            return None

        def closure_then_kfac() -> Any:
            loss = closure()
            self._run()
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_kfac}
        return (args[0], closure_then_kfac, *args[2:]), kwargs

    def _run(self) -> None:
        self.running = True
        try:
            self._run_step()
        finally:
            self.running = False

    def lr(self, step: int) -> float:
        """The learning rate of :attr:`group` now (``step`` unused: a schedule's callable)."""
        return float(self.optimizer.param_groups[self.group]["lr"])

    def remove(self) -> None:
        """Detach the hook: ``optimizer.step()`` no longer runs K-FAC."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
