"""Reference models: CIFAR ResNets, small networks and Transformers for tests and demos."""

from dkfac.models.autoencoder import DeepAutoencoder, sparse_init_
from dkfac.models.registry import MODEL_NAMES, build_model
from dkfac.models.resnet import BasicBlock, CifarResNet, resnet20, resnet32, resnet56
from dkfac.models.small import MLP, SmallCNN
from dkfac.models.transformer import TransformerClassifier, TransformerLM

__all__ = [
    "MLP",
    "MODEL_NAMES",
    "BasicBlock",
    "CifarResNet",
    "DeepAutoencoder",
    "SmallCNN",
    "TransformerClassifier",
    "TransformerLM",
    "build_model",
    "resnet20",
    "resnet32",
    "resnet56",
    "sparse_init_",
]
