"""A plain step replayed as a CUDA graph (``plain_step_graphs``) against the eager step.

Oracle: the same model trained with ``plain_step_graphs=False`` (whose preconditioning the
float64 tests check): every gradient equal bit for bit after every step. On the CPU the graph
is emulated by replaying the operators recorded at capture on the tensors they read and wrote
(:class:`RecordedReplay`): a step replayed with a value fixed at capture that has changed
since (the learning rate, ``κ``, the damping, an inverse) or with stale inputs would differ.
The ``cuda`` tests replay real CUDA graphs, and count the host's waits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

import dkfac
import dkfac.preconditioner
from devices import CUDA_TEST_DEVICE, needs_cuda
from dkfac.bench.cuda_syncs import cuda_syncs
from dkfac.curvature.blocks import LinearBlock
from dkfac.curvature.factor_decomposition import INVERSE_METHODS
from dkfac.plain_step import CudaGraphs
from test_layer_blocks import cuda_copy_launches


class RecordedReplay(TorchDispatchMode):
    """A CUDA graph's semantics on the CPU: the operators of the capture, replayed on the
    same tensors.

    Capture runs ``compute`` once, recording every operator with the tensors it read and
    wrote. Replay runs the recorded operators again: an in-place one as recorded, another
    into the tensor it first returned; views are not rerun (they alias what is rewritten).
    So a replay reads what a graph would: the captured tensors' current contents, the numbers
    fixed at capture. A host read inside the capture is refused, as a graph refuses it.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.released = False
        self._recording: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any]] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError("a host read inside a captured step")
        result = func(*args, **kwargs)
        self._recording.append((func, args, kwargs, result))
        return result

    def release(self) -> None:
        self.released = True

    def capture(
        self, compute: Callable[[], list[Tensor]], device: torch.device
    ) -> tuple[list[Tensor], Any]:
        assert device == self.device
        self._recording = []
        with self:
            outputs = compute()
        recording = list(self._recording)

        def replay() -> None:
            for func, args, kwargs, result in recording:
                if func.is_view:
                    continue
                if func._schema.is_mutable:
                    func(*args, **kwargs)
                    continue
                again = func(*args, **kwargs)
                if isinstance(result, Tensor):
                    result.copy_(again)
                else:
                    for old, new in zip(result, again, strict=True):
                        old.copy_(new)

        return outputs, replay


class Net(nn.Module):
    """Two equal convolutions (stacked together), a branch used on some steps, biases."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.a = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.b = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.branch = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3, bias=False)

    def forward(self, x: Tensor, branch: bool = True) -> Tensor:
        h = torch.tanh(self.stem(x))
        h = torch.tanh(self.b(torch.tanh(self.a(h)))).mean(dim=(2, 3))
        return self.head(h + torch.tanh(self.branch(h)) if branch else h)


def train(
    device: torch.device,
    graphs: bool,
    steps: int,
    branch: Callable[[int], bool] = lambda step: True,
    **options: Any,
) -> tuple[list[list[Tensor]], dkfac.KFACPreconditioner]:
    """Every parameter's gradient after each ``step()``, and the preconditioner."""
    model = Net().to(device)
    pre = dkfac.KFACPreconditioner(model, plain_step_graphs=graphs, **options)
    generator = torch.Generator().manual_seed(1)
    seen = []
    for step in range(steps):
        x = torch.randn(6, 3, 5, 5, generator=generator).to(device)
        y = torch.randint(0, 3, (6,), generator=generator).to(device)
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x, branch(step)), y).backward()
        pre.step()
        seen.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    return seen, pre


SCHEDULE = {
    "factor_update_steps": 2,
    "inv_update_steps": 4,
    "lr": lambda step: 0.1 / (1 + step),  # a new η every step: read at replay, not captured
    "kl_clip": 1e-4,  # small: ν < 1, so the clip changes every gradient
}


def assert_equal_runs(eager: list[list[Tensor]], replayed: list[list[Tensor]]) -> None:
    assert len(eager) == len(replayed)
    for step, (want, got) in enumerate(zip(eager, replayed, strict=True)):
        assert len(want) == len(got), step
        for a, b in zip(want, got, strict=True):
            assert torch.equal(a, b), f"step {step}"


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("method", INVERSE_METHODS)
def test_replayed_plain_steps_equal_eager_ones_bit_for_bit(
    method: str, batched: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decompositions at 0, 4 and 8: each makes new inverses, so that step runs eagerly, the
    next captures and the others replay; the damping changes every 6 steps (eigen reads it:
    a change runs eagerly too)."""
    monkeypatch.setattr(dkfac.preconditioner, "CudaGraphs", RecordedReplay)
    cpu = torch.device("cpu")
    options = dict(SCHEDULE, inverse_method=method, batched_preconditioning=batched)
    options["damping"] = lambda step: 0.01 if step < 6 else 0.02
    eager, _ = train(cpu, False, 12, **options)
    replayed, pre = train(cpu, True, 12, **options)
    assert_equal_runs(eager, replayed)
    plain = pre._plain
    if method != "eigen":  # captured at 1, 5, 9 (the damping was fixed when decomposed)
        assert (plain.captures, plain.replays) == (3, 9)
    else:  # and at 7 (the damping changed at 6): replays at 1-3, 5, 7, 9-11
        assert (plain.captures, plain.replays) == (4, 8)


def test_a_layer_without_a_gradient_runs_that_step_eagerly_and_recaptures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(dkfac.preconditioner, "CudaGraphs", RecordedReplay)
    cpu = torch.device("cpu")
    options = dict(SCHEDULE, inv_update_steps=12)

    def branch(step: int) -> bool:
        return step not in (3, 4)

    eager, _ = train(cpu, False, 8, branch, **options)
    replayed, pre = train(cpu, True, 8, branch, **options)
    assert_equal_runs(eager, replayed)
    # 0 eager (decomposition), 1 capture, 2 replay, 3 eager (no branch), 4 capture, 5 eager
    # (the branch is back), 6 capture, 7 replay.
    assert (pre._plain.captures, pre._plain.replays) == (3, 5)


class Conv1D(nn.Module):
    """transformers' ``Conv1D`` stand-in: ``y = x W (+ b)``, ``W`` stored ``(in, out)``."""

    def __init__(self, nf: int, nx: int, bias: bool) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.3)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        out = x @ self.weight
        return out if self.bias is None else out + self.bias


class _OwnMatrix(LinearBlock):
    """A user's block with a gradient matrix of its own making (not ``matrix_of``'s)."""

    def grad_matrix(self) -> Tensor:
        return super().grad_matrix() * 1.0


class _UsersLinear(nn.Linear):
    pass


class TokenNet(nn.Module):
    """An embedding, weights stored transposed with and without a bias, a user's layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(7, 4)
        self.up = Conv1D(6, 4, bias=True)
        self.down = Conv1D(4, 6, bias=False)
        self.users = _UsersLinear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, tokens: Tensor) -> Tensor:
        h = torch.tanh(self.down(torch.tanh(self.up(self.embed(tokens))))).mean(dim=1)
        return self.head(torch.tanh(self.users(h)))


def train_tokens(graphs: bool, steps: int, **options: Any) -> tuple[list[list[Tensor]], Any]:
    model = TokenNet()
    pre = dkfac.KFACPreconditioner(model, plain_step_graphs=graphs, **SCHEDULE, **options)
    generator = torch.Generator().manual_seed(3)
    seen = []
    for _ in range(steps):
        tokens = torch.randint(0, 7, (5, 6), generator=generator)
        y = torch.randint(0, 3, (5,), generator=generator)
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(tokens), y).backward()
        pre.step()
        seen.append([p.grad.clone() for p in model.parameters()])
    return seen, pre


def test_transposed_weights_and_embeddings_replay_and_a_users_own_matrix_stays_eager(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A graph reads the parameters' gradients and makes their matrices itself
    (``matrix_of``), so a block that makes its matrix its own way is never captured."""
    monkeypatch.setattr(dkfac.preconditioner, "CudaGraphs", RecordedReplay)
    eager, _ = train_tokens(False, 8)
    replayed, pre = train_tokens(True, 8)
    assert_equal_runs(eager, replayed)
    kinds = {layer.name: type(layer.block).__name__ for layer in pre.layers}
    assert kinds == {
        "embed": "EmbeddingBlock",
        "up": "TransposedLinearBlock",
        "down": "TransposedLinearBlock",
        "users": "LinearBlock",
        "head": "LinearBlock",
    }
    assert (pre._plain.captures, pre._plain.replays) == (2, 6)  # 0, 4: eager; 1, 5: captured
    # Its outputs are laid out as the gradients they are copied into (a bias column and
    # transposed weights are copied inside the graph): one fused copy on CUDA.
    captured = pre._plain._captured
    assert captured is not None
    grads = [p.grad for layer in pre.layers for p in layer.block.parameters()]
    assert len(captured.outputs) == len(grads) == 8
    assert cuda_copy_launches(grads, captured.outputs) == 1
    assert cuda_copy_launches(captured.inputs, grads) == 1
    own = {_UsersLinear: _OwnMatrix}
    eager, _ = train_tokens(False, 8, blocks=own)
    replayed, pre = train_tokens(True, 8, blocks=own)
    assert_equal_runs(eager, replayed)
    assert (pre._plain.captures, pre._plain.replays) == (0, 0)


def test_a_graph_refuses_a_parameter_written_twice_as_the_eager_step_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Discovery skips tied parameters; a step handed one layer twice is refused both ways."""
    monkeypatch.setattr(dkfac.preconditioner, "CudaGraphs", RecordedReplay)
    for graphs in (True, False):
        _, pre = train(torch.device("cpu"), graphs, 1, **SCHEDULE)
        head = pre.layers[-1]
        with pytest.raises(ValueError, match="gradient belongs to two blocks"):
            pre._plain.apply([head, head], 0.01, None)


class FailingCapture:
    """A capture that fails, as a graph fails on an operation it cannot hold."""

    def __init__(self, device: torch.device) -> None:
        self.attempts = 0

    def release(self) -> None:
        pass

    def capture(self, compute: Callable[[], list[Tensor]], device: torch.device) -> Any:
        self.attempts += 1
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_runs_eagerly_until_what_it_read_changes(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The same gradients; one attempt per decomposition interval, not one per step."""
    made: list[FailingCapture] = []

    def failing(device: torch.device) -> FailingCapture:
        made.append(FailingCapture(device))
        return made[-1]

    monkeypatch.setattr(dkfac.preconditioner, "CudaGraphs", failing)
    cpu = torch.device("cpu")
    eager, _ = train(cpu, False, 12, **SCHEDULE)
    with caplog.at_level("WARNING", logger="dkfac.plain_step"):
        replayed, pre = train(cpu, True, 12, **SCHEDULE)
    assert_equal_runs(eager, replayed)
    assert made[0].attempts == 3  # after the decompositions at 0, 4 and 8
    assert (pre._plain.captures, pre._plain.replays) == (0, 0)
    assert sum("plain step not captured" in r.getMessage() for r in caplog.records) == 3


def test_a_replayed_step_is_timed_and_remove_releases_the_graph(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(dkfac.preconditioner, "CudaGraphs", RecordedReplay)
    _, pre = train(torch.device("cpu"), True, 3, **SCHEDULE)
    assert pre._plain.replays == 2  # steps 1 (captured) and 2
    record = pre._recorder.last()
    assert record is not None and record.step == 2
    assert record.seconds.get("precondition", 0.0) > 0.0  # the replay, in its phase
    assert pre._plain._captured is not None
    pre.remove()
    assert pre._plain._captured is None
    assert pre._plain._graphs.released  # type: ignore[union-attr]


def test_a_step_that_shares_gradients_is_never_captured(monkeypatch: pytest.MonkeyPatch) -> None:
    """A strategy whose preconditioning sends gradients (KAISA's shares) runs every step
    eagerly: a collective inside a replayed graph would run without the other workers."""
    monkeypatch.setattr(dkfac.preconditioner, "CudaGraphs", RecordedReplay)
    eager, _ = train(torch.device("cpu"), False, 6, **SCHEDULE)
    model = Net()
    pre = dkfac.KFACPreconditioner(model, plain_step_graphs=True, **SCHEDULE)
    monkeypatch.setattr(pre._strategy, "precondition_is_local", lambda layers: False)
    generator = torch.Generator().manual_seed(1)
    for step in range(6):
        x, y = (
            torch.randn(6, 3, 5, 5, generator=generator),
            torch.randint(0, 3, (6,), generator=generator),
        )
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        pre.step()
        got = [p.grad for p in model.parameters() if p.grad is not None]
        assert all(torch.equal(a, b) for a, b in zip(eager[step], got, strict=True)), step
    assert (pre._plain.captures, pre._plain.replays) == (0, 0)
    assert pre._plain._graphs.released  # type: ignore[union-attr]  # nothing kept for it


def test_graphs_are_refused_off_a_cuda_device_and_must_be_a_bool() -> None:
    with pytest.raises(
        ValueError, match="plain_step_graphs=True is not allowed with the model on cpu"
    ):
        dkfac.KFACPreconditioner(Net(), plain_step_graphs=True)
    with pytest.raises(ValueError, match="plain_step_graphs='yes' is not allowed"):
        dkfac.KFACPreconditioner(Net(), plain_step_graphs="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        CudaGraphs(torch.device("cpu"))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("method", INVERSE_METHODS)
def test_cuda_graphs_replay_the_eager_steps_without_host_waits(method: str) -> None:
    device = CUDA_TEST_DEVICE
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a CUDA device (the rehearsal runs on the CPU)")
    options = dict(SCHEDULE, inverse_method=method)
    eager, _ = train(device, False, 12, **options)
    replayed, pre = train(device, True, 12, **options)
    for step, (want, got) in enumerate(zip(eager, replayed, strict=True)):
        for a, b in zip(want, got, strict=True):
            # cuBLAS may pick another kernel inside a capture, cuDNN's weight gradients are
            # not deterministic: float32 roundings, relative to the gradient's scale.
            scale = float(a.abs().max())
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5 * scale, msg=f"step {step}")
    assert (pre._plain.captures, pre._plain.replays) == (3, 9)
    # A replayed step's K-FAC part waits for nothing.
    model = Net().to(device)
    pre = dkfac.KFACPreconditioner(model, plain_step_graphs=True, **options)
    x = torch.randn(6, 3, 5, 5, device=device)
    y = torch.randint(0, 3, (6,), device=device)
    waits = []
    for _ in range(4):
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        waits.append(cuda_syncs(pre.step))
    assert pre._plain.replays == 3
    assert waits[2] == waits[3] == [], waits


def distributed_graphs(rank: int, world_size: int, fraction: float) -> dict[str, Any]:
    """Each rank's gradients after each step, eager and replayed, under KAISA with
    ``grad_worker_fraction=fraction`` (DDP-averaged gradients of each rank's half)."""
    dkfac.preconditioner.CudaGraphs = RecordedReplay  # type: ignore[misc,assignment]
    out: dict[str, Any] = {}
    for graphs in (False, True):
        model = Net()
        ddp = nn.parallel.DistributedDataParallel(model)
        options = dict(SCHEDULE, strategy="kaisa", grad_worker_fraction=fraction)
        pre = dkfac.KFACPreconditioner(ddp, plain_step_graphs=graphs, **options)
        generator = torch.Generator().manual_seed(1)
        seen = []
        for _ in range(8):
            x = torch.randn(2 * world_size, 3, 5, 5, generator=generator)[2 * rank : 2 * rank + 2]
            y = torch.randint(0, 3, (2 * world_size,), generator=generator)[2 * rank : 2 * rank + 2]
            ddp.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(x), y).backward()
            pre.step()
            seen.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        out[str(graphs)] = seen
        out[f"captures_{graphs}"] = pre._plain.captures
        pre.remove()
    return out


def test_distributed_replays_equal_eager_steps_and_shares_stay_eager() -> None:
    """Two workers. KAISA with every worker preconditioning every layer sends no gradient: its
    plain steps replay; with one worker per layer the directions are broadcast: eager."""
    from distributed_harness import run_workers

    for fraction, replays in ((1.0, True), (0.5, False)):
        results = run_workers(distributed_graphs, 2, args=(fraction,), timeout=120)
        for rank, result in enumerate(results):
            assert_equal_runs(result["False"], result["True"])
            assert (result["captures_True"] > 0) == replays, (fraction, rank)
