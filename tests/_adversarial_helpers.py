"""Small models and data shared by the adversarial tests (CPU and CUDA)."""

from __future__ import annotations

import torch
from torch import nn


def band_data(n=60, seed=0):
    """``n`` uint8 28x28 images of 3 classes; class c brightens one horizontal band, so a small
    network learns it in a few steps. Returns ``(images (n, 1, 28, 28), labels (n,))``."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    x = torch.randint(0, 40, (n, 1, 28, 28), generator=g)
    for c in range(3):
        x[y == c, :, 9 * c : 9 * c + 9, :] += 150
    return x.clamp(0, 255).to(torch.uint8), y


def trained_band_mlp(x, y):
    """A one-hidden-layer MLP trained on :func:`band_data` (60 Adam steps, seeded)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(60):
        opt.zero_grad()
        nn.functional.cross_entropy(net(x.float() / 255), y).backward()
        opt.step()
    return net


class OneNN(nn.Module):
    """1-NN as logits: class score = minus the squared distance to the nearest point of that class
    (differentiable almost everywhere; its argmax is exactly the 1-NN prediction)."""

    def __init__(self, ref, labels, classes):
        super().__init__()
        self.register_buffer("ref", ref)
        self.register_buffer("labels", labels)
        self.classes = classes

    def forward(self, z):
        d = -(z.unsqueeze(1) - self.ref.unsqueeze(0)).pow(2).sum(-1)
        return torch.stack([d[:, self.labels == c].max(1).values for c in range(self.classes)], 1)
