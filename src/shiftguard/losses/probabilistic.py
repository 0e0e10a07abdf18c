"""Probabilistic-embedding losses on the hypersphere [Kirchhof].

Convention [Kirchhof, App. A, Sec. 3.2]: an embedding ``e in R^D`` *is* a von Mises-Fisher distribution with
mean direction ``mu = e / ||e||`` and concentration ``kappa = ||e||`` (the natural parameter of the vMF).
A zero embedding is the uniform distribution (kappa = 0): its direction is irrelevant and is replaced by
the first basis vector, and kappa is computed as ``sqrt(||e||^2 + 1e-12)`` so its gradient is finite.

vMF sampling and the log-normaliser come from :mod:`shiftguard.functional.vmf`
(``sample_vmf(mu, kappa, n_samples, generator)``, ``log_vmf_normalizer(kappa, dim)``).

Losses (supervised batches: positives share a label, negatives have a different label):

* :class:`MCInfoNCELoss` -- [Kirchhof, App. B, eq. (7)]: Monte-Carlo InfoNCE over K vMF samples per embedding,
  ``-log 1/K sum_k exp(kp z_k^T z+_k) / (1/M exp(kp z_k^T z+_k) + 1/M sum_m exp(kp z_k^T z-_{m,k}))``,
  for every (anchor, positive) pair, with the anchor's M in-batch negatives.  ``kappa_pos = 20``
  (appendix B.3, following Zimmermann et al. 2021); K = 16 MC samples by default (Sec. 5.1 / Fig. 3: the
  bias "is largely mitigated with 16 samples"; the controlled experiment used 512).
* :class:`HIBLoss` -- [Kirchhof, App. B.4, eq. (54)]: Hedged Instance Embeddings with vMFs and cosine
  similarity, ``-log E[s(a z^T z+ + b)] - 1/M sum_m log E[1 - s(a z^T z-_m + b)]`` (no KL regulariser).
* :class:`ELKLoss` -- [Kirchhof, App. B.5, eq. (55)]: InfoNCE with the expected-likelihood similarity
  ``-kappa_pos * d_EL-vMF``, ``d_EL-vMF = log C(||nu_1 + nu_2||) - log C(kappa_1) - log C(kappa_2)``
  (appendix A, Supp. D, eq. (35)).  Deterministic (closed form).
* :class:`NivMFProxyLoss` -- EL-nivMF, [Kirchhof, App. A, eq. (4)-(6) and Alg. 1]: learnable
  non-isotropic vMF proxies ``(mu_p, K_p = diag(kappa_p))``, expected likelihood of N vMF samples of the
  embedding under each proxy density, softmax with a learnable temperature ``t``.

Range: ``kappa = ||e||`` is computed without squaring overflow (rows of large magnitude are divided by
a power of two first, exactly), so any finite embedding whose norm is a finite number of its dtype is
a valid vMF; a row norm beyond the dtype's range, or a loss value that is not finite in the
embeddings' dtype, raises ``ValueError`` naming ``embeddings``. Very concentrated vMFs (kappa up to
the float32 range) are sampled exactly by Wood's algorithm (``shiftguard.functional.vmf``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from shiftguard._validation import check_positive
from shiftguard.functional.scaling import ldexp
from shiftguard.functional.vmf import log_vmf_normalizer, sample_vmf
from shiftguard.losses.base import EmbeddingLoss, zero_loss

__all__ = [
    "split_vmf",
    "draw_vmf_samples",
    "el_vmf_distance",
    "nivmf_log_density",
    "MCInfoNCELoss",
    "HIBLoss",
    "ELKLoss",
    "NivMFProxyLoss",
]


def split_vmf(embeddings: torch.Tensor, eps: float = 1e-12):
    """``(mu (N, D) unit, kappa (N,))`` with ``kappa = sqrt(||e||^2 + eps)``; zero rows get ``mu = e_1``.

    Rows whose squares would overflow are handled as ``2**k * (e / 2**k)`` (exact), so ``kappa`` is
    finite whenever ``||e||`` is a finite number of the dtype; otherwise ``ValueError`` naming
    ``embeddings``.
    """
    finfo = torch.finfo(embeddings.dtype)
    hi = max(math.sqrt(finfo.max / (4.0 * max(1, embeddings.shape[1]))), 2.0)
    amax = embeddings.detach().abs().amax(dim=1) if embeddings.numel() else embeddings.new_zeros(0)
    if embeddings.numel() and float(amax.max()) > hi:
        return _split_vmf_large(embeddings, amax > hi, eps)
    sq = embeddings.pow(2).sum(1)
    kappa = (sq + eps).sqrt()
    mu = embeddings / kappa.unsqueeze(1)
    e1 = torch.zeros_like(embeddings)
    e1[:, 0] = 1.0
    mu = torch.where((sq > 0).unsqueeze(1), mu, e1)
    return mu, kappa


def _split_vmf_large(embeddings: torch.Tensor, large: torch.Tensor, eps: float):
    """``split_vmf`` where the rows marked ``large`` are divided by a common power of two first."""
    small_mu, small_kappa = split_vmf(embeddings[~large], eps) if bool((~large).any()) else (None, None)
    big = embeddings[large]
    k = math.frexp(float(big.detach().abs().max()))[1]
    scaled = ldexp(big, -k)
    norm_scaled = (scaled.pow(2).sum(1) + eps * 2.0 ** (-2 * k)).sqrt()  # the eps term may underflow: exact limit
    big_kappa = ldexp(norm_scaled, k)
    if not bool(torch.isfinite(big_kappa).all()):
        raise ValueError(
            f"embeddings: row norms exceed the {embeddings.dtype} range (values reach "
            f"{float(big.detach().abs().max()):.3g}); the vMF concentration kappa = ||e|| "
            "[Kirchhof, App. A, Sec. 3.2] is not representable"
        )
    mu = torch.empty_like(embeddings)
    kappa = embeddings.new_empty(embeddings.shape[0])
    mu = mu.index_put((large,), scaled / norm_scaled.unsqueeze(1))
    kappa = kappa.index_put((large,), big_kappa)
    if small_mu is not None and small_kappa is not None:
        mu = mu.index_put((~large,), small_mu)
        kappa = kappa.index_put((~large,), small_kappa)
    return mu, kappa


def _finite_loss(loss: torch.Tensor, embeddings: torch.Tensor, check: bool = True) -> torch.Tensor:
    """``loss`` itself; ``ValueError`` naming ``embeddings`` if it is not finite (never a silent NaN/inf),
    checked only with ``check`` (the loss's ``validate_args``)."""
    if check and not bool(torch.isfinite(loss)):
        big = float(embeddings.detach().abs().max())
        raise ValueError(f"embeddings: values reach {big:.3g}; the loss is not finite in {loss.dtype} ({float(loss)})")
    return loss


def draw_vmf_samples(
    mu: torch.Tensor, kappa: torch.Tensor, n_samples: int, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """``n_samples`` reparametrised vMF samples per row, shape ``(n_samples, N, D)`` (via ``sample_vmf``)."""
    z = sample_vmf(mu, kappa, n_samples, generator=generator)
    n, d = mu.shape
    if z.shape == (n_samples, n, d):
        return z
    if z.shape == (n, n_samples, d):
        return z.transpose(0, 1)
    raise RuntimeError(
        f"sample_vmf returned shape {tuple(z.shape)}; expected ({n_samples}, {n}, {d}) or ({n}, {n_samples}, {d})"
    )


def _pairs_and_negatives(labels: torch.Tensor):
    same = labels.unsqueeze(0) == labels.unsqueeze(1)
    eye = torch.eye(labels.shape[0], dtype=torch.bool, device=labels.device)
    neg = ~same
    n_neg = neg.sum(1)
    a_idx, p_idx = torch.nonzero(same & ~eye & (n_neg > 0).unsqueeze(1), as_tuple=True)
    return a_idx, p_idx, neg, n_neg


class _VMFSampleLoss(EmbeddingLoss):
    min_dim = 2

    def __init__(self, n_samples: int, generator: Optional[torch.Generator], validate_args: bool = True):
        super().__init__(validate_args=validate_args)
        check_positive(n_samples, "n_samples", integer=True)
        self.n_samples = n_samples
        self.generator = generator

    def _samples(self, embeddings):
        mu, kappa = split_vmf(embeddings)
        return draw_vmf_samples(mu, kappa, self.n_samples, self.generator)


class MCInfoNCELoss(_VMFSampleLoss):
    """MCInfoNCE [Kirchhof, App. B, eq. (7)] on a labelled batch.

    Args:
        kappa_pos: the positive-pair concentration (20, appendix B.3).
        n_samples: MC samples K per embedding (16 by default; the thesis' controlled experiment used 512).
        generator: optional ``torch.Generator`` for the vMF samples (fix it for reproducible values).

    Every ordered (anchor, positive) pair of same-label samples is a term; the anchor's negatives are all
    samples with a different label (M = their number).  Anchors without a positive or without a negative
    are skipped; a batch with neither gives an exact 0.
    """

    def __init__(
        self,
        kappa_pos: float = 20.0,
        n_samples: int = 16,
        generator: Optional[torch.Generator] = None,
        *,
        validate_args: bool = True,
    ):
        super().__init__(n_samples, generator, validate_args)
        check_positive(kappa_pos, "kappa_pos")
        self.kappa_pos = float(kappa_pos)

    def extra_repr(self) -> str:
        return f"kappa_pos={self.kappa_pos}, n_samples={self.n_samples}"

    def compute(self, embeddings, labels):
        a_idx, p_idx, neg, n_neg = _pairs_and_negatives(labels)
        if a_idx.numel() == 0:
            return zero_loss(embeddings)
        z = self._samples(embeddings)  # (K, N, D)
        logits = self.kappa_pos * torch.einsum("knd,kmd->knm", z, z)  # (K, N, N)
        lse_neg = torch.logsumexp(logits.masked_fill(~neg, float("-inf")), dim=2)  # (K, N)
        pos = logits[:, a_idx, p_idx]  # (K, P)
        log_m = n_neg[a_idx].to(logits.dtype).log()
        log_ratio = pos - (torch.logaddexp(pos, lse_neg[:, a_idx]) - log_m)
        per_pair = -(torch.logsumexp(log_ratio, dim=0) - math.log(self.n_samples))
        return _finite_loss(per_pair.mean(), embeddings, self.validate_args)


class HIBLoss(_VMFSampleLoss):
    """Contrastive Hedged Instance Embeddings with vMFs [Kirchhof, App. B.4, eq. (54)].

    Args:
        a, b: scale and offset inside the sigmoid ``s(a * z^T z' + b)``.  The thesis tuned them on the grid
            a in {0.5, 1, 2, 4}, b in {-8, ..., 8} (Table 7) but the chosen values are not legible in our copy;
            defaults a = 4, b = -2 (an untuned choice that puts the sigmoid's midpoint at cosine 0.5).
        n_samples: MC samples per embedding (8, within the 5-10 range [Kirchhof] cites for HIB).
    """

    def __init__(
        self,
        a: float = 4.0,
        b: float = -2.0,
        n_samples: int = 8,
        generator: Optional[torch.Generator] = None,
        *,
        validate_args: bool = True,
    ):
        super().__init__(n_samples, generator, validate_args)
        check_positive(a, "a")
        if not math.isfinite(b):
            raise ValueError(f"b: expected a finite number, got {b}")
        self.a, self.b = float(a), float(b)

    def extra_repr(self) -> str:
        return f"a={self.a}, b={self.b}, n_samples={self.n_samples}"

    def compute(self, embeddings, labels):
        a_idx, p_idx, neg, n_neg = _pairs_and_negatives(labels)
        if a_idx.numel() == 0:
            return zero_loss(embeddings)
        z = self._samples(embeddings)
        x = self.a * torch.einsum("knd,kmd->knm", z, z) + self.b  # (K, N, N)
        log_k = math.log(self.n_samples)
        log_p_match = torch.logsumexp(F.logsigmoid(x), dim=0) - log_k  # log E[s(.)]       (N, N)
        log_p_nonmatch = torch.logsumexp(F.logsigmoid(-x), dim=0) - log_k  # log E[1 - s(.)]  (N, N)
        neg_term = -(log_p_nonmatch * neg).sum(1) / n_neg.clamp_min(1).to(x.dtype)  # (N,)
        return _finite_loss((-log_p_match[a_idx, p_idx] + neg_term[a_idx]).mean(), embeddings, self.validate_args)


def el_vmf_distance(mu1, kappa1, mu2, kappa2) -> torch.Tensor:
    """Pairwise expected-likelihood distance between vMFs [Kirchhof, App. A, Supp. D, eq. (35)], ``(N, M)``.

    ``d = log C_D(||kappa1 mu1 + kappa2 mu2||) - log C_D(kappa1) - log C_D(kappa2)``.

    Concentrations whose squares would overflow are divided by a power of two for the norm (exact);
    ``ValueError`` naming ``kappa1, kappa2`` when ``||kappa1 mu1 + kappa2 mu2||`` itself exceeds the dtype.
    """
    d = mu1.shape[1]
    finfo = torch.finfo(kappa1.dtype)
    top = max([float(k.detach().max()) for k in (kappa1, kappa2) if k.numel()], default=0.0)
    e = math.frexp(top)[1] if top > math.sqrt(finfo.max) / 4.0 else 0
    nu1 = (ldexp(kappa1, -e) if e else kappa1).unsqueeze(1) * mu1
    nu2 = (ldexp(kappa2, -e) if e else kappa2).unsqueeze(1) * mu2
    norm_sum = ((nu1.unsqueeze(1) + nu2.unsqueeze(0)).pow(2).sum(-1) + 1e-12 * 2.0 ** (-2 * e)).sqrt()
    if e:
        norm_sum = ldexp(norm_sum, e)
        if not bool(torch.isfinite(norm_sum).all()):
            raise ValueError(
                f"kappa1, kappa2: concentrations reach {top:.3g}; ||kappa1 mu1 + kappa2 mu2|| "
                f"exceeds the {kappa1.dtype} range"
            )
    return (
        log_vmf_normalizer(norm_sum, d)
        - log_vmf_normalizer(kappa1, d).unsqueeze(1)
        - log_vmf_normalizer(kappa2, d).unsqueeze(0)
    )


class ELKLoss(EmbeddingLoss):
    """Contrastive expected-likelihood-kernel loss [Kirchhof, App. B.5, eq. (55)]; ``kappa_pos = 20``.

    InfoNCE of eq. (55) with logits ``-kappa_pos * d_EL-vMF`` for every (anchor, positive) pair against the
    anchor's in-batch negatives.  Closed form, no sampling.
    """

    min_dim = 2

    def __init__(self, kappa_pos: float = 20.0, *, validate_args: bool = True):
        super().__init__(validate_args=validate_args)
        check_positive(kappa_pos, "kappa_pos")
        self.kappa_pos = float(kappa_pos)

    def extra_repr(self) -> str:
        return f"kappa_pos={self.kappa_pos}"

    def compute(self, embeddings, labels):
        a_idx, p_idx, neg, n_neg = _pairs_and_negatives(labels)
        if a_idx.numel() == 0:
            return zero_loss(embeddings)
        mu, kappa = split_vmf(embeddings)
        if not bool(torch.isfinite(2.0 * kappa.detach()).all()):
            raise ValueError(
                f"embeddings: row norms reach {float(kappa.detach().max()):.3g}; the sum of two "
                f"concentrations in d_EL-vMF [Kirchhof, eq. (35)] exceeds the {kappa.dtype} range"
            )
        logits = -self.kappa_pos * el_vmf_distance(mu, kappa, mu, kappa)  # (N, N)
        lse_neg = torch.logsumexp(logits.masked_fill(~neg, float("-inf")), dim=1)
        pos = logits[a_idx, p_idx]
        log_m = n_neg[a_idx].to(logits.dtype).log()
        loss = -(pos - (torch.logaddexp(pos, lse_neg[a_idx]) - log_m)).mean()
        return _finite_loss(loss, embeddings, self.validate_args)


def nivmf_log_density(z: torch.Tensor, mu_p: torch.Tensor, kappa_p: torch.Tensor) -> torch.Tensor:
    """Log density of non-isotropic vMF proxies at points ``z`` [Kirchhof, App. A, eq. (4), Supp. B, eq. (19)-(22)].

    ``log rho_c(z) = log C_D(||K mu||) + log D(K) + ||K mu|| s(K z, K mu)`` with ``K = diag(kappa_p[c])``,
    ``log D(K) = sum_m log kappa_m - log ||K mu||``.  ``z``: ``(..., D)``; ``mu_p`` unit ``(C, D)``;
    ``kappa_p`` positive ``(C, D)``.  Returns ``(..., C)``.
    """
    d = mu_p.shape[1]
    k_mu = kappa_p * mu_p  # (C, D)
    k_mu_norm = (k_mu.pow(2).sum(1) + 1e-12).sqrt()  # (C,)
    kz = z.unsqueeze(-2) * kappa_p  # (..., C, D)
    cos = (kz * k_mu).sum(-1) / ((kz.pow(2).sum(-1) + 1e-12).sqrt() * k_mu_norm)
    log_d = kappa_p.log().sum(1) - k_mu_norm.log()
    return log_vmf_normalizer(k_mu_norm, d) + log_d + k_mu_norm * cos


class NivMFProxyLoss(_VMFSampleLoss):
    """EL-nivMF proxy loss [Kirchhof, App. A, eq. (5)-(6), Alg. 1].

    ``logit_c = log(1/N sum_n rho_c(z_n)) / t`` with ``z_n ~ vMF(e/||e||, ||e||)``, cross-entropy over the
    classes.  Learnable: proxy directions ``mu_p`` (normalised in use), per-dimension concentrations
    ``kappa_p = exp(log_kappa_p)`` and the temperature ``t = exp(log_t)`` (Algorithm 1 makes all three
    learnable).  Initial values are not given in [Kirchhof]: ``kappa_p = init_kappa`` (16, so the isotropic
    proxy concentration ``||K mu|| = 16``) and ``t = 1``.  ``n_samples = 10`` (appendix A, Supp. H:
    "N ~ 10").
    """

    def __init__(
        self,
        num_classes: int,
        embedding_dim: int,
        n_samples: int = 10,
        init_kappa: float = 16.0,
        init_temperature: float = 1.0,
        generator: Optional[torch.Generator] = None,
        *,
        validate_args: bool = True,
    ):
        super().__init__(n_samples, generator, validate_args)
        check_positive(num_classes, "num_classes", integer=True)
        check_positive(embedding_dim, "embedding_dim", integer=True)
        if embedding_dim < 2:
            raise ValueError(f"embedding_dim: the vMF needs at least 2 dimensions, got {embedding_dim}")
        check_positive(init_kappa, "init_kappa")
        check_positive(init_temperature, "init_temperature")
        self.proxies = nn.Parameter(F.normalize(torch.randn(num_classes, embedding_dim), dim=1))
        self.log_kappa_p = nn.Parameter(torch.full((num_classes, embedding_dim), math.log(init_kappa)))
        self.log_t = nn.Parameter(torch.tensor(math.log(init_temperature)))

    def extra_repr(self) -> str:
        return f"num_classes={self.proxies.shape[0]}, embedding_dim={self.proxies.shape[1]}, n_samples={self.n_samples}"

    def compute(self, embeddings, labels):
        if self.validate_args and int(labels.max()) >= self.proxies.shape[0]:
            raise ValueError(f"labels: must be < num_classes={self.proxies.shape[0]}, got {int(labels.max())}")
        if embeddings.shape[1] != self.proxies.shape[1]:
            raise ValueError(f"embeddings: expected {self.proxies.shape[1]} features, got {embeddings.shape[1]}")
        dt = embeddings.dtype
        z = self._samples(embeddings)  # (K, N, D)
        mu_p = F.normalize(self.proxies.to(dt), dim=1)
        log_rho = nivmf_log_density(z, mu_p, self.log_kappa_p.to(dt).exp())  # (K, N, C)
        log_el = torch.logsumexp(log_rho, dim=0) - math.log(self.n_samples)  # log 1/N sum rho  (N, C)
        logits = log_el / self.log_t.to(dt).exp()
        return _finite_loss(F.cross_entropy(logits, labels), embeddings, self.validate_args)
