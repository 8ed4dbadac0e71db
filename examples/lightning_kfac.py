"""K-FAC inside Lightning's automatic optimization: an MLP on scikit-learn's digits.

Lightning calls ``optimizer.step(closure)``, the closure computing the gradients inside the
step; ``dkfac.KFACPreconditioner(model, optimizer=opt)`` preconditions them right after the
closure. Attach it where the optimizer is made (``configure_optimizers``). Needs
``pip install "dkfac[frameworks]"``.

    python examples/lightning_kfac.py --epochs 3
"""

from __future__ import annotations

import argparse

import lightning
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import dkfac
from dkfac.data.builtin import load_digits_tensors


class DigitsClassifier(lightning.LightningModule):
    """A two-layer MLP whose optimizer steps through K-FAC."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        """The batch's loss (Lightning backpropagates it inside the optimizer's closure)."""
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> None:
        """Log the batch's accuracy."""
        x, y = batch
        self.log("val_accuracy", (self.net(x).argmax(-1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """SGD, with K-FAC attached to its step."""
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        self.pre = dkfac.KFACPreconditioner(self.net, optimizer=opt, damping=0.03)
        return opt


def main() -> None:
    """Fit the classifier with Lightning."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    train_set, test_set = load_digits_tensors()
    train = DataLoader(train_set, batch_size=32, shuffle=True)
    test = DataLoader(test_set, batch_size=256)
    module = DigitsClassifier()
    trainer = lightning.Trainer(max_epochs=args.epochs, logger=False, enable_checkpointing=False)
    trainer.fit(module, train, test)
    print(f"K-FAC steps: {module.pre.steps}")


if __name__ == "__main__":
    main()
