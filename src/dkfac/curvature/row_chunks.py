"""Sums over many rows cut into chunks, so that a GPU forms their products in parallel.

A statistic's product ``Xᵀ Y`` over ``R`` rows of few columns is a small result summed over
many rows. A GPU's matrix product gives each tile of its result (about 128 x 128 values) to
one thread block, which sums over every row itself: a batched product of a few ``64 x 64``
results over 400k rows keeps a few of the GPU's streaming multiprocessors busy (an H200 has
132). The shifted products of ResNet-50's 56x56 patch Grams at batch 128 (three inputs, 13
products of ``64 x 64`` each, over 430,592 rows: 137.6 GFLOP) took 115.1 ms in float32 on an
H200, 1.2 TFLOP/s, while im2col's products of the same inputs (799 GFLOP, results ``576 x
576``) took 22.6 ms, 35 TFLOP/s (docs/benchmarks.md, "The fifth GPU session"). Cutting the
rows into ``k`` chunks makes ``k`` times as many results, formed in one batched product,
then summed: the same sums in another order (each entry's round-off bound is unchanged).
"""

from __future__ import annotations

import math

import torch

#: The side of the result tile one thread block of a GPU's matrix product forms (cuBLAS and
#: CUTLASS kernels use 64 to 256; 128 is the common size for float32 and bfloat16).
RESULT_TILE = 128
#: Result tiles one batched product should give a GPU: about four per multiprocessor of an
#: H100 or H200 (132), so that the last wave of thread blocks is not left to a few.
TARGET_TILES = 512
#: Rows a chunk keeps at least: a thread block's sum over fewer is dominated by loading its
#: tile and writing its partial result (the partial results are ``chunks`` times the result).
MIN_CHUNK_ROWS = 2048


def row_chunks(rows: int, columns: int, products: int, device: torch.device) -> int:
    """How many chunks to cut the rows of ``products`` products into, on ``device``.

    Each product is ``(columns x rows) @ (rows x columns)``; one batched product forms them
    all, each cut into the chunks.
    On a CPU, 1: its matrix products already share long sums among its threads. On this
    project's 2 cores (ResNet-50's groups of shifted products at batch 8,
    ``benchmarks/results/patch_grams_chunks_resnet50_cpu_{1,2}thread.json``), 4 chunks took
    1.03-1.07 of one chunk's time on one thread (a distributed run's worker has one) and
    0.92-0.99 on two.
    On a GPU, enough chunks that the batch holds :data:`TARGET_TILES` result tiles, each of
    at least :data:`MIN_CHUNK_ROWS` rows (so 1 where the results alone fill the GPU).

    Not yet timed on a GPU as a way of its own (its figures above are of the unsplit
    products); ``benchmarks/patch_grams.py`` times it beside them.
    """
    if device.type == "cpu" or rows <= 0 or columns <= 0 or products <= 0:
        return 1
    tiles = products * math.ceil(columns / RESULT_TILE) ** 2
    wanted = math.ceil(TARGET_TILES / tiles)
    return max(1, min(wanted, rows // MIN_CHUNK_ROWS))
