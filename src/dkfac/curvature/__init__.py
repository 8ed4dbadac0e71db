"""Math of one layer on one worker: factor statistics, decompositions, preconditioning.

Nothing in this package talks to other processes; everything is testable in float64.
"""

from dkfac.curvature.block_types import BlockRegistration, make_block, register_block
from dkfac.curvature.blocks import (
    FactorStatistic,
    KroneckerBlock,
    LinearBlock,
    UnsupportedLayerError,
)
from dkfac.curvature.conv_blocks import Conv2dBlock
from dkfac.curvature.decomposition import FactorRequest, decompose_factors
from dkfac.curvature.embedding import EmbeddingBlock
from dkfac.curvature.factor_decomposition import (
    CholeskyFactor,
    CholeskyRootFactor,
    DiagonalEigenFactor,
    DiagonalInverseFactor,
    EigenFactor,
    FactorDecomposition,
    decompose_factor,
)
from dkfac.curvature.factor_side import DiagonalSide
from dkfac.curvature.inverse import (
    CholeskyInverse,
    EigenInverse,
    KroneckerInverse,
    TikhonovInverse,
    combine_factors,
    decompose,
)
from dkfac.curvature.kl_clip import kl_clip_scale
from dkfac.curvature.kronecker_factor import KroneckerFactor
from dkfac.curvature.layer import LayerCurvature
from dkfac.curvature.tikhonov import tikhonov_shifts, trace_mean

__all__ = [
    "BlockRegistration",
    "CholeskyFactor",
    "CholeskyInverse",
    "CholeskyRootFactor",
    "Conv2dBlock",
    "DiagonalEigenFactor",
    "DiagonalInverseFactor",
    "DiagonalSide",
    "EigenFactor",
    "EigenInverse",
    "EmbeddingBlock",
    "FactorDecomposition",
    "FactorRequest",
    "FactorStatistic",
    "KroneckerBlock",
    "KroneckerFactor",
    "KroneckerInverse",
    "LayerCurvature",
    "LinearBlock",
    "TikhonovInverse",
    "UnsupportedLayerError",
    "combine_factors",
    "decompose",
    "decompose_factor",
    "decompose_factors",
    "kl_clip_scale",
    "make_block",
    "register_block",
    "tikhonov_shifts",
    "trace_mean",
]
