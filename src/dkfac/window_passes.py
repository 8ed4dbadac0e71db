"""The micro-batches of a factor window, and the ones each layer sat out.

Under gradient accumulation every micro-batch's loss is divided by ``accumulation_steps``, so a
layer's output gradients are divided by the examples of the whole window, including micro-
batches it did not run in (a branch taken in some, a task's head, a dropped layer). ``G`` of a
mean loss is scaled by the examples its gradients are divided by
(:meth:`~dkfac.curvature.statistics.FactorStatistics.sat_out`); counting only the micro-batches
the layer ran in would make it ``(seen/all)²`` times too small.

Only with ``accumulation_steps`` > 1 given, the promise that every micro-batch's loss is
divided by their number; attached to an optimizer without it, backward calls may be separate
losses, each its own mean, and nothing is changed. A micro-batch is one backward call: the
forward passes it reaches belong to one loss (a dual encoder calling the model once per tower, a
recomputed checkpoint segment), backward calls that reach one pass are one micro-batch
(``torch.autograd.grad`` for a gradient penalty, two losses of one forward), and a pass that no
backward call reaches (an evaluation pass, features for a log) divides nothing. Each pass is
bound to the backward calls that reach it by the layers' output-gradient hooks and by hooks on
the model's outputs (tensors made by autograd, :mod:`dkfac.nested_tensors`), so a worker that
captures only some layers (DP-KFAC's owners) sees every micro-batch of its own when the model
returns what the loss is made from. Where no backward call is known for a pass with statistics
(a compiled model's hooks run inside its graph), each of the model's passes with statistics is
taken as a micro-batch only when there are ``accumulation_steps`` of them; otherwise nothing is
changed. Several forward passes under one backward call are one micro-batch even when each is
a task's micro-batch summed into one loss: a head that ran in some of them is then like a layer
run on part of a batch (not corrected).

A micro-batch the layer sat out counts the examples it would have had there: the model's batch
(the first tensor among its arguments, summed over the micro-batch's passes) times the layer's
examples per model example in the micro-batches it ran in (1 for most layers, ``T`` for a head
on flattened ``(N·T, d)`` rows). When that is not a whole number (a routed expert's share of
the tokens) or a batch is not known, the layer's mean examples per micro-batch stands in, exact
for equal micro-batches, and the
layer is named in a warning.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import torch
from torch import Tensor

from dkfac.autograd_engine import LayerGradients, PassAccumulators, current_backward_id
from dkfac.curvature.layer import LayerCurvature
from dkfac.nested_tensors import nested_tensors

#: Output tensors of one forward pass watched for the backward call that reaches them.
WATCHED_OUTPUTS = 16


class WindowPasses:
    """The forward passes of the current factor window, their batches and backward calls.

    Args:
        gradients: tells a backward call that computes some layer's gradient from one that
            does not (a gradient penalty's ``torch.autograd.grad``): only a group of calls with
            one of the first is a micro-batch.
    """

    def __init__(self, gradients: LayerGradients) -> None:
        self._gradients = gradients
        self._rows: dict[int, int | None] = {}  # the model's passes: their batch (None: unknown)
        self._backward: dict[int, int] = {}  # any pass: the first backward call reaching it
        # Backward calls that reached a pass another had reached (``torch.autograd.grad`` for
        # a gradient penalty, two losses of one forward): one micro-batch, as a forest.
        self._merged: dict[int, int] = {}
        # Backward calls that compute some layer's gradient. The others only join a group
        # (a penalty's call through a loss's pass) or make none (an adversarial example's
        # input gradient); a reentrant checkpoint's outer call joins its inner ones.
        self._computing: set[int] = set()
        # Pass numbers restart every window: an output kept from an earlier window and
        # backpropagated now must not bind this window's pass of the same number.
        self._window = 0

    def started(self, pass_id: int, rows: int | None) -> None:
        """The model's forward pass ``pass_id`` started on ``rows`` examples (None: unknown)."""
        self._rows[pass_id] = rows

    def reached(
        self,
        pass_id: int,
        backward: int | None = None,
        window: int | None = None,
        *,
        computing: bool,
    ) -> None:
        """A backward call (``backward``, else the one running) reached pass ``pass_id``.

        ``window``: the window the pass was watched in (a hook of an earlier one is stale).
        ``computing``: the call computes some layer's gradient.
        """
        if window not in (None, self._window):
            return
        if backward is None:
            backward = current_backward_id()
        if backward is None:
            return
        if computing:
            self._computing.add(backward)
        first = self._backward.setdefault(pass_id, backward)
        if first != backward:
            first, backward = self._root(first), self._root(backward)
            if first != backward:
                self._merged[backward] = first

    def watch_outputs(self, pass_id: int, output: Any) -> None:
        """Bind pass ``pass_id`` to the backward call that reaches any tensor of ``output``."""
        if torch.compiler.is_compiling():  # hooks traced into a graph run in no backward call
            return
        window = self._window
        # The accumulators of the pass's layer calls answer for its outputs, and live as long.
        accumulators = self._gradients.take(pass_id)
        watched: set[int] = set()  # ids: one hook per tensor however often it is reached
        # Breadth first: the outermost tensors (a loss, logits) before nested ones.
        for tensor in nested_tensors(output, depth_first=False):
            # Not a leaf: a returned parameter would keep a hook per pass for good.
            if tensor.grad_fn is not None and id(tensor) not in watched:
                hook = functools.partial(self._output_reached, pass_id, window, accumulators)
                tensor.register_hook(hook)  # type: ignore[no-untyped-call]
                watched.add(id(tensor))
                if len(watched) == WATCHED_OUTPUTS:
                    break

    def _output_reached(
        self, pass_id: int, window: int, accumulators: PassAccumulators | None, grad: Tensor
    ) -> None:
        if window == self._window:  # a stale hook asks the engine nothing
            computing = self._gradients.any_computed(pass_id, accumulators)
            self.reached(pass_id, computing=computing)

    def clear(self) -> None:
        """Forget the window, and let go of the accumulators held for it."""
        self._gradients.forget()
        self._rows.clear()
        self._backward.clear()
        self._merged.clear()
        self._computing.clear()
        self._window += 1

    def _root(self, backward: int) -> int:
        """The backward call standing for all those merged with ``backward``."""
        while backward in self._merged:
            backward = self._merged[backward]
        return backward

    def count_sat_out(
        self, layers: Sequence[LayerCurvature], accumulation_steps: int | None
    ) -> tuple[int | None, list[str]]:
        """Tell each layer's ``G`` statistics of the window's micro-batches it sat out.

        Only with ``accumulation_steps`` > 1 given: the promise that every micro-batch's loss
        is divided by their number. Without it (attached to an optimizer), backward calls may
        be separate losses, each its own mean (a labelled and an unlabelled batch), whose
        ``G`` the examples of the other would make wrong. Call once per window, after every
        statistic of the window was added.

        Returns:
            The window's micro-batches (None: not known or not asked), and the layers whose
            examples in a micro-batch they sat out were estimated (their mean per
            micro-batch), to be warned about.
        """
        if accumulation_steps is None:
            return None, []
        if len(self._rows) < 2:  # one forward pass of the model (the usual case)
            return (1 if self._computing else None), []
        seen = [layer.factors["g"].statistics.scaled_passes() for layer in layers]
        groups = self._groups(seen, accumulation_steps)
        if groups is None or len(groups) < 2 or accumulation_steps < 2:
            return (None if groups is None else len(groups)), []
        group_of = {p: key for key, passes in groups.items() for p in passes}
        estimated = []
        for layer, passes in zip(layers, seen, strict=True):
            if len(passes) == len(group_of) or any(p not in group_of for p in passes):
                continue  # in every pass, no gradient, or a pass no micro-batch holds
            ran: dict[int, int] = {}
            for pass_id, examples in passes.items():
                ran[group_of[pass_id]] = ran.get(group_of[pass_id], 0) + examples
            missing = groups.keys() - ran.keys()
            if not ran or not missing:
                continue
            counts = self._would_have_seen(ran, missing, groups)
            if counts is None:
                mean = round(sum(ran.values()) / len(ran))
                counts = dict.fromkeys(missing, mean)
                estimated.append(layer.name)
            statistics = layer.factors["g"].statistics
            for key in sorted(missing):
                # Any pass of the micro-batch names it: the layer has none of them.
                statistics.sat_out(min(groups[key]), counts[key])
        return len(groups), estimated

    def _groups(
        self, seen: Sequence[Mapping[int, int]], accumulation_steps: int
    ) -> dict[int, set[int]] | None:
        """The window's micro-batches: their passes, by a key; None when they are not known.

        The passes of each backward call (merged where two reached one pass), when every pass
        with statistics has one; else the model's passes with statistics, each alone, if
        there are ``accumulation_steps`` of them.
        """
        with_statistics = {p for passes in seen for p in passes}
        if all(p in self._backward for p in with_statistics):
            # Every backward call counts, also one that reached none of these layers (their
            # owner's micro-batches under DP-KFAC): the model's outputs were watched.
            computing = {self._root(backward) for backward in self._computing}
            groups: dict[int, set[int]] = {}
            for pass_id, backward in self._backward.items():
                if (root := self._root(backward)) in computing:
                    groups.setdefault(root, set()).add(pass_id)
            return groups
        model_passes = with_statistics & self._rows.keys()
        if len(model_passes) != accumulation_steps:
            return None
        return {p: {p} for p in model_passes}

    def _would_have_seen(
        self, ran: Mapping[int, int], missing: set[int], groups: Mapping[int, set[int]]
    ) -> dict[int, int] | None:
        """Per micro-batch in ``missing``, the examples the layer would have seen in it.

        That is the model's batch there times the layer's examples per model example in the
        micro-batches it ran in (``ran``: its examples per micro-batch); ``None`` if a batch is
        not known or a count is not a whole number.
        """
        batches = {key: self._batch(groups[key]) for key in {*ran, *missing}}
        known = {key: batch for key, batch in batches.items() if batch is not None}
        if len(known) < len(batches):
            return None
        total = sum(known[key] for key in ran)
        if total == 0:
            return None
        per_example = Fraction(sum(ran.values()), total)
        counts = {key: per_example * known[key] for key in missing}
        if any(count.denominator != 1 for count in counts.values()):
            return None
        return {key: int(count) for key, count in counts.items()}

    def _batch(self, passes: set[int]) -> int | None:
        """A micro-batch's examples: its model passes' batches summed (None: not known).

        Summed as a layer run in every pass counts them (examples count once per pass); the
        ratio to what the layer counted where it ran is what matters.
        """
        batches = [self._rows.get(p) for p in passes if p in self._rows]
        if not batches or any(batch is None for batch in batches):
            return None
        return sum(batch for batch in batches if batch is not None)
