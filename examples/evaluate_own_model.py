"""Evaluate a model of your own with shiftguard.

A small CNN defined here (not from ``shiftguard.models``) is trained with plain PyTorch on
Fashion-MNIST with mean/std normalisation, then ``shiftguard.evaluate`` measures its accuracy
and calibration under the 15 MNIST-C corruptions x 5 severities with three confidence heads: the
model's own softmax, temperature scaling and NED. The images given to ``evaluate`` are pixels
(uint8); the normalisation goes in ``preprocess`` and is applied after each corruption.

    python examples/evaluate_own_model.py --root ../shared/data/fashion-mnist --out fmnist-report/
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import shiftguard
from shiftguard import data

MEAN, STD = 0.2860, 0.3530  # Fashion-MNIST training-set pixel mean and std (pixels in [0, 1])


class SmallCNN(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.fc = nn.Linear(64 * 7 * 7, 128)
        self.out = nn.Linear(128, num_classes)

    def forward(self, x):
        return self.out(F.relu(self.fc(self.features(x))))  # embedding = input of self.out


def normalize(x: torch.Tensor) -> torch.Tensor:
    return (x - MEAN) / STD


def train(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, epochs: int, seed: int = 0) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(labels), generator=g).split(128):
            loss = F.cross_entropy(model(normalize(images[idx].float() / 255)), labels[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()


def main(
    root: str,
    out: str,
    n_train: int = 50_000,
    n_val: int = 10_000,
    n_test: int = 10_000,
    epochs: int = 5,
    corruptions=None,
    severities=(1, 2, 3, 4, 5),
) -> shiftguard.EvaluationResult:
    torch.manual_seed(0)
    train_set = data.load("fashion-mnist", "train", root)
    test_set = data.load("fashion-mnist", "test", root)
    perm = torch.randperm(len(train_set.labels), generator=torch.Generator().manual_seed(0))
    tr, va = perm[:n_train], perm[n_train : n_train + n_val]
    model = SmallCNN()
    train(model, train_set.images[tr], train_set.labels[tr], epochs)

    result = shiftguard.evaluate(
        model,
        (test_set.images[:n_test], test_set.labels[:n_test]),
        support=(train_set.images[tr], train_set.labels[tr]),  # the heads' training data
        validation=(train_set.images[va], train_set.labels[va]),  # temperature and NED's T
        suite="mnist-c",
        corruptions=corruptions,
        severities=severities,
        heads=["softmax", "temperature", "ned"],
        preprocess=normalize,
        name="small-cnn-fashion-mnist",
    )
    print(result.summary())
    result.write_report(out)
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True, help="folder with the Fashion-MNIST IDX files")
    p.add_argument("--out", default="fmnist-report", help="report folder")
    p.add_argument("--epochs", type=int, default=5)
    a = p.parse_args()
    main(a.root, a.out, epochs=a.epochs)
