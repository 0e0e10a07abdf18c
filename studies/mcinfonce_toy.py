"""MCInfoNCE identifiability toy ([Kirchhof, Ch. 3 / App. B] "Controlled Experiment"), CPU-sized.

Setup ([Kirchhof, App. B.1-B.3], reproduced at a smaller scale):

* Generative process: observations ``x ~ U[0, 1]^D``; posterior ``P(z|x) = vMF(mu(x), kappa(x))`` with two
  fixed random MLPs: ``mu``: three linear layers D->D->D->D with leaky ReLU, output normalised, re-drawn
  while the smallest pairwise cosine of 1000 samples exceeds 0.5 (non-collapsed); ``kappa``: one hidden
  layer fewer, scalar output ``1 + exp(.)`` mapped affinely onto ``[kappa_min, kappa_max]`` = [16, 32]
  ("ambiguous" setting) using its range on 1000 reference inputs.
* Contrastive data by rejection sampling (appendix B.2, eq. (53)): candidate pairs ``(x, x+)`` uniform,
  ``z ~ P(z|x)``, ``z+ ~ P(z+|x+)``, accepted with probability
  ``C(kp) e^{kp z^T z+} / (C(kp) e^{kp z^T z+} + C(0))``, ``kp = kappa_pos = 20``.  Negatives: uniform x.
* Encoder: MLPs for ``mu^(x)`` (normalised) and ``kappa^(x) = 1 + exp(.)`` (initialised mid-range); the
  loss sees the embedding ``kappa^(x) mu^(x)`` (the norm-is-concentration convention of [Kirchhof]).
* Training: phasewise ([Kirchhof, App. B.6] -- it helped MCInfoNCE): first ``mu^`` with
  :class:`shiftguard.losses.MCInfoNCELoss` while ``kappa^`` is held at its initial mid-range output (in-batch
  negatives only), then ``mu^`` frozen and ``kappa^`` trained with the same loss (K MC samples, M uniform
  negatives + in-batch ones).  Fresh contrastive pairs are drawn every step, as in [Kirchhof].
* ``--oracle-mu``: the encoder's directions are the true ``mu(x)`` and only ``kappa^`` is learned -- this
  isolates what MCInfoNCE's kappa gradient recovers from the limited training a CPU allows.
* Metrics [Kirchhof, Sec. 5.1]: Spearman rank correlation between ``mu^(x1)^T mu^(x2)`` and ``mu(x1)^T mu(x2)``
  over all pairs of ``n_eval`` fresh inputs, and between ``kappa^(x)`` and ``kappa(x)``.

Thesis ([Kirchhof, Table 1], ambiguous kappa in [16, 32], D = 10, 100k batches of 512, K = 512): rank corr.
0.99 (location) and 0.82 (certainty).  Our CPU scale: D = 10, 1500 + 800 steps, 64 / 32 pairs per batch,
K = 128.  Run:

    .venv/bin/python studies/mcinfonce_toy.py --out studies/results/mcinfonce_toy.json
    .venv/bin/python studies/mcinfonce_toy.py --oracle-mu --out studies/results/mcinfonce_toy_oracle_mu.json
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.nn.functional as F
from scipy.stats import spearmanr
from torch import nn

from shiftguard.functional.vmf import log_vmf_normalizer, sample_vmf
from shiftguard.losses import MCInfoNCELoss

THESIS = {
    "location_rank_corr": 0.99,
    "kappa_rank_corr": 0.82,
    "D": 10,
    "batches": 100000,
    "batch_size": 512,
    "mc_samples": 512,
}


def _mlp(sizes, final_act=False):
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2 or final_act:
            layers.append(nn.LeakyReLU(0.2))
    return nn.Sequential(*layers)


class GenerativeProcess(nn.Module):
    """Fixed random posteriors ``mu(x)``, ``kappa(x)`` of [Kirchhof, App. B.1]."""

    def __init__(self, dim=10, kappa_min=16.0, kappa_max=32.0, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        ref = torch.rand(1000, dim, generator=g)
        while True:
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=g)))
            self.mu_net = _mlp([dim, dim, dim, dim])
            with torch.no_grad():
                m = F.normalize(self.mu_net(ref), dim=1)
                if float((m @ m.t()).min()) <= 0.5:  # re-draw collapsed generators
                    break
        self.kappa_net = _mlp([dim, dim, 1])
        with torch.no_grad():
            raw = 1 + torch.exp(self.kappa_net(ref).squeeze(1))
        self.register_buffer("raw_lo", raw.min())
        self.register_buffer("raw_hi", raw.max())
        self.kappa_min, self.kappa_max = kappa_min, kappa_max
        self.requires_grad_(False)

    def mu(self, x):
        return F.normalize(self.mu_net(x), dim=1)

    def kappa(self, x):
        raw = 1 + torch.exp(self.kappa_net(x).squeeze(1))
        t = ((raw - self.raw_lo) / (self.raw_hi - self.raw_lo)).clamp(0, 1)
        return self.kappa_min + t * (self.kappa_max - self.kappa_min)


@torch.no_grad()
def sample_positive_pairs(gp, n_pairs, kappa_pos=20.0, generator=None, chunk=20000):
    """Rejection sampling of (x, x+) pairs [Kirchhof, App. B.2, eq. (53)]."""
    dim = gp.mu_net[0].in_features
    log_c_pos = float(log_vmf_normalizer(torch.tensor(kappa_pos, dtype=torch.float64), dim))
    log_c_0 = float(log_vmf_normalizer(torch.tensor(0.0, dtype=torch.float64), dim))
    xs, xps, tried = [], [], 0
    if generator is not None and generator.device.type != "cpu":
        raise ValueError("generator: expected a CPU generator")
    while sum(len(a) for a in xs) < n_pairs:
        x = torch.rand(chunk, dim, generator=generator)
        xp = torch.rand(chunk, dim, generator=generator)
        z = sample_vmf(gp.mu(x), gp.kappa(x), 1, generator=generator)[0]
        zp = sample_vmf(gp.mu(xp), gp.kappa(xp), 1, generator=generator)[0]
        logit = log_c_pos + kappa_pos * (z * zp).sum(1) - log_c_0
        keep = torch.rand(chunk, generator=generator) < torch.sigmoid(logit)
        xs.append(x[keep])
        xps.append(xp[keep])
        tried += chunk
    x, xp = torch.cat(xs), torch.cat(xps)
    return x[:n_pairs], xp[:n_pairs], len(x) / tried


class Encoder(nn.Module):
    def __init__(self, dim=10, width=64, kappa_init=24.0):
        super().__init__()
        self.mu_net = _mlp([dim, width, 2 * width, width, dim])
        self.kappa_net = _mlp([dim, width, 2 * width, width, 1])
        with torch.no_grad():  # start kappa^ in the middle of the true range [Kirchhof, App. B.1]
            self.kappa_net[-1].weight.mul_(0.1)
            self.kappa_net[-1].bias.fill_(math.log(kappa_init - 1))

    def mu(self, x):
        return F.normalize(self.mu_net(x), dim=1)

    def kappa(self, x):
        return 1 + torch.exp(self.kappa_net(x).squeeze(1))


def train(
    gp,
    enc,
    *,
    steps_mu,
    steps_kappa,
    batch_size,
    batch_size_kappa,
    n_neg,
    n_samples,
    kappa_pos,
    lr,
    seed,
    joint_steps=0,
):
    """Phasewise training on *fresh* contrastive pairs every step ([Kirchhof] draws 100k fresh batches; reusing a
    fixed pair set lets mu^ memorise the pairs and then kappa^ -> inf)."""
    g = torch.Generator().manual_seed(seed + 1)
    dim = gp.mu_net[0].in_features
    fresh = lambda b: sample_positive_pairs(gp, b, kappa_pos, generator=g, chunk=2 * b + 64)[:2]
    lbl = lambda b: torch.cat([torch.arange(b), torch.arange(b), b + torch.arange(n_neg)])
    loss_fn = MCInfoNCELoss(kappa_pos=kappa_pos, n_samples=n_samples, generator=torch.Generator().manual_seed(seed + 2))
    # phase 1: mu^ with MCInfoNCE while kappa^ stays at its initial (mid-range) value; in-batch negatives (M = 0
    # extra negatives, which [Kirchhof, App. B.6] found beneficial for this phase)
    opt = torch.optim.Adam(enc.mu_net.parameters(), lr=lr)
    for _ in range(steps_mu):
        xb, xpb = fresh(batch_size)
        inp = torch.cat([xb, xpb])
        with torch.no_grad():
            kap = enc.kappa(inp)
        b = len(xb)
        loss = loss_fn(enc.mu(inp) * kap.unsqueeze(1), torch.cat([torch.arange(b), torch.arange(b)]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    # optional joint phase: mu^ and kappa^ together (no phasewise schedule)
    opt = torch.optim.Adam(list(enc.mu_net.parameters()) + list(enc.kappa_net.parameters()), lr=lr)
    for _ in range(joint_steps):
        xb, xpb = fresh(batch_size_kappa)
        inp = torch.cat([xb, xpb, torch.rand(n_neg, dim, generator=g)])
        loss = loss_fn(enc.mu(inp) * enc.kappa(inp).unsqueeze(1), lbl(len(xb)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    # phase 2: kappa^ with MCInfoNCE, mu^ frozen; M = n_neg uniform negatives + the other pairs of the batch
    opt = torch.optim.Adam(enc.kappa_net.parameters(), lr=lr)
    for _ in range(steps_kappa):
        xb, xpb = fresh(batch_size_kappa)
        xn = torch.rand(n_neg, dim, generator=g)
        inp = torch.cat([xb, xpb, xn])
        with torch.no_grad():
            m = enc.mu(inp)
        emb = m * enc.kappa(inp).unsqueeze(1)
        loss = loss_fn(emb, lbl(len(xb)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return enc


@torch.no_grad()
def evaluate(gp, enc, n_eval=2000, seed=123):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n_eval, gp.mu_net[0].in_features, generator=g)
    iu = torch.triu_indices(n_eval, n_eval, 1)
    true_sim = (gp.mu(x) @ gp.mu(x).t())[iu[0], iu[1]]
    pred_sim = (enc.mu(x) @ enc.mu(x).t())[iu[0], iu[1]]
    k_true, k_pred = gp.kappa(x), enc.kappa(x)
    return {
        "location_rank_corr": float(spearmanr(true_sim.numpy(), pred_sim.numpy()).statistic),
        "kappa_rank_corr": float(spearmanr(k_true.numpy(), k_pred.numpy()).statistic),
        "kappa_rmse": float((k_true - k_pred).pow(2).mean().sqrt()),
        "kappa_pred_range": [float(k_pred.min()), float(k_pred.max())],
    }


@torch.no_grad()
def loss_vs_kappa_scale(
    dim=10,
    n_samples=(16, 128),
    scales=(0.5, 1.0, 1.5, 2.0, 3.0, 4.0),
    n_pairs=2048,
    batch=64,
    n_neg=32,
    kappa_pos=20.0,
    seed=0,
):
    """MCInfoNCE (eq. (7)) evaluated at the *true* posteriors with kappa scaled by c: where is it minimal?

    Eq. (7) is a biased MC estimate of eq. (5) [Kirchhof, Sec. 5.1]; this measures how the bias moves the minimiser
    away from c = 1 for a given number of MC samples K.
    """
    gp = GenerativeProcess(dim, seed=seed)
    x, xp, _ = sample_positive_pairs(gp, n_pairs, kappa_pos, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 5)
    negs = [torch.rand(n_neg, dim, generator=g) for _ in range(0, n_pairs, batch)]
    out = {}
    for k in n_samples:
        loss_fn = MCInfoNCELoss(kappa_pos=kappa_pos, n_samples=k)
        for c in scales:
            tot = 0.0
            for j, i in enumerate(range(0, n_pairs, batch)):
                inp = torch.cat([x[i : i + batch], xp[i : i + batch], negs[j]])
                lab = torch.cat([torch.arange(batch), torch.arange(batch), batch + torch.arange(n_neg)])
                loss_fn.generator = torch.Generator().manual_seed(i)
                tot += float(loss_fn(gp.mu(inp) * (c * gp.kappa(inp)).unsqueeze(1), lab))
            out[f"K={k},c={c}"] = tot / len(negs)
    return out


def run(
    dim=10,
    oracle_mu=False,
    steps_mu=1500,
    steps_kappa=800,
    batch_size=64,
    batch_size_kappa=32,
    n_neg=32,
    n_samples=128,
    kappa_pos=20.0,
    lr=1e-3,
    width=64,
    n_eval=2000,
    seed=0,
    kappa_min=16.0,
    kappa_max=32.0,
):
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    gp = GenerativeProcess(dim, kappa_min, kappa_max, seed=seed)
    _, _, acc_rate = sample_positive_pairs(gp, 2000, kappa_pos, generator=torch.Generator().manual_seed(seed))
    torch.manual_seed(seed)
    enc = Encoder(dim, width, kappa_init=(kappa_min + kappa_max) / 2)
    if oracle_mu:  # isolate kappa recovery: the encoder's mean directions are the true mu(x)
        enc.mu = gp.mu
        steps_mu = 0
    train(
        gp,
        enc,
        steps_mu=steps_mu,
        steps_kappa=steps_kappa,
        batch_size=batch_size,
        batch_size_kappa=batch_size_kappa,
        n_neg=n_neg,
        n_samples=n_samples,
        kappa_pos=kappa_pos,
        lr=lr,
        seed=seed,
    )
    res = evaluate(gp, enc, n_eval)
    res.update(acceptance_rate=acc_rate, total_s=time.perf_counter() - t0, oracle_mu=oracle_mu)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=10)
    p.add_argument(
        "--oracle-mu",
        action="store_true",
        help="give the encoder the true mean directions and learn only kappa^ (isolates kappa recovery)",
    )
    p.add_argument("--steps-mu", type=int, default=1500)
    p.add_argument("--steps-kappa", type=int, default=800)
    p.add_argument("--batch-size", type=int, default=64, help="pairs per batch, phase 1 (mu^)")
    p.add_argument("--batch-size-kappa", type=int, default=32, help="pairs per batch, phase 2 (kappa^)")
    p.add_argument("--n-neg", type=int, default=32)
    p.add_argument("--n-samples", type=int, default=128)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument(
        "--landscape",
        action="store_true",
        help="only evaluate the loss at the true posteriors with kappa scaled by c (MC-bias check)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.landscape:
        land = loss_vs_kappa_scale(args.dim)
        for key, val in land.items():
            print(f"{key:>14}: loss {val:.4f}")
        if args.out:
            from shiftguard.io import atomic_write_json

            atomic_write_json(args.out, {"config": vars(args), "loss_vs_kappa_scale": land})
        return 0
    runs = []
    for seed in args.seeds:
        r = run(
            args.dim,
            args.oracle_mu,
            args.steps_mu,
            args.steps_kappa,
            args.batch_size,
            args.batch_size_kappa,
            args.n_neg,
            args.n_samples,
            20.0,
            args.lr,
            args.width,
            2000,
            seed,
        )
        runs.append({"seed": seed, **r})
        print(
            f"seed {seed}: location rank corr {r['location_rank_corr']:.3f}  kappa rank corr "
            f"{r['kappa_rank_corr']:.3f}  kappa RMSE {r['kappa_rmse']:.2f}  acceptance {r['acceptance_rate']:.3f}  "
            f"({r['total_s']:.0f} s)",
            flush=True,
        )
    mean = lambda k: sum(r[k] for r in runs) / len(runs)
    print(
        f"mean over {len(runs)} seed(s): location {mean('location_rank_corr'):.3f} (thesis 0.99), "
        f"kappa {mean('kappa_rank_corr'):.3f} (thesis 0.82)"
    )
    if args.out:
        from shiftguard.io import atomic_write_json

        atomic_write_json(
            args.out,
            {
                "config": vars(args),
                "runs": runs,
                "thesis_003_table1": THESIS,
                "torch": torch.__version__,
                "python": sys.version.split()[0],
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
