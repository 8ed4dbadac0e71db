"""K-FAC inside loops dkfac does not write: a Hugging Face ``Trainer`` and Lightning.

Both own ``optimizer.step()``; ``KFACPreconditioner(model, optimizer=opt)`` runs K-FAC in it
(Lightning passes the step a closure that computes the gradients; K-FAC follows it). Models
are built from configurations, nothing is downloaded. Oracle: the manual loop (forward,
backward, ``pre.step()``, ``opt.step()``) on the same batches, which the rest of the suite
checks against float64 formulas. Skipped with the reason where a library is not installed
(``pip install "dkfac[frameworks]"``; the ``dev`` extra has it).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import dkfac


class TokenBatches(Dataset[dict[str, torch.Tensor]]):
    """Eight token sequences with a label each, as a Trainer reads them."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, 50, (8, 12), generator=generator)
        self.labels = torch.randint(0, 3, (8,), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.labels[index]}


def tiny_bert() -> nn.Module:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config)


@pytest.mark.filterwarnings("error:K-FAC saw:RuntimeWarning")  # no accumulation mismatch
@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_hugging_face_trainer_runs_kfac_in_its_optimizer_step(
    accumulation: int, tmp_path: Path
) -> None:
    """With ``gradient_accumulation_steps=2`` the preconditioner, told nothing, pools the two
    micro-batches of each optimizer step (the reference is told ``accumulation_steps=2``)."""
    model = tiny_bert()
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="the Trainer needs accelerate")
    reference = copy.deepcopy(model)
    data = TokenBatches()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = dkfac.KFACPreconditioner(model, optimizer=opt, kl_clip=0.01)
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8 // accumulation,
        gradient_accumulation_steps=accumulation,
        max_steps=3,
        max_grad_norm=0.0,  # no clipping: the manual loop does none
        lr_scheduler_type="constant",
        learning_rate=0.1,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = transformers.Trainer(
        model=model, args=arguments, train_dataset=data, optimizers=(opt, None)
    )
    # The Trainer divides each micro-batch's loss by the accumulation steps unless it believes
    # the model normalises by the step's token count itself (a forward taking **kwargs, as
    # BERT's does without using it): keep the division K-FAC's pooling assumes (README).
    trainer.model_accepts_loss_kwargs = False
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # the Trainer's batches, in order
    model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((kwargs["input_ids"], kwargs["labels"])),
        with_kwargs=True,
    )
    trainer.train()
    assert pre.steps == 3
    assert {layer.name for layer in pre.layers} >= {"classifier", "bert.pooler.dense"}
    # The manual loop on the same batches.
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference_pre = dkfac.KFACPreconditioner(
        reference, lr=0.1, kl_clip=0.01, accumulation_steps=accumulation
    )
    reference.train()
    assert len(seen) == 3 * accumulation
    for step in range(3):
        reference_opt.zero_grad()
        for ids, labels in seen[step * accumulation : (step + 1) * accumulation]:
            (reference(input_ids=ids, labels=labels).loss / accumulation).backward()
        reference_pre.step()
        reference_opt.step()
    for (name, mine), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine, theirs), name
    untouched = tiny_bert()
    assert not torch.allclose(model.classifier.weight, untouched.classifier.weight)


def _mlp() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _tensors() -> TensorDataset:
    generator = torch.Generator().manual_seed(2)
    return TensorDataset(torch.randn(30, 5, generator=generator), torch.randint(0, 3, (30,)))


def test_lightning_automatic_optimization_runs_kfac_after_its_closure() -> None:
    lightning = pytest.importorskip("lightning", reason="lightning is not installed")

    class Classifier(lightning.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp()
            self.pre: dkfac.KFACPreconditioner | None = None

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            opt = torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)
            self.pre = dkfac.KFACPreconditioner(self.net, optimizer=opt, kl_clip=0.01)
            return opt

    module = Classifier()
    trainer = lightning.Trainer(
        max_steps=5,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(_tensors(), batch_size=6, shuffle=False))
    assert module.pre is not None and module.pre.steps == 5
    net = _mlp()
    opt = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
    pre = dkfac.KFACPreconditioner(net, lr=lambda _: 0.2, kl_clip=0.01)
    for x, y in DataLoader(_tensors(), batch_size=6, shuffle=False):
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        pre.step()
        opt.step()
    for mine, theirs in zip(module.net.parameters(), net.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
