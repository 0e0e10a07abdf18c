"""L-BFGS over a flat float64 parameter vector: SciPy's optimiser, torch autograd (or the caller) for the gradient.

The heads fit at most a few thousand parameters; SciPy's L-BFGS-B is robust and its import is
cheap (constructing the first ``torch.optim`` optimiser costs seconds of one-off import time).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from scipy.optimize import minimize

__all__ = ["minimize_lbfgs"]


def minimize_lbfgs(loss_fn: Callable[[torch.Tensor], torch.Tensor], x0: torch.Tensor, max_iter: int = 500,
                   gtol: float = 1e-8, with_grad: bool = False) -> tuple[torch.Tensor, float, int]:
    """Minimise ``loss_fn(params)`` from ``x0`` (float64, 1-D); returns ``(params, loss, n_iter)``.

    ``with_grad``: ``loss_fn`` returns ``(loss, gradient)`` itself (an analytic gradient); otherwise
    the gradient is taken by autograd."""
    device = x0.device

    def fun(theta: np.ndarray):
        if with_grad:
            loss, grad = loss_fn(torch.from_numpy(theta).to(device))
        else:
            p = torch.from_numpy(theta).to(device).requires_grad_(True)
            loss = loss_fn(p)
            (grad,) = torch.autograd.grad(loss, p)
        return float(loss.detach()), grad.detach().cpu().numpy().astype(np.float64)

    res = minimize(fun, x0.detach().cpu().double().numpy(), jac=True, method="L-BFGS-B",
                   options={"maxiter": max_iter, "gtol": gtol, "ftol": 1e-15})
    return torch.from_numpy(res.x).to(device), float(res.fun), int(res.nit)
