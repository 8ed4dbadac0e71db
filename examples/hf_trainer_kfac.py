"""K-FAC inside a Hugging Face ``Trainer``: a tiny BERT (built from a config) on digits-as-tokens.

The Trainer owns the loop; ``dkfac.KFACPreconditioner(model, optimizer=opt)`` runs K-FAC in
``opt.step()``. Pass the optimizer to the Trainer with ``optimizers=(opt, None)`` so it steps
the one K-FAC is attached to. Needs ``pip install "dkfac[frameworks]"``; nothing downloads.

    python examples/hf_trainer_kfac.py --steps 30
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

import dkfac
from dkfac.data.builtin import load_digits_tensors


class DigitTokens(Dataset[dict[str, torch.Tensor]]):
    """scikit-learn's digits, each 8x8 image's 64 grey levels (0-16) as a token sequence."""

    def __init__(self, train: bool) -> None:
        train_set, test_set = load_digits_tensors(standardize=False)  # pixels in [0, 1]
        x, y = (train_set if train else test_set).tensors
        self.ids = (x.reshape(len(x), -1) * 16).round().long().clamp(0, 16)
        self.labels = y

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.labels[index]}


def main() -> None:
    """Train the tiny BERT with the Trainer, K-FAC in its optimizer's step."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    config = BertConfig(
        vocab_size=17,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=10,
    )
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    pre = dkfac.KFACPreconditioner(model, optimizer=opt, damping=0.03)
    # Which layers K-FAC preconditions: the Linear layers and the word and token-type
    # embeddings; BERT's position embedding, looked up once and broadcast over the batch, is
    # found at the first step and passes its gradient through (a warning says so).
    print(pre)
    with tempfile.TemporaryDirectory() as out:
        arguments = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=32,
            max_steps=args.steps,
            lr_scheduler_type="constant",
            learning_rate=0.05,
            report_to=[],
            save_strategy="no",
            logging_steps=10,
            use_cpu=not torch.cuda.is_available(),
        )
        trainer = Trainer(
            model=model,
            args=arguments,
            train_dataset=DigitTokens(train=True),
            eval_dataset=DigitTokens(train=False),
            optimizers=(opt, None),
        )
        trainer.train()
        print(trainer.evaluate())
    print(f"K-FAC steps: {pre.steps}")
    pre.remove()


if __name__ == "__main__":
    main()
