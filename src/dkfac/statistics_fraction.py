"""Which of a layer call's examples feed its statistics (``statistics_fraction``), checked.

The first ``kept`` examples along dim 0 of each call
(:func:`~dkfac.curvature.statistics.kept_examples`): the output must hold the examples along
dim 0 as the input does, and a layer whose dim 0 is not the model's batch (a sequence-first
layer) is named once, since its first rows are then the first positions of every sequence.
"""

from __future__ import annotations

import warnings

from torch import Tensor

from dkfac.curvature.layer import LayerCurvature
from dkfac.curvature.statistics import kept_examples


class StatisticsFraction:
    """The share of each call's examples whose statistics are taken.

    Args:
        fraction: that share, in ``(0, 1]``.
    """

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        self._warned: set[str] = set()  # layers warned about sequence-first statistics

    def of_call(
        self, layer: LayerCurvature, x: Tensor, output: Tensor, batch: int | None
    ) -> tuple[int, int]:
        """The call's examples and how many of them (the first) feed its statistics.

        Args:
            layer: the layer called.
            x: its input.
            output: its output.
            batch: the model's batch in this pass (None: not known).

        Raises:
            RuntimeError: part of a call is to be kept, but its output does not hold the
                examples along dim 0 as its input does.
        """
        examples = layer.block.examples(x)
        kept = kept_examples(examples, self.fraction)
        if kept == examples:
            return examples, kept
        if output.dim() == 0 or output.shape[0] != examples:
            raise RuntimeError(
                f"statistics_fraction={self.fraction} needs layer {layer.name!r} to keep its "
                f"examples along dim 0 (input {tuple(x.shape)}, output {tuple(output.shape)})"
            )
        if batch is not None and examples != batch and layer.name not in self._warned:
            self._warned.add(layer.name)
            warnings.warn(
                f"statistics_fraction={self.fraction}: layer {layer.name!r} holds {examples} "
                f"along dim 0 where the model's batch has {batch} examples; its factors come "
                f"from its first {kept} along dim 0 (a sequence-first layer: the first positions "
                "of every sequence, not a random part of the batch)",
                stacklevel=3,
            )
        return examples, kept
