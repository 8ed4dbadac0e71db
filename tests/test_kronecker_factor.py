"""One factor as an object: its running average and validity, and each method's tensor layout.

Oracles: the running average's closed form and dense float64 linear algebra.
"""

from __future__ import annotations

import math

import pytest
import torch

import dkfac
from devices import CUDA_TEST_DEVICE, on_cuda
from dkfac.curvature import running_average
from dkfac.curvature.blocks import FactorStatistic
from dkfac.curvature.decomposition import _host_values
from dkfac.curvature.factor_decomposition import (
    INVERSE_METHODS,
    CholeskyFactor,
    DiagonalEigenFactor,
    DiagonalInverseFactor,
    EigenFactor,
    check_inverses_finite,
    decompose_factor,
    factor_decomposition,
    factor_tensor_shapes,
)
from dkfac.curvature.factor_side import FACTOR_SIDES, DiagonalSide
from dkfac.curvature.inverse import combine_factors
from dkfac.curvature.kronecker_factor import KroneckerFactor, fold_counted, fold_sums
from dkfac.curvature.running_average import divided
from dkfac.curvature.statistics import FactorStatistics
from dkfac.curvature.tikhonov import (
    shift_table,
    tikhonov_shift,
    tikhonov_shifts,
    trace_mean,
    trace_means,
)


def spd(d: int, seed: int) -> torch.Tensor:
    m = torch.randn(d, d + 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return m @ m.t() / (d + 3)


def test_a_factor_folds_batches_drops_nonfinite_ones_and_counts_them() -> None:
    factor = KroneckerFactor("g", 4, torch.float64)
    assert factor.running is None and factor.take_nonfinite_count() is None
    first, second = spd(4, 0), spd(4, 1)
    factor.fold(first, 0.9)
    assert torch.equal(factor.value(), first)  # the first estimate is the batch itself
    bad = second.clone()
    bad[0, 1] = float("nan")
    factor.fold(bad, 0.9)
    assert torch.equal(factor.value(), first)  # a NaN batch is not folded in
    factor.fold(second, 0.9)
    torch.testing.assert_close(factor.value(), 0.9 * first + 0.1 * second, rtol=0, atol=1e-15)
    assert int(factor.take_nonfinite_count()) == 1  # type: ignore[arg-type]
    assert factor.take_nonfinite_count() is None  # taken
    assert bool(factor.finite())
    assert float(factor.trace_mean(torch.float64)) == pytest.approx(
        float(torch.diagonal(factor.value()).mean())
    )
    assert torch.equal(factor.zeros(torch.device("cpu")), torch.zeros(4, 4, dtype=torch.float64))


def test_dropped_batches_are_counted_over_many_folds_until_read() -> None:
    # 150 folds between two reads (more than the flags kept before they are summed), every
    # third batch with an Inf, some folded alone and some with others (fold_sums, stacked): the
    # count read is the number of dropped batches, exactly; then it starts again from zero.
    factor, other = KroneckerFactor("a", 3, torch.float64), KroneckerFactor("a", 3, torch.float64)
    dropped = 0
    for step in range(150):
        batch = spd(3, step)
        if step % 3 == 1:
            batch[2, 2] = float("inf")
            dropped += 1
        if step % 2:
            factor.fold(batch, 0.9)
        else:
            ones = torch.ones(2, dtype=torch.float64)
            fold_sums([factor, other], [batch, spd(3, 1000 + step)], ones, 0.9, stack_bytes=1 << 20)
    count = factor.take_nonfinite_count()
    assert count is not None and count.dtype == torch.int64 and int(count) == dropped == 50
    assert int(other.take_nonfinite_count()) == 0  # type: ignore[arg-type]
    factor.fold(spd(3, 7), 0.9)
    assert int(factor.take_nonfinite_count()) == 0  # type: ignore[arg-type]


def test_counted_folds_take_their_factors_in_the_stacks_order_on_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Factors of interleaved sizes (3, 4, 3, 5, 4, 3), one count 0, one batch with a NaN, two
    # idle factors: fold_counted hands them to the stacked fold in its order, so nothing is
    # gathered on the device (no per-factor views), and each folds exactly as alone (oracle:
    # KroneckerFactor.fold of its divided sum, one at a time, bit for bit).
    gathers: list[list[int]] = []
    real = running_average._gathered

    def watched(values: torch.Tensor, indices: list[int]) -> torch.Tensor:
        gathers.append(list(indices))
        return real(values, indices)

    monkeypatch.setattr(running_average, "_gathered", watched)
    sizes, counts = [3, 4, 3, 5, 4, 3], [2.0, 3.0, 0.0, 1.0, 5.0, 4.0]
    folded = [KroneckerFactor("a", d, torch.float64) for d in sizes]
    alone = [KroneckerFactor("a", d, torch.float64) for d in sizes]
    idle = [KroneckerFactor("g", d, torch.float64) for d in (4, 3)]
    for number, factor in enumerate([*folded, *alone, *idle]):
        factor.fold(spd(factor.dim, 100 + number % len(sizes)), 0.9)
    idle_before = [factor.value().clone() for factor in idle]
    totals = [spd(d, number) * (number + 1) for number, d in enumerate(sizes)]
    totals[4][1, 2] = float("nan")
    fold_counted(folded, totals, counts, 0.8, stack_bytes=1 << 20, idle=idle)
    for factor, total, count in zip(alone, totals, counts, strict=True):
        if count > 0:
            factor.fold(divided(total, torch.tensor(count, dtype=torch.float64)), 0.8)
    assert all(torch.equal(g.value(), w.value()) for g, w in zip(folded, alone, strict=True))

    def dropped(factors: list[KroneckerFactor]) -> list[int]:
        return [int(f.take_nonfinite_count()) for f in factors]  # type: ignore[arg-type]

    assert dropped(folded) == dropped(alone) == [0, 0, 0, 0, 1, 0]
    assert all(torch.equal(f.value(), b) for f, b in zip(idle, idle_before, strict=True))
    assert gathers and all(order == list(range(len(order))) for order in gathers)


def empty_batch_model(kind: str) -> tuple[torch.nn.Module, tuple[int, ...]]:
    """A small model of Linear layers, or of convolutions (3x3, 1x1, strided), and its input."""
    torch.manual_seed(0)
    nn = torch.nn
    if kind == "linear":
        return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3), nn.Tanh()).double(), (4,)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(3, 3, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(3, 3, 1),
        nn.Tanh(),
        nn.Conv2d(3, 2, 3, stride=2, padding=1),
        nn.Flatten(),
        nn.Linear(18, 2),
    )
    return model.double(), (2, 5, 5)


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched"])
@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_an_empty_batch_leaves_every_factor_as_it_was_and_drops_nothing(
    kind: str, batched: bool
) -> None:
    # A window of zero rows and examples has no estimate: each factor keeps its average (bit
    # for bit), nothing counts as a dropped non-finite batch (before, 0/0 did), and the next
    # batch folds in again. Factors stacked or not, statistics formed together or not (a
    # convolution's empty batch once failed in the shifted products' border gathers).
    model, shape = empty_batch_model(kind)
    pre = dkfac.KFACPreconditioner(
        model,
        factor_dtype=torch.float64,
        factor_update_steps=1,
        inv_update_steps=100,
        factor_decay=0.9,
        batched_factor_updates=batched,
        batched_statistics=batched,
        conv_patches="shifted",  # the border gathers (5x5 outputs take im2col by default)
    )

    def step(rows: int) -> list[torch.Tensor]:
        model.zero_grad()
        x = torch.randn(rows, *shape, dtype=torch.float64)
        (model(x) ** 2).sum().backward()
        pre.step()
        return [layer.factor(side).clone() for layer in pre.layers for side in "ag"]  # type: ignore[union-attr]

    step(5)
    before = step(6)
    assert all(torch.equal(a, b) for a, b in zip(step(0), before, strict=True))
    counts = [layer.factors[side].take_nonfinite_count() for layer in pre.layers for side in "ag"]
    assert all(count is None or int(count) == 0 for count in counts)
    after = step(5)
    assert all(bool(torch.isfinite(factor).all()) for factor in after)
    assert not any(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_a_factor_without_an_average_says_so() -> None:
    with pytest.raises(RuntimeError, match="factor A has no running average"):
        KroneckerFactor("a", 3, torch.float32).value()


def test_each_method_owns_its_layout_and_its_arithmetic() -> None:
    assert factor_tensor_shapes("eigen", "a", 5) == [("qa", (5, 5), False), ("la", (5,), False)]
    assert factor_tensor_shapes("inverse", "g", 3) == [("g_inv", (3, 3), True)]
    matrix = spd(6, 2)
    eigen = decompose_factor(matrix, "g", "eigen", torch.float64)
    assert isinstance(eigen, EigenFactor) and bool(eigen.ok)
    q, values = eigen.tensors["qg"], eigen.tensors["lg"]
    torch.testing.assert_close(q @ torch.diag(values) @ q.t(), matrix, rtol=0, atol=1e-12)
    shift = torch.tensor(0.25, dtype=torch.float64)
    cholesky = decompose_factor(matrix, "a", "inverse", torch.float64, shift)
    assert isinstance(cholesky, CholeskyFactor) and bool(cholesky.ok)
    want = torch.linalg.inv(matrix + 0.25 * torch.eye(6, dtype=torch.float64))
    torch.testing.assert_close(cholesky.tensors["a_inv"], want, rtol=0, atol=1e-12)
    received = factor_decomposition("inverse", "a", cholesky.tensors, cholesky.ok)
    assert isinstance(received, CholeskyFactor) and received.side == "a"
    with pytest.raises(ValueError, match="needs the Tikhonov shift"):
        decompose_factor(matrix, "a", "inverse", torch.float64)


def test_a_diagonal_factor_is_a_vector_with_elementwise_decompositions() -> None:
    # Oracles: the dense decompositions of diag(v), in float64.
    side = DiagonalSide(5)
    assert factor_tensor_shapes("eigen", "a", side) == [("la", (5,), False)]
    assert factor_tensor_shapes("inverse", "a", side) == [("a_inv", (5,), False)]
    factor = KroneckerFactor("a", side, torch.float64)
    assert factor.zeros(torch.device("cpu")).shape == (5,)
    values = torch.tensor([3.0, 0.0, 1.5, 7.0, 0.25], dtype=torch.float64)
    factor.fold(values, 0.9)
    dense = torch.diag(values)
    assert factor.trace_mean(torch.float64) == torch.trace(dense) / 5
    eigen = decompose_factor(values, "a", "eigen", torch.float64)
    assert isinstance(eigen, DiagonalEigenFactor) and bool(eigen.ok)
    assert torch.equal(eigen.tensors["la"], values)  # in the factor's own order
    shift = torch.tensor(0.5, dtype=torch.float64)
    inverse = decompose_factor(values, "a", "inverse", torch.float64, shift)
    assert isinstance(inverse, DiagonalInverseFactor) and bool(inverse.ok)
    want = torch.linalg.inv(dense + 0.5 * torch.eye(5, dtype=torch.float64))
    torch.testing.assert_close(torch.diag(inverse.tensors["a_inv"]), want, rtol=0, atol=1e-15)
    received = factor_decomposition("eigen", "a", eigen.tensors, eigen.ok, diagonal=True)
    assert isinstance(received, DiagonalEigenFactor)
    # A damped entry that is not positive is no inverse.
    bad = decompose_factor(values, "a", "inverse", torch.float64, torch.tensor(-0.25))
    assert not bool(bad.ok)


@pytest.mark.parametrize("method", INVERSE_METHODS)
def test_a_diagonal_a_preconditions_as_the_dense_diagonal_matrix(method: str) -> None:
    # (A ⊗ G + γI)⁻¹ vec(∇) with A = diag(v) dense, against A held as v.
    a = torch.tensor([2.0, 0.0, 0.5, 4.0], dtype=torch.float64)
    g = spd(3, 4)
    grad = torch.randn(3, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    damping = 0.1
    results = []
    for a_factor in (torch.diag(a), a):
        means = (trace_mean(a_factor, torch.float64), trace_mean(g, torch.float64))
        shifts = tikhonov_shifts(*means, damping) if method != "eigen" else (None, None)
        parts = [
            decompose_factor(a_factor, "a", method, torch.float64, shifts[0]),
            decompose_factor(g, "g", method, torch.float64, shifts[1]),
        ]
        inverse = combine_factors(method, *parts)
        results.append(inverse.precondition(grad, damping))
    if method == "eigen":  # the exact damped Kronecker inverse, from its definition
        curvature = torch.kron(torch.diag(a), g) + damping * torch.eye(12, dtype=torch.float64)
        vec = torch.linalg.solve(curvature, grad.t().reshape(-1))  # column-major vec
        torch.testing.assert_close(results[1], vec.reshape(4, 3).t(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(results[1], results[0], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("device", ["cpu", on_cuda(str(CUDA_TEST_DEVICE))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_trace_means_of_many_factors_are_each_factors_own(dtype: torch.dtype, device: str) -> None:
    # Matrices of several sizes (one transposed, not contiguous), a diagonal factor held as
    # a vector and a bf16 factor: the vector of trace means equals each factor's trace_mean
    # bit for bit, and the float64 oracle tr(F)/d to the dtype's round-off.
    gen = torch.Generator().manual_seed(3)
    factors = [torch.randn(d, d, generator=gen, dtype=torch.float64) for d in (1, 5, 33, 300)]
    factors[2] = factors[2].t()
    factors.append(torch.rand(7, generator=gen, dtype=torch.float64) + 0.5)
    factors.append(torch.randn(9, 9, generator=gen, dtype=torch.float64).bfloat16().double())
    stored = [f.to(device, torch.float32) for f in factors[:-1]]
    stored.append(factors[-1].to(device, torch.bfloat16))
    means = trace_means(stored, dtype)
    assert means.dtype == dtype and means.shape == (len(stored),)
    for index, (mean, factor, oracle) in enumerate(zip(means, stored, factors, strict=True)):
        assert torch.equal(mean, trace_mean(factor, dtype)), index
        diagonal = oracle if oracle.dim() == 1 else torch.diagonal(oracle)
        want = diagonal.sum() / oracle.shape[0]
        tolerance = {torch.float32: 1e-6, torch.float64: 1e-7}[dtype]  # stored in float32
        torch.testing.assert_close(mean.double().cpu(), want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("device", ["cpu", on_cuda(str(CUDA_TEST_DEVICE))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_cholesky_inverse_is_stored_row_major_and_exactly_symmetric(
    dtype: torch.dtype, device: str
) -> None:
    # Workers send only the upper triangle of a symmetric tensor and rebuild the rest, so the
    # owner's copy must be exactly symmetric (else owner and receivers precondition with
    # different matrices), and row-major like every received copy. Oracle for the values:
    # the float64 inverse of the damped factor.
    matrix = spd(300, 5).to(device)
    shift = torch.tensor(0.01, dtype=torch.float64, device=device)
    stored = decompose_factor(matrix.to(dtype), "g", "inverse", dtype, shift).tensors["g_inv"]
    assert stored.is_contiguous() and stored.dtype == dtype
    assert torch.equal(stored, stored.mT)
    want = torch.linalg.inv(matrix + 0.01 * torch.eye(300, dtype=torch.float64, device=device))
    tolerance = {torch.float32: 1e-4, torch.float64: 1e-12}[dtype]
    torch.testing.assert_close(stored.double(), want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(
    ("dtype", "device"),
    [
        (torch.float64, "cpu"),
        (torch.float32, "cpu"),
        on_cuda(torch.float64, str(CUDA_TEST_DEVICE)),
        on_cuda(torch.float32, str(CUDA_TEST_DEVICE)),
    ],
)
def test_the_shift_table_is_each_layers_tikhonov_shifts_entry_for_entry(
    dtype: torch.dtype, device: str
) -> None:
    # Oracle: π = sqrt(tr(A)/d_A ÷ tr(G)/d_G) (1 when either mean is not positive), shifts
    # √γ·π and √γ/π, in float64 Python arithmetic (torch divides a number by a tensor
    # through its reciprocal: an ulp apart, so to the dtype's round-off); each layer's own
    # tikhonov_shift to the last bit, in float32 and on a GPU too. 60 rows: the CPU's
    # vectorised loops (16 float32 or 8 float64 values a step) and their scalar tails both run
    # on the table, where each layer's own shift takes the scalar path.
    special = [[2.5, 0.4], [1e-3, 7.0], [0.0, 3.0], [4.0, -1.0], [3.0, 3.0], [7e-5, 2e4]]
    generator = torch.Generator().manual_seed(0)
    spread = torch.exp(8 * torch.rand(48, 2, generator=generator, dtype=torch.float64) - 4)
    means = torch.cat([torch.tensor(special * 2, dtype=torch.float64), spread])
    means = means.to(dtype=dtype, device=device)
    damping = 3e-3
    table = shift_table(means, damping)
    assert table.shape == (60, 2) and table.dtype == dtype and table.device == means.device
    root = math.sqrt(damping)
    relative = {torch.float64: 1e-15, torch.float32: 1e-6}[dtype]
    for row, (mean_a, mean_g) in enumerate(means.tolist()):
        pi = math.sqrt(mean_a / mean_g) if mean_a > 0 and mean_g > 0 else 1.0
        assert table[row].tolist() == pytest.approx([root * pi, root / pi], rel=relative, abs=0)
        for column, side in enumerate(FACTOR_SIDES):
            one = tikhonov_shift(side, means[row, 0], means[row, 1], damping)
            assert torch.equal(table[row, column], one)


def test_host_values_come_back_in_order_whatever_their_dtypes_and_shapes() -> None:
    # Device booleans and counts of several dtypes and shapes read in one synchronisation:
    # each tensor's values land at its own index, flattened (joined per dtype, so the order
    # is rebuilt).
    values = [
        torch.tensor(True),
        torch.tensor(3, dtype=torch.int64),
        torch.tensor([False]),
        torch.tensor([[4, 5], [6, 8]], dtype=torch.int32),
        torch.tensor(7, dtype=torch.int32),
        torch.zeros(0, dtype=torch.int64),
        torch.tensor([0, 2, 9], dtype=torch.int64),
        torch.tensor([True, False]),
    ]
    want = [[1], [3], [0], [4, 5, 6, 8], [7], [], [0, 2, 9], [1, 0]]
    assert _host_values(values) == want
    assert _host_values([]) == []


def test_inverses_checked_together_get_their_own_checks_flags() -> None:
    # Oracle: a factorisation's flag and torch.isfinite of its whole inverse, per factor,
    # whatever the others are (an infinite entry, a failed factorisation, a NaN in float64).
    inf, nan = float("inf"), float("nan")
    cases = [
        (torch.tensor([[1.0, inf], [inf, 2.0]]), True),
        (torch.tensor([[1.0, 0.5], [0.5, 2.0]]), False),
        (torch.tensor([[1.0, 0.5], [0.5, 2.0]]), True),
        (torch.tensor([[nan, 0.0], [0.0, 2.0]], dtype=torch.float64), True),
        (torch.eye(3, dtype=torch.float64), True),
    ]
    made = [CholeskyFactor("a", {"a_inv": m}, torch.tensor(ok)) for m, ok in cases]
    check_inverses_finite(made)
    expected = [ok and bool(torch.isfinite(m).all()) for m, ok in cases]
    assert expected == [False, False, True, False, True]
    assert [bool(d.ok) for d in made] == expected
    # The same flags as each inverse's own check, on real factorisations.
    matrices = [torch.tensor([[2.0, 0.5], [0.5, 1.0]]), torch.tensor([[1.0, 2.0], [2.0, 1.0]])]
    zero = torch.tensor(0.0)
    own = [CholeskyFactor.compute(m, "g", torch.float32, zero) for m in matrices]
    deferred = [
        CholeskyFactor.compute(m, "g", torch.float32, zero, check_finite=False) for m in matrices
    ]
    check_inverses_finite(deferred)
    assert [bool(d.ok) for d in deferred] == [bool(d.ok) for d in own] == [True, False]


def test_an_inverse_that_is_not_finite_is_retried_in_float64(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The factorisation succeeds but the float32 inverse is not finite: the checks made
    # together after the decompositions catch it, and the retry gives float64 inverses.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    pre = dkfac.KFACPreconditioner(
        model, inverse_method="inverse", inv_dtype=torch.float32, kl_clip=None
    )
    real = torch.cholesky_inverse

    def overflowing_in_float32(factor: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # type: ignore[no-untyped-def]
        inverse = real(factor, *args, **kwargs)
        return inverse * torch.inf if inverse.dtype == torch.float32 else inverse

    monkeypatch.setattr(torch, "cholesky_inverse", overflowing_in_float32)
    model(torch.randn(5, 4)).square().sum().backward()
    with pytest.warns(RuntimeWarning, match="recomputed in float64"):
        pre.step()
    for layer in pre.layers:
        assert pre.health().layers[layer.name].retried_in_float64 == 2
        assert all(t.dtype == torch.float64 for t in layer.inverse.tensors().values())
        assert all(bool(torch.isfinite(t).all()) for t in layer.inverse.tensors().values())


def g_statistic(seed: int, examples: int) -> FactorStatistic:
    """A raw ``Σ dy dyᵀ`` of ``examples`` one-row examples."""
    dy = torch.randn(
        examples, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)
    )
    return FactorStatistic(dy.t() @ dy, examples, examples)


def test_a_late_g_after_a_one_example_hand_over_corrects_the_sum_sent() -> None:
    # G of a mean loss is N²·Σ; handed over at N = 1 the sent tensor is the raw sum itself,
    # which a collective then overwrites: the late correction still needs that sum (before,
    # none was kept and late() failed an assertion).
    stats = FactorStatistics("g")
    first, second = g_statistic(0, 1), g_statistic(1, 1)
    s0, s1 = first.total.clone(), second.total.clone()
    stats.add(first, pass_id=1)
    sent = stats.hand_over("mean")
    assert sent.count == 1 and torch.equal(sent.total, s0)
    sent.total.zero_()  # what an in-place collective may do to it
    stats.add(second, pass_id=2)
    late = stats.late("mean")
    assert late is not None and late.count == 1
    window = 4 * (s0 + s1)  # N = 2: N²·(S₀ + S₁)
    torch.testing.assert_close(late.total, window - s0, rtol=0, atol=1e-14)


@pytest.mark.parametrize("handed_over", [False, True])
def test_a_lost_statistics_examples_scale_g_but_do_not_count(handed_over: bool) -> None:
    # Two passes of 4 examples, the second's statistic lost (left out): each gradient of the
    # window's mean loss carries 1/8, so G = 8²·Σ over the 4 examples it has, counted 4 times.
    stats = FactorStatistics("g")
    kept = g_statistic(2, 4)
    stats.add(kept, pass_id=1)
    sent = stats.hand_over("mean") if handed_over else None
    stats.lose(pass_id=2, examples=4)
    stats.lose(pass_id=2, examples=3)  # a pass counts once, by its largest call
    want = 64 * kept.total
    if sent is None:
        summed = stats.summed("mean")
        assert summed.count == 4 and stats.total_scale("mean") == 64
        torch.testing.assert_close(summed.total, want, rtol=1e-15, atol=0)
    else:
        late = stats.late("mean")
        assert late is not None and late.count == 0 and sent.count == 4
        torch.testing.assert_close(sent.total + late.total, want, rtol=1e-15, atol=0)
    assert FactorStatistics("a").total_scale("mean") == 1  # A's sums are never scaled
