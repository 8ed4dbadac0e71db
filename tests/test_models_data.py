"""Fast checks of the reference models, the datasets and the demo's helpers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dkfac.cli.demo import DigitsRun, first_epoch_reaching, format_table, run_digits
from dkfac.data.builtin import load_digits_tensors, synthetic_images
from dkfac.models import MLP, CifarResNet, SmallCNN, resnet20, resnet32, resnet56


def _num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("factory", "depth"), [(resnet20, 20), (resnet32, 32), (resnet56, 56)])
def test_resnet_output_shape_and_depth(factory, depth) -> None:
    torch.manual_seed(0)
    model = factory(num_classes=7)
    assert model.depth == depth
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)
    convs_and_fc = [
        m
        for name, m in model.named_modules()
        if isinstance(m, (nn.Conv2d, nn.Linear)) and "shortcut" not in name
    ]
    assert len(convs_and_fc) == depth


def test_resnet20_parameter_count() -> None:
    assert 0.26e6 < _num_params(resnet20()) < 0.28e6


def test_resnet_convs_have_no_bias_and_projection_shortcuts() -> None:
    model = resnet20()
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert all(conv.bias is None for conv in convs)
    projections = [m for m in convs if m.kernel_size == (1, 1)]
    assert len(projections) == 2  # entering stage 2 and stage 3


@pytest.mark.parametrize("depth", [0, 7, 19, 21, -4])
def test_resnet_rejects_invalid_depth(depth: int) -> None:
    with pytest.raises(ValueError, match="depth"):
        CifarResNet(depth)


def test_resnet_smallest_valid_depth() -> None:
    assert CifarResNet(8)(torch.randn(1, 3, 32, 32)).shape == (1, 10)


def test_small_cnn_shape_and_no_inplace_relu() -> None:
    model = SmallCNN(in_channels=1, num_classes=10, width=4)
    assert model(torch.randn(5, 1, 8, 8)).shape == (5, 10)
    relus = [m for m in model.modules() if isinstance(m, nn.ReLU)]
    assert relus and not any(relu.inplace for relu in relus)


def test_mlp_shapes() -> None:
    assert MLP(64, [32, 16], 10)(torch.randn(3, 1, 8, 8)).shape == (3, 10)
    linear_only = MLP(5, [], 2)
    assert linear_only(torch.randn(4, 5)).shape == (4, 2)
    assert sum(isinstance(m, nn.Linear) for m in linear_only.modules()) == 1
    with pytest.raises(ValueError):
        MLP(5, [0], 2)


def test_digits_split_sizes_and_standardization() -> None:
    train, test = load_digits_tensors(test_fraction=0.25, seed=0)
    train_x, train_y = train.tensors
    test_x, test_y = test.tensors
    assert len(train) + len(test) == 1797
    assert len(test) == pytest.approx(0.25 * 1797, abs=1)
    assert train_x.shape[1:] == (1, 8, 8) and test_x.shape[1:] == (1, 8, 8)
    assert train_x.dtype == torch.float32 and train_y.dtype == torch.long
    assert float(train_x.mean()) == pytest.approx(0.0, abs=1e-5)
    assert float(train_x.std()) == pytest.approx(1.0, abs=1e-4)
    # The test split is standardized with the train statistics, so only roughly.
    assert abs(float(test_x.mean())) < 0.1
    # Stratified: every class is present in both splits.
    assert set(train_y.tolist()) == set(range(10)) == set(test_y.tolist())


def test_digits_split_is_deterministic() -> None:
    first_train, first_test = load_digits_tensors(seed=3)
    second_train, second_test = load_digits_tensors(seed=3)
    for a, b in zip(
        (*first_train.tensors, *first_test.tensors),
        (*second_train.tensors, *second_test.tensors),
        strict=True,
    ):
        assert torch.equal(a, b)
    other_train, _ = load_digits_tensors(seed=4)
    assert not torch.equal(first_train.tensors[1], other_train.tensors[1])


def test_digits_dtype_and_invalid_fraction() -> None:
    train, _ = load_digits_tensors(dtype=torch.float64)
    assert train.tensors[0].dtype == torch.float64
    with pytest.raises(ValueError):
        load_digits_tensors(test_fraction=1.0)


def test_synthetic_images() -> None:
    data = synthetic_images(6, shape=(3, 4, 4), num_classes=3, seed=1)
    images, labels = data.tensors
    assert images.shape == (6, 3, 4, 4) and labels.shape == (6,)
    assert int(labels.min()) >= 0 and int(labels.max()) < 3
    again = synthetic_images(6, shape=(3, 4, 4), num_classes=3, seed=1)
    assert torch.equal(images, again.tensors[0])


def test_first_epoch_reaching_and_table() -> None:
    assert first_epoch_reaching([0.5, 0.96, 0.97], 0.95) == 2
    assert first_epoch_reaching([0.5], 0.95) is None
    table = format_table([DigitsRun("SGD", [0.5, 0.96], 1.0), DigitsRun("K", [0.97], 2.0)])
    assert "epoch 2" in table and "epoch 1" in table


def test_sgd_run_is_reproducible_and_learns() -> None:
    data = load_digits_tensors()
    first = run_digits(False, epochs=2, seed=0, data=data)
    second = run_digits(False, epochs=2, seed=0, data=data)
    assert first.accuracies == second.accuracies
    assert first.accuracies[-1] > 0.5
