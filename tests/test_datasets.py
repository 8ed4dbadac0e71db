"""Tests of the named-dataset registry in ``dkfac.data.registry``."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from dkfac.data.registry import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    DATASET_NAMES,
    DatasetSpec,
    default_cifar10_root,
    load_dataset,
)

BATCH = 10  # images per fake CIFAR-10 batch file


def _write_batch(
    path: Path, seed: int, n: int = BATCH, overrides: dict[object, object] | None = None
) -> None:
    rng = np.random.default_rng(seed)
    content: dict[object, object] = {
        b"batch_label": b"fake batch",
        b"labels": [int(v) for v in rng.integers(0, 10, size=n)],
        b"data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
        b"filenames": [f"img{i}.png".encode() for i in range(n)],
    }
    content.update(overrides or {})
    with path.open("wb") as handle:
        pickle.dump(content, handle)


def _fake_cifar(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for index in range(1, 6):
        _write_batch(root / f"data_batch_{index}", seed=index)
    _write_batch(root / "test_batch", seed=99)
    return root


def test_dataset_names() -> None:
    assert set(DATASET_NAMES) == {"digits", "synthetic", "cifar10", "npz", "tokens", "pysource"}


def test_unknown_dataset_and_option() -> None:
    with pytest.raises(ValueError, match="expected one of digits, synthetic, cifar10, npz"):
        load_dataset("imagenet")
    with pytest.raises(ValueError, match=r"bogus.*accepted:"):
        load_dataset("synthetic", bogus=1)


def test_digits_spec() -> None:
    spec = load_dataset("digits", seed=1)
    assert (spec.input_shape, spec.num_classes, spec.kind) == ((1, 8, 8), 10, "image")
    assert len(spec.train) + len(spec.test) == 1797
    x, y = spec.train[0]
    assert x.shape == (1, 8, 8) and y.dtype == torch.long


# -- cifar10 ------------------------------------------------------------------------------


def test_cifar10_reader_shapes_labels_and_normalisation(tmp_path: Path) -> None:
    root = _fake_cifar(tmp_path / "cifar-10-batches-py")
    spec = load_dataset("cifar10", root=str(root))
    assert (spec.input_shape, spec.num_classes, spec.kind) == ((3, 32, 32), 10, "image")
    train_x, train_y = spec.train.tensors  # type: ignore[attr-defined]
    test_x, test_y = spec.test.tensors  # type: ignore[attr-defined]
    assert train_x.shape == (5 * BATCH, 3, 32, 32) and test_x.shape == (BATCH, 3, 32, 32)
    assert train_x.dtype == torch.float32 and train_y.dtype == torch.int64

    with (root / "data_batch_2").open("rb") as handle:
        raw = pickle.load(handle)
    assert train_y[BATCH : 2 * BATCH].tolist() == raw[b"labels"]
    # Row-major RGB planes: the first 1024 values are the red plane of image 0.
    pixels = torch.from_numpy(raw[b"data"][3].astype(np.float32)).view(3, 32, 32) / 255.0
    mean = torch.tensor(CIFAR10_MEAN).view(3, 1, 1)
    std = torch.tensor(CIFAR10_STD).view(3, 1, 1)
    torch.testing.assert_close(train_x[BATCH + 3], (pixels - mean) / std)

    # The parent folder works too.
    nested = load_dataset("cifar10", root=tmp_path)
    assert torch.equal(nested.test.tensors[1], test_y)  # type: ignore[attr-defined]


def test_cifar10_missing_folder_names_path_and_instructions(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError) as info:
        load_dataset("cifar10", root=missing)
    message = str(info.value)
    assert str(missing) in message
    assert "cifar-10-python.tar.gz" in message and "--data-root" in message
    assert str(missing / "data_batch_1") in message


def test_cifar10_missing_file(tmp_path: Path) -> None:
    root = _fake_cifar(tmp_path / "c")
    (root / "data_batch_4").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_4"):
        load_dataset("cifar10", root=root)


def test_cifar10_default_root_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DKFAC_DATA", str(tmp_path))
    assert default_cifar10_root() == tmp_path
    _fake_cifar(tmp_path / "cifar-10-batches-py")
    assert len(load_dataset("cifar10").test) == BATCH
    monkeypatch.delenv("DKFAC_DATA")
    assert default_cifar10_root().name == "cifar-10-batches-py"


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({b"data": np.zeros((BATCH, 100), dtype=np.uint8)}, "3072 uint8"),
        ({b"labels": [0, 1]}, "labels"),
        ({b"labels": [12] * BATCH}, r"labels must be in \[0, 10\)"),
    ],
)
def test_cifar10_malformed_batch(
    tmp_path: Path, overrides: dict[object, object], match: str
) -> None:
    root = _fake_cifar(tmp_path / "c")
    _write_batch(root / "data_batch_3", seed=3, overrides=overrides)
    with pytest.raises(ValueError, match=match) as info:
        load_dataset("cifar10", root=root)
    assert "data_batch_3" in str(info.value)


def test_cifar10_rejects_non_dict_garbage_and_foreign_globals(tmp_path: Path) -> None:
    root = _fake_cifar(tmp_path / "c")
    with (root / "test_batch").open("wb") as handle:
        pickle.dump([1, 2, 3], handle)
    with pytest.raises(ValueError, match=r"test_batch.*expected a dict"):
        load_dataset("cifar10", root=root)
    (root / "test_batch").write_bytes(b"not a pickle at all")
    with pytest.raises(ValueError, match="test_batch"):
        load_dataset("cifar10", root=root)
    with (root / "test_batch").open("wb") as handle:
        pickle.dump({b"data": nn.Linear(1, 1)}, handle)  # needs torch globals: refused
    with pytest.raises(ValueError, match=r"test_batch.*not allowed"):
        load_dataset("cifar10", root=root)


# -- npz ----------------------------------------------------------------------------------


def test_npz_with_test_arrays(tmp_path: Path) -> None:
    path = tmp_path / "data.npz"
    rng = np.random.default_rng(0)
    np.savez(
        path,
        x=rng.normal(size=(20, 5)),
        y=np.arange(20) % 3,
        x_test=rng.normal(size=(6, 5)),
        y_test=np.array([0, 1, 2, 3, 0, 1]),
    )
    spec = load_dataset("npz", root=path)
    assert (spec.input_shape, spec.num_classes, spec.kind) == ((5,), 4, "vector")
    x, y = spec.train.tensors  # type: ignore[attr-defined]
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    assert len(spec.train) == 20 and len(spec.test) == 6
    assert load_dataset("npz", root=path, num_classes=7).num_classes == 7
    with pytest.raises(ValueError, match="num_classes"):
        load_dataset("npz", root=path, num_classes=2)


def test_npz_seeded_split_and_images(tmp_path: Path) -> None:
    path = tmp_path / "images.npz"
    x = np.arange(50 * 4 * 4, dtype=np.int32).reshape(50, 4, 4)
    np.savez(path, x=x, y=np.arange(50) % 5)
    first = load_dataset("npz", root=path, seed=3)
    again = load_dataset("npz", root=path, seed=3)
    other = load_dataset("npz", root=path, seed=4)
    assert (first.input_shape, first.kind, first.num_classes) == ((1, 4, 4), "image", 5)
    assert len(first.train) == 40 and len(first.test) == 10
    assert torch.equal(first.test.tensors[0], again.test.tensors[0])  # type: ignore[attr-defined]
    assert not torch.equal(first.test.tensors[0], other.test.tensors[0])  # type: ignore[attr-defined]
    train_ids = set(first.train.tensors[0][:, 0, 0, 0].tolist())  # type: ignore[attr-defined]
    test_ids = set(first.test.tensors[0][:, 0, 0, 0].tolist())  # type: ignore[attr-defined]
    assert len(train_ids | test_ids) == 50 and not train_ids & test_ids


def test_npz_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs root"):
        load_dataset("npz")
    with pytest.raises(FileNotFoundError, match=r"missing\.npz"):
        load_dataset("npz", root=tmp_path / "missing.npz")
    bad_keys = tmp_path / "bad_keys.npz"
    np.savez(bad_keys, inputs=np.zeros((4, 2)), y=np.zeros(4, dtype=int))
    with pytest.raises(ValueError, match=r"missing array.*x.*found inputs, y"):
        load_dataset("npz", root=bad_keys)
    half_test = tmp_path / "half_test.npz"
    np.savez(half_test, x=np.zeros((4, 2)), y=np.zeros(4, dtype=int), x_test=np.zeros((2, 2)))
    with pytest.raises(ValueError, match="together"):
        load_dataset("npz", root=half_test)
    mismatch = tmp_path / "mismatch.npz"
    np.savez(mismatch, x=np.zeros((4, 2)), y=np.zeros(5, dtype=int))
    with pytest.raises(ValueError, match=r"y must have shape \(4,\)"):
        load_dataset("npz", root=mismatch)
    test_shape = tmp_path / "test_shape.npz"
    np.savez(
        test_shape,
        x=np.zeros((4, 2)),
        y=np.zeros(4, dtype=int),
        x_test=np.zeros((2, 3)),
        y_test=np.zeros(2, dtype=int),
    )
    with pytest.raises(ValueError, match="x_test samples have shape"):
        load_dataset("npz", root=test_shape)
    fractional = tmp_path / "fractional.npz"
    np.savez(fractional, x=np.zeros((4, 2)), y=np.array([0.0, 0.5, 1.0, 1.0]))
    with pytest.raises(ValueError, match="integer class labels"):
        load_dataset("npz", root=fractional)


# -- synthetic and tokens -----------------------------------------------------------------


def _fit_loss(spec: DatasetSpec, model: nn.Module, steps: int, lr: float) -> tuple[float, float]:
    x, y = spec.train.tensors  # type: ignore[attr-defined]
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses[0], losses[-1]


def test_synthetic_is_deterministic_and_labels_are_learnable() -> None:
    options = {"shape": (3, 8, 8), "num_classes": 4, "train_size": 1024, "test_size": 128}
    spec = load_dataset("synthetic", seed=5, **options)
    again = load_dataset("synthetic", seed=5, **options)
    other = load_dataset("synthetic", seed=6, **options)
    assert (spec.input_shape, spec.num_classes, spec.kind) == ((3, 8, 8), 4, "image")
    for a, b in zip(spec.train.tensors, again.train.tensors, strict=True):  # type: ignore[attr-defined]
        assert torch.equal(a, b)
    assert not torch.equal(spec.train.tensors[0], other.train.tensors[0])  # type: ignore[attr-defined]
    labels = spec.train.tensors[1]  # type: ignore[attr-defined]
    assert set(labels.tolist()) == set(range(4))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 4))
    first, last = _fit_loss(spec, model, steps=30, lr=0.05)
    assert last < 0.5 * first
    # The rule is shared between the splits: the fitted model generalizes.
    test_x, test_y = spec.test.tensors  # type: ignore[attr-defined]
    accuracy = (model(test_x).argmax(1) == test_y).float().mean()
    assert float(accuracy) > 0.5


def test_synthetic_defaults_and_bad_shape() -> None:
    spec = load_dataset("synthetic")
    assert spec.input_shape == (3, 32, 32) and spec.num_classes == 10
    assert len(spec.train) == 1024 and len(spec.test) == 256
    with pytest.raises(ValueError, match="shape"):
        load_dataset("synthetic", shape=(3, 0, 4))
    with pytest.raises(ValueError, match="train_size"):
        load_dataset("synthetic", train_size=0)


def test_tokens_dataset_rule_and_determinism() -> None:
    spec = load_dataset(
        "tokens", seed=2, vocab_size=20, seq_len=12, num_classes=5, train_size=64, key_position=3
    )
    assert (spec.input_shape, spec.num_classes, spec.kind, spec.vocab_size) == (
        (12,),
        5,
        "tokens",
        20,
    )
    tokens, labels = spec.train.tensors  # type: ignore[attr-defined]
    assert tokens.dtype == torch.long and tokens.shape == (64, 12)
    assert int(tokens.min()) >= 0 and int(tokens.max()) < 20
    assert torch.equal(labels, tokens[:, 3] % 5)
    again = load_dataset(
        "tokens", seed=2, vocab_size=20, seq_len=12, num_classes=5, train_size=64, key_position=3
    )
    assert torch.equal(tokens, again.train.tensors[0])  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="key_position"):
        load_dataset("tokens", seq_len=4, key_position=4)
    with pytest.raises(ValueError, match="vocab_size"):
        load_dataset("tokens", vocab_size=3, num_classes=8)


def test_dataset_spec_validates_kind() -> None:
    data = load_dataset("synthetic", train_size=2, test_size=2, shape=(4,), num_classes=2)
    assert data.kind == "vector"
    with pytest.raises(ValueError, match="kind"):
        DatasetSpec("x", data.train, data.test, (4,), 2, "audio")
    with pytest.raises(ValueError, match="vocab_size"):
        DatasetSpec("x", data.train, data.test, (4,), 2, "tokens")
