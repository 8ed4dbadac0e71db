"""Reference models: CIFAR ResNets and small networks for tests and demos."""

from dkfac.models.resnet import BasicBlock, CifarResNet, resnet20, resnet32, resnet56
from dkfac.models.small import MLP, SmallCNN

__all__ = [
    "MLP",
    "BasicBlock",
    "CifarResNet",
    "SmallCNN",
    "resnet20",
    "resnet32",
    "resnet56",
]
