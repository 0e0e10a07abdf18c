"""von Mises-Fisher (vMF) utilities on the unit sphere S^{M-1} in R^M [Kirchhof, Paper I, Supp. A, eq. (11)].

- ``log_vmf_normalizer(kappa, dim)``: ``log C_M(kappa) = (M/2 - 1) log kappa - (M/2) log(2 pi)
  - log I_{M/2-1}(kappa)`` [Kirchhof, eq. (11)], exact to ~1e-10 relative for ``M`` up to 512+ and
  ``kappa`` in ``[0, 1e4]`` and beyond. ``I_v`` is evaluated as ``log(ive(v, k)) + k`` with SciPy's
  exponentially scaled Bessel function; where that underflows (large order, small kappa) the
  uniform asymptotic (Debye) expansion of DLMF 10.41.3 with four correction terms is used (order
  >= 8), or the ascending series DLMF 10.25.2 (small order, kappa ~ 0); where ``ive`` fails for
  large kappa (SciPy returns NaN beyond ~1e9) the same Debye expansion (order >= 8) or the
  large-argument expansion DLMF 10.40.1 (smaller orders) takes over. The gradient is exact:
  ``d/dkappa log C_M(kappa) = -A_M(kappa)`` with the Bessel ratio ``A_M = I_{M/2} / I_{M/2-1}``
  (from DLMF 10.29.2), implemented in a custom ``autograd.Function`` (first derivatives only).
  Kirchhof [Kirchhof] fits quadratics to log C_M for M in {128, 512} (eqs. (12)-(13)) because the exact
  function had no autograd support; with the exact function and its gradient that is unnecessary.
- ``vmf_mean_resultant_length(kappa, dim)``: ``A_M(kappa) = E[mu^T x]`` for ``x ~ vMF(mu, kappa)``.
- ``sample_vmf(mu, kappa, n_samples, generator=None)``: Wood (1994, "Simulation of the von
  Mises Fisher distribution", Commun. Stat. Simul. 23(1)) rejection sampler (its acceptance test
  written without cancellation, so any finite kappa is sampled), vectorised over a
  batch of ``(mu, kappa)``. The Beta((M-1)/2, (M-1)/2) proposal is drawn as ``X1 / (X1 + X2)`` with
  ``X1, X2`` chi-square((M-1)) from squared normals, so a ``torch.Generator`` controls all randomness.
  Reparameterised gradients: w.r.t. ``mu`` exactly (the Householder map carrying e1 to mu is
  differentiable); w.r.t. ``kappa`` through Wood's transform ``w = (1 - (1+b) z) / (1 - (1-b) z)``
  of the accepted proposal ``z`` (the "reparameterised" part of the rejection-sampling gradient of
  Naesseth et al. 2017, used by Davidson et al. 2018, which [Kirchhof] cites for differentiable vMF
  sampling). The correction (score-function) term of Naesseth et al. is omitted, so the kappa
  gradient is approximate; ``tests/test_vmf.py`` measures its bias on ``d E[mu^T x] / d kappa``.
- ``vmf_log_prob(x, mu, kappa)``: ``log C_M(kappa) + kappa mu^T x``.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
from scipy.special import gammaln, ive

from shiftguard._validation import check_positive, check_tensor

__all__ = ["log_vmf_normalizer", "vmf_mean_resultant_length", "sample_vmf", "vmf_log_prob", "log_bessel_iv"]

# -- log I_v(k) in float64 numpy ----------------------------------------------------------------


def _debye_log_iv(v: float, k: np.ndarray, scaled: bool = False) -> np.ndarray:
    """Uniform asymptotic expansion of log I_v(v z), z = k / v (DLMF 10.41.3, 10.41.10), k > 0.

    ``scaled=True`` returns ``log I_v(k) - k``, with ``v sqrt(1 + z^2) - k`` formed as
    ``v^2 / (v sqrt(1 + z^2) + k)`` (no cancellation of two numbers of size k).
    """
    z = k / v
    s = np.sqrt(1.0 + z * z)
    p = 1.0 / s
    eta = s + np.log(z / (1.0 + s))
    p2 = p * p
    u1 = p * (3.0 - 5.0 * p2) / 24.0
    u2 = p2 * (81.0 - 462.0 * p2 + 385.0 * p2 * p2) / 1152.0
    u3 = p * p2 * (30375.0 - 369603.0 * p2 + 765765.0 * p2**2 - 425425.0 * p2**3) / 414720.0
    u4 = (
        p2
        * p2
        * (4465125.0 - 94121676.0 * p2 + 349922430.0 * p2**2 - 446185740.0 * p2**3 + 185910725.0 * p2**4)
        / 39813120.0
    )
    series = 1.0 + u1 / v + u2 / v**2 + u3 / v**3 + u4 / v**4
    rest = -0.5 * np.log(2.0 * math.pi * v) - 0.5 * np.log(s) + np.log(series)
    if scaled:
        return v * v / (v * s + k) + v * np.log(z / (1.0 + s)) + rest
    return v * eta + rest


def _series_log_iv(v: float, k: np.ndarray, terms: int = 40) -> np.ndarray:
    """Ascending series (DLMF 10.25.2): log I_v(k) = v log(k/2) - lgamma(v+1) + log sum_j t_j."""
    q = (k * k) / 4.0
    term = np.ones_like(k)
    total = np.ones_like(k)
    for j in range(1, terms):
        term = term * q / (j * (v + j))
        total = total + term
    with np.errstate(divide="ignore"):
        return v * np.log(k / 2.0) - gammaln(v + 1.0) + np.log(total)


def _hankel_log_ive(v: float, k: np.ndarray, terms: int = 12) -> np.ndarray:
    """Large-argument expansion (DLMF 10.40.1) of ``log(I_v(k) e^-k)``, for ``k >> v^2`` (k > 0).

    ``I_v(k) ~ e^k / sqrt(2 pi k) * sum_j (-1)^j a_j(v) / k^j`` with
    ``a_j(v) = (4v^2 - 1)(4v^2 - 9)...(4v^2 - (2j-1)^2) / (j! 8^j)``.
    """
    mu = 4.0 * v * v
    term = np.ones_like(k)
    total = np.ones_like(k)
    for j in range(1, terms):
        term = -term * (mu - (2 * j - 1) ** 2) / (j * 8.0 * k)
        total = total + term
    return -0.5 * np.log(2.0 * math.pi * k) + np.log(total)


def _log_ive(v: float, k: np.ndarray) -> np.ndarray:
    """``log(I_v(k) e^-k)`` (the exponentially scaled log; float64 numpy), ``-inf`` at k=0, v>0.

    Kept apart from ``+ k`` so that ratios of Bessel functions at large ``k`` do not cancel two
    numbers of size ``k``.
    """
    k = np.asarray(k, dtype=np.float64)
    out = np.empty_like(k)
    with np.errstate(all="ignore"):
        e = ive(v, k)
    ok = np.isfinite(e) & (e > 1e-280)
    out[ok] = np.log(e[ok])
    bad = ~ok
    if bad.any():
        kb = k[bad]
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            if v >= 8.0:
                vals = np.where(kb > 0, _debye_log_iv(v, np.where(kb > 0, kb, 1.0), scaled=True), -np.inf)
            else:
                large = kb > 1.0
                vals = np.where(large, _hankel_log_ive(v, np.where(large, kb, 1.0)), 0.0)
                small_vals = _series_log_iv(v, np.where(large, 0.0, kb)) - np.where(large, 0.0, kb)
                vals = np.where(large, vals, small_vals)
        out[bad] = vals
    return out


def log_bessel_iv(v: float, k: np.ndarray) -> np.ndarray:
    """``log I_v(k)`` for order ``v >= 0`` and ``k >= 0`` (float64 numpy); ``-inf`` at k=0, v>0."""
    k = np.asarray(k, dtype=np.float64)
    return _log_ive(v, k) + k


def _log_normalizer_np(k: np.ndarray, dim: int) -> np.ndarray:
    v = dim / 2.0 - 1.0
    out = np.empty_like(k)
    zero = k == 0
    # kappa = 0: the uniform density, 1 / surface area = Gamma(M/2) / (2 pi^(M/2)).
    out[zero] = gammaln(dim / 2.0) - math.log(2.0) - (dim / 2.0) * math.log(math.pi)
    kp = k[~zero]
    if kp.size:
        out[~zero] = v * np.log(kp) - (dim / 2.0) * math.log(2.0 * math.pi) - _log_ive(v, kp) - kp
    return out


def _bessel_ratio_np(k: np.ndarray, dim: int) -> np.ndarray:
    """A_M(k) = I_{M/2}(k) / I_{M/2-1}(k); 0 at k = 0."""
    v = dim / 2.0 - 1.0
    out = np.zeros_like(k)
    kp = k > 0
    if kp.any():
        kk = k[kp]
        out[kp] = np.exp(_log_ive(v + 1.0, kk) - _log_ive(v, kk))  # the e^-k scalings cancel
    return out


def _to_np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float64).numpy()


class _LogVMFNormalizer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kappa: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.save_for_backward(kappa)
        ctx.dim = dim
        val = _log_normalizer_np(_to_np(kappa), dim)
        return torch.from_numpy(val).to(device=kappa.device, dtype=kappa.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        (kappa,) = ctx.saved_tensors
        ratio = torch.from_numpy(_bessel_ratio_np(_to_np(kappa), ctx.dim)).to(kappa.device, kappa.dtype)
        return -grad_out * ratio, None


def _check_kappa(kappa, name: str = "kappa") -> torch.Tensor:
    kappa = check_tensor(kappa, name, floating=True)
    if kappa.numel() and not bool(torch.isfinite(kappa).all()):
        raise ValueError(f"{name}: contains non-finite values")
    if kappa.numel() and bool((kappa < 0).any()):
        raise ValueError(f"{name}: concentrations must be >= 0, got minimum {float(kappa.min())}")
    return kappa


def _check_dim(dim) -> int:
    check_positive(dim, "dim", integer=True)
    if dim < 2:
        raise ValueError(f"dim: the vMF needs an ambient dimension >= 2, got {dim}")
    return dim


def log_vmf_normalizer(kappa: torch.Tensor, dim: int) -> torch.Tensor:
    """``log C_M(kappa)`` of the vMF on S^{dim-1} [Kirchhof, eq. (11)], any shape, differentiable in kappa.

    Args:
        kappa: concentrations ``>= 0``, float tensor of any shape.
        dim: ambient dimension ``M >= 2`` (embedding size).

    Returns:
        tensor of ``kappa``'s shape, dtype and device; gradient ``-A_M(kappa)``.
    """
    kappa = _check_kappa(kappa)
    return _LogVMFNormalizer.apply(kappa, _check_dim(dim))


def vmf_mean_resultant_length(kappa: torch.Tensor, dim: int) -> torch.Tensor:
    """``A_M(kappa) = I_{M/2}(kappa) / I_{M/2-1}(kappa)``, the mean of ``mu^T x`` (not differentiable)."""
    kappa = _check_kappa(kappa)
    dim = _check_dim(dim)
    return torch.from_numpy(_bessel_ratio_np(_to_np(kappa), dim)).to(kappa.device, kappa.dtype)


def vmf_log_prob(x: torch.Tensor, mu: torch.Tensor, kappa: torch.Tensor) -> torch.Tensor:
    """``log C_M(kappa) + kappa mu^T x`` for unit ``x (..., M)``, unit ``mu (..., M)``, ``kappa (...)``."""
    x = check_tensor(x, "x", min_ndim=1, floating=True)
    mu = check_tensor(mu, "mu", min_ndim=1, floating=True)
    kappa = _check_kappa(kappa)
    return log_vmf_normalizer(kappa, x.shape[-1]) + kappa * (x * mu).sum(-1)


# -- sampling -------------------------------------------------------------------------------------


def _randn(shape, generator, device, dtype):
    gen_device = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, device=gen_device, dtype=dtype).to(device)


def _rand(shape, generator, device, dtype):
    gen_device = generator.device if generator is not None else device
    return torch.rand(shape, generator=generator, device=gen_device, dtype=dtype).to(device)


def _wood_b(kappa: torch.Tensor, m: int) -> torch.Tensor:
    # b = (-2k + sqrt(4k^2 + (m-1)^2)) / (m-1), written without cancellation for large k.
    c = float(m - 1)
    big = kappa > math.sqrt(torch.finfo(kappa.dtype).max) / 4.0
    if not bool(big.any()):
        return c / (2.0 * kappa + torch.sqrt(4.0 * kappa * kappa + c * c))
    # Where 4 k^2 would overflow: b = t / (1 + sqrt(1 + t^2)) with t = (m-1) / (2k), the same value.
    # Each branch sees only its own entries (a NaN in the unused branch would leak into the gradient).
    k_small = torch.where(big, torch.zeros_like(kappa), kappa)
    k_big = torch.where(big, kappa, torch.ones_like(kappa))
    t = (0.5 * c) / k_big
    return torch.where(
        big, t / (1.0 + torch.sqrt(1.0 + t * t)), c / (2.0 * k_small + torch.sqrt(4.0 * k_small * k_small + c * c))
    )


def _wood_accepted_z(kappa: torch.Tensor, m: int, generator, max_rounds: int = 1000) -> torch.Tensor:
    """Accepted Beta((m-1)/2, (m-1)/2) proposals of Wood's algorithm, one per entry of ``kappa``."""
    # Wood's test ``k w + (m-1) log(1 - x0 w) - c >= log u`` with ``c = k x0 + (m-1) log(1 - x0^2)``
    # cancels numbers of size k (and 1 - x0 rounds to 0) for large k. Written with
    # ``1 - x0 = 2b/(1+b)``, ``1 - w = 2bz/(1-(1-b)z)`` and ``1 - x0 w = (1 - x0)(1 + x0 r)`` where
    # ``r = (1-w)/(1-x0) = z(1+b)/(1-(1-b)z)``, it reads
    #     k ((1-x0) - (1-w)) + (m-1) (log1p(x0 r) - log(1 + x0)) >= log u,
    # the same inequality, with every term bounded as k grows (k b -> (m-1)/4).
    with torch.no_grad():
        k = kappa.reshape(-1).to(torch.float64)
        b = (m - 1) / (2.0 * k + torch.hypot(2.0 * k, torch.full_like(k, float(m - 1))))
        x0 = (1.0 - b) / (1.0 + b)
        omx0 = 2.0 * b / (1.0 + b)
        log_opx0 = math.log(2.0) - torch.log1p(b)
        z = torch.empty_like(k)
        pending = torch.ones_like(k, dtype=torch.bool)
        for _ in range(max_rounds):
            n = int(pending.sum())
            if n == 0:
                return z.reshape(kappa.shape).to(kappa.dtype)
            g = _randn((2, n, m - 1), generator, k.device, torch.float64).pow(2).sum(-1)
            prop = g[0] / (g[0] + g[1])
            kb, bb, x0b = k[pending], b[pending], x0[pending]
            den = 1.0 - (1.0 - bb) * prop
            omw = 2.0 * bb * prop / den
            r = prop * (1.0 + bb) / den
            u = _rand((n,), generator, k.device, torch.float64)
            lhs = kb * (omx0[pending] - omw) + (m - 1) * (torch.log1p(x0b * r) - log_opx0[pending])
            accept = lhs >= torch.log(u)
            idx = torch.nonzero(pending).flatten()
            z[idx[accept]] = prop[accept]
            pending[idx[accept]] = False
        raise RuntimeError(f"sample_vmf: rejection sampler did not finish in {max_rounds} rounds")


def sample_vmf(mu: torch.Tensor, kappa, n_samples: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Draw ``n_samples`` vMF samples per ``(mu, kappa)`` pair with Wood's (1994) algorithm.

    Args:
        mu: mean directions ``(M,)`` or ``(B, M)``; normalised to unit length inside.
        kappa: concentrations ``>= 0``: a number, a 0-d tensor, or ``(B,)`` / ``(B, 1)``.
        n_samples: samples per pair.
        generator: optional ``torch.Generator`` for reproducibility.

    Returns:
        ``(n_samples, M)`` for 1-D ``mu``, else ``(n_samples, B, M)``; unit vectors in ``mu``'s dtype.
        Differentiable w.r.t. ``mu`` (exact) and ``kappa`` (reparameterised part only, see module doc).
    """
    mu = check_tensor(mu, "mu", ndim=(1, 2), floating=True, finite=True, nonempty=True)
    check_positive(n_samples, "n_samples", integer=True)
    squeeze = mu.dim() == 1
    mu2 = mu.unsqueeze(0) if squeeze else mu
    batch, m = mu2.shape
    if m < 2:
        raise ValueError(f"mu: the vMF needs dimension >= 2, got {m}")
    norm = mu2.norm(dim=1, keepdim=True)
    if bool((norm == 0).any()):
        raise ValueError("mu: mean directions must be non-zero vectors")
    mu2 = mu2 / norm
    if not isinstance(kappa, torch.Tensor):
        kappa = torch.tensor(float(kappa), dtype=mu.dtype, device=mu.device)
    kappa = _check_kappa(kappa)
    kappa = kappa.reshape(-1) if kappa.numel() != 1 else kappa.reshape(1).expand(batch)
    if kappa.shape[0] != batch:
        raise ValueError(f"kappa: expected 1 or {batch} values (one per mu), got {kappa.shape[0]}")
    kappa = kappa.to(mu.device, mu.dtype)

    kap = kappa.unsqueeze(0).expand(n_samples, batch)  # (S, B)
    z = _wood_accepted_z(kap.detach(), m, generator)  # (S, B), no grad
    b = _wood_b(kap, m)
    w = (1.0 - (1.0 + b) * z) / (1.0 - (1.0 - b) * z)  # grad w.r.t. kappa
    v = _randn((n_samples, batch, m - 1), generator, mu.device, mu.dtype)
    v = v / v.norm(dim=-1, keepdim=True)
    radial = torch.sqrt(((1.0 - w) * (1.0 + w)).clamp(min=1e-30))
    x = torch.cat([w.unsqueeze(-1), radial.unsqueeze(-1) * v], dim=-1)  # around e1
    # Householder reflection H = I - 2 u u^T with u = (e1 - mu)/||e1 - mu|| maps e1 to mu.
    e1 = torch.zeros_like(mu2)
    e1[:, 0] = 1.0
    u = e1 - mu2
    u_norm = u.norm(dim=1, keepdim=True)
    is_e1 = u_norm < 1e-12
    u = u / torch.where(is_e1, torch.ones_like(u_norm), u_norm)
    proj = (x * u).sum(-1, keepdim=True)
    x = torch.where(is_e1.unsqueeze(0), x, x - 2.0 * proj * u)
    return x.squeeze(1) if squeeze else x
