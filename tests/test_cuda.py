"""dkfac on a CUDA GPU: numerics against the float64 oracle, host waits, the CLI, two ranks.

Marked ``cuda``: skipped with the reason where torch sees no GPU (``DKFAC_CUDA_TESTS_DEVICE=cpu``
rehearses them on the CPU, except what needs CUDA itself). Oracles: the dense float64 formulas
of ``test_oracle_numerics`` computed on the CPU, and the single-process run on the same device
for the two-rank strategies.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dkfac
from devices import CUDA_TEST_DEVICE, HAS_CUDA, needs_cuda
from distributed_harness import run_workers
from dkfac.bench.cuda_syncs import cuda_syncs
from dkfac.cli.checkpoint import load_checkpoint
from dkfac.cli.main import main
from dkfac.curvature.factor_decomposition import INVERSE_METHODS
from test_oracle_numerics import (
    batch_loss,
    conv_batch,
    eigen_direction,
    grad_matrix,
    inverse_direction,
    kfac_layers,
    oracle_layer_factors,
    small_conv_model,
)

pytestmark = [pytest.mark.cuda, needs_cuda]
DEVICE = CUDA_TEST_DEVICE
real_cuda = pytest.mark.skipif(
    not HAS_CUDA, reason="needs CUDA's own synchronisation detector (a real GPU)"
)


@pytest.mark.parametrize("method", INVERSE_METHODS)
@pytest.mark.parametrize(("dtype", "rtol"), [(torch.float64, 1e-9), (torch.float32, 2e-3)])
def test_a_step_on_the_gpu_equals_the_float64_oracle(
    method: str, dtype: torch.dtype, rtol: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Factors, decompositions and preconditioning on the GPU against dense CPU formulas."""
    # Full float32 products: TF32 convolutions would round activations to 10-bit mantissas
    # (matrix products are full float32 by default: precision "highest").
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    assert torch.get_float32_matmul_precision() == "highest"
    generator = torch.Generator().manual_seed(6)
    model = small_conv_model(bias=True)  # float64, CPU: the oracle's copy
    x, t = conv_batch(4, generator)
    expected = {i: oracle_layer_factors(model, i, x, t) for i in kfac_layers(model)}
    damping = 0.02
    gpu = copy.deepcopy(model).to(DEVICE, dtype)
    pre = dkfac.KFACPreconditioner(
        gpu,
        inverse_method=method,
        damping=damping,
        kl_clip=None,
        factor_dtype=dtype,
        inv_dtype=dtype,
    )
    batch_loss(gpu(x.to(DEVICE, dtype)), t.to(DEVICE)).backward()
    grads = {i: grad_matrix(gpu[i]).cpu().double() for i in expected}
    pre.step()
    direction = eigen_direction if method == "eigen" else inverse_direction
    for i, (a, g) in expected.items():
        want = direction(a, g, grads[i], damping)
        got = grad_matrix(gpu[i]).cpu().double()
        assert got.is_floating_point() and gpu[i].weight.grad.device.type == DEVICE.type
        error = (got - want).norm() / want.norm()
        assert error < rtol, f"{method} {dtype} layer {i}: relative error {float(error):.2e}"


@real_cuda
@pytest.mark.parametrize("method", INVERSE_METHODS)
def test_steps_that_decompose_nothing_never_wait_for_the_gpu(method: str) -> None:
    """CUDA's detector sees no wait on factor-only or plain steps, few on decomposition steps."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 10)
    ).to(DEVICE)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = dkfac.KFACPreconditioner(
        model, inverse_method=method, factor_update_steps=2, inv_update_steps=4, lr=0.1
    )
    x = torch.randn(32, 3, 8, 8, device=DEVICE)
    y = torch.randint(0, 10, (32,), device=DEVICE)
    waits: list[list[str]] = []
    for _ in range(9):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)

        def kfac_part(loss: torch.Tensor = loss) -> None:
            loss.backward()
            pre.step()

        waits.append(cuda_syncs(kfac_part))
        optimizer.step()
    for step in (1, 2, 3, 5, 6, 7):  # step 0 plans the patch Gram of the convolution once
        assert waits[step] == [], (step, waits[step])
    for step in (4, 8):
        # One read of every flag; eigh's own error check waits once per factor (torch).
        limit = 1 + 2 * len(pre.layers) if method == "eigen" else 1
        assert 1 <= len(waits[step]) <= limit, (step, waits[step])


@pytest.mark.parametrize("amp", ["none", "bf16", "fp16"])
def test_the_command_line_trains_on_the_gpu(tmp_path: Path, amp: str) -> None:
    if amp == "fp16" and DEVICE.type != "cuda":
        pytest.skip("fp16 is refused on the CPU (tested in test_cli)")
    out = tmp_path / "run"
    argv = ["train", "--model", "cnn", "--nproc", "1", "--epochs", "1", "--steps-per-epoch"]
    argv += ["12", "--log-every", "1", "--device", DEVICE.type, "--amp", amp, "--out", str(out)]
    assert main(argv) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "event" not in r]
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    (epoch,) = [r for r in records if r.get("event") == "epoch"]
    assert epoch["device"] == str(torch.device(DEVICE.type, 0) if HAS_CUDA else DEVICE)
    saved: dict[str, Any] | None = load_checkpoint(out)
    assert saved is not None
    assert (saved["scaler"] is not None) == (amp == "fp16")
    if amp == "fp16":
        assert saved["scaler"]["scale"] > 0


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need a real GPU")
def test_the_command_line_replays_plain_steps_as_cuda_graphs(tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = ["train", "--model", "cnn", "--nproc", "1", "--epochs", "1", "--steps-per-epoch"]
    argv += ["12", "--log-every", "1", "--device", "cuda", "--plain-step-graphs"]
    argv += ["--out", str(out)]
    assert main(argv) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "event" not in r]
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))


def test_auto_takes_the_gpu_for_one_worker() -> None:
    from dkfac.cli.config import TrainConfig
    from dkfac.cli.device import LocalSlot
    from dkfac.cli.training_setup import run_device

    expected = torch.device("cuda", 0) if HAS_CUDA else torch.device("cpu")
    assert run_device(TrainConfig(), LocalSlot(0, 1)) == expected


def _train_three_steps(
    model: nn.Module, strategy: str, x: torch.Tensor, y: torch.Tensor
) -> list[torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = dkfac.KFACPreconditioner(
        model, strategy=strategy, lr=0.1, factor_dtype=torch.float64, inv_dtype=torch.float64
    )
    for _ in range(3):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        optimizer.step()
    pre.remove()
    return [p.detach().cpu() for p in model.parameters()]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, stride=2), nn.Tanh(), nn.Flatten(), nn.Linear(6 * 3 * 3, 5)
    ).double()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(16, 3, 8, 8, dtype=torch.float64, generator=generator)
    return x, torch.randint(0, 5, (16,), generator=generator)


def _two_ranks_on_one_gpu(rank: int, world: int, strategy: str) -> list[torch.Tensor]:
    model = _model().to(DEVICE)
    ddp = nn.parallel.DistributedDataParallel(model)
    x, y = _batch()
    half = slice(rank * 8, rank * 8 + 8)
    return _train_three_steps(ddp, strategy, x[half].to(DEVICE), y[half].to(DEVICE))


@pytest.mark.parametrize("strategy", ["dkfac", "kaisa", "spd", "pad"])
def test_two_ranks_sharing_one_gpu_equal_one_process(strategy: str) -> None:
    """Two gloo ranks with CUDA tensors on one GPU against the one-process run on it."""
    x, y = _batch()
    alone = _train_three_steps(_model().to(DEVICE), "local", x.to(DEVICE), y.to(DEVICE))
    ranks = run_workers(_two_ranks_on_one_gpu, world_size=2, args=(strategy,), timeout=240)
    for params in ranks:
        for got, want in zip(params, alone, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
