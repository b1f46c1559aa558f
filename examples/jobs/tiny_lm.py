"""A small transformer language model on generated text (no download): sentences from a tiny
grammar, next-character prediction. AdamW, square-root learning-rate scaling. The metric is the
accuracy of the next character on held-out sentences.

    python -m examples.jobs.tiny_lm --epochs 3 --checkpoint out/lm.pt
"""

from __future__ import annotations

import random

import torch
from torch import nn
from torch.utils.data import TensorDataset

from examples.jobs.common import job_arguments, train
from goodput_train import AdaptiveTraining

GOODPUT_JOB = True  # a job: the executors may run this module (a helper module may not)

CONTEXT = 32
SUBJECTS = ["the cat", "a dog", "my friend", "the robot", "our team"]
VERBS = ["sees", "likes", "builds", "finds", "trains"]
OBJECTS = ["a model", "the ball", "two gpus", "a big cluster", "the data"]


def corpus(sentences: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}." for _ in range(sentences))


VOCAB = sorted(set(corpus(200, 0)))


def windows(text: str) -> TensorDataset:
    ids = torch.tensor([VOCAB.index(c) for c in text])
    starts = torch.arange(0, len(ids) - CONTEXT - 1, CONTEXT // 2)
    inputs = torch.stack([ids[s : s + CONTEXT] for s in starts])
    return TensorDataset(inputs, torch.stack([ids[s + 1 : s + CONTEXT + 1] for s in starts]))


class TinyLM(nn.Module):
    def __init__(self, width: int = 64):
        super().__init__()
        self.embed = nn.Embedding(len(VOCAB), width)
        self.position = nn.Parameter(torch.zeros(CONTEXT, width))
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=2 * width, batch_first=True, dropout=0.0)
        self.blocks = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.out = nn.Linear(width, len(VOCAB))
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(CONTEXT), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.embed(ids) + self.position, mask=self.causal, is_causal=True))


def main(argv: list[str] | None = None) -> dict:
    args = job_arguments(__doc__, 3.0, argv)
    torch.manual_seed(0)
    model = TinyLM()
    data, test = windows(corpus(3000, seed=1)), windows(corpus(300, seed=2))
    training = AdaptiveTraining(
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-3),
        data,
        init_batch=16,
        max_batch=256,
        max_local=64,
        target_epochs=args.epochs,
        checkpoint_path=args.checkpoint,
    )

    def next_char_accuracy() -> float:
        with torch.no_grad():
            predicted = model(test.tensors[0].to(training.device)).argmax(-1).cpu()
            return float((predicted == test.tensors[1]).float().mean())

    def loss_of(net, batch):
        logits = net(batch[0])
        return nn.functional.cross_entropy(logits.reshape(-1, len(VOCAB)), batch[1].reshape(-1))

    return train(training, loss_of, next_char_accuracy)


if __name__ == "__main__":
    main()
