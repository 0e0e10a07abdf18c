"""L-BFGS over a flat float64 parameter vector: SciPy's optimiser, torch autograd (or the caller) for the gradient.

The heads fit at most a few thousand parameters; SciPy's L-BFGS-B is robust and its import is
cheap (constructing the first ``torch.optim`` optimiser costs seconds of one-off import time).

SciPy's optimiser runs on one BLAS thread (``threadpoolctl``, scikit-learn's own dependency, limits
numpy's and SciPy's BLAS libraries for the duration of the call and restores them after). Its BLAS
calls work on vectors and matrices of a few thousand entries, where a second thread costs more than
it saves, and the BLAS threads then compete for the cores with torch's OpenMP workers, which keep
spinning for a while after each operator of the objective: on 2 cores, fitting the logistic head
on 8,000 x 84 embeddings took 123-166 ms with BLAS on two threads and 37 ms with one, torch on two
threads whose workers spin 10,000 iterations (``docs/performance.md``, "Threads").
"""

from __future__ import annotations

import sys
from typing import Callable, Union

import numpy as np
import torch
from scipy.optimize import minimize
from threadpoolctl import ThreadpoolController

__all__ = ["minimize_lbfgs"]

# one controller while no module is imported: finding the loaded BLAS libraries costs ~6 ms, a
# limit ~15 us. A library loaded later (faiss-cpu brings its own OpenBLAS) arrives with an import,
# so a grown sys.modules means the controller is built again, or that library would keep its threads.
_CONTROLLER: list[tuple[ThreadpoolController, int]] = []


def one_blas_thread():
    """A context in which every loaded BLAS library (numpy's, SciPy's, any other) runs on one thread."""
    if not _CONTROLLER or _CONTROLLER[0][1] != len(sys.modules):
        _CONTROLLER[:] = [(ThreadpoolController(), len(sys.modules))]
    return _CONTROLLER[0][0].limit(limits=1, user_api="blas")


def minimize_lbfgs(
    loss_fn: Callable[[torch.Tensor], Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]],
    x0: torch.Tensor,
    max_iter: int = 500,
    gtol: float = 1e-8,
    with_grad: bool = False,
) -> tuple[torch.Tensor, float, int]:
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

    with one_blas_thread():
        res = minimize(
            fun,
            x0.detach().cpu().double().numpy(),
            jac=True,
            method="L-BFGS-B",
            options={"maxiter": max_iter, "gtol": gtol, "ftol": 1e-15},
        )
    return torch.from_numpy(res.x).to(device), float(res.fun), int(res.nit)
