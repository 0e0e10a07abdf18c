"""Last-layer refit by multinomial logistic regression on train embeddings ([QACT, Sec. 4] "Remark":
"we retrain the last layer with logistic regression on the train embedding and evaluate it on
test/corrupted embedding").

The objective is scikit-learn's ``LogisticRegression(C=C)`` (multinomial, lbfgs, intercept not
penalised): ``C * sum_i CE(W z_i + b, y_i) + 0.5 * ||W||_F^2``. We minimise it with SciPy's
L-BFGS-B on a float64 torch objective (autograd gradient) instead of calling scikit-learn, because it runs on
any device, keeps tensors
in torch, and is several times faster on 10k x 128 embeddings (the agreement with scikit-learn is
tested). Features are standardised with the train mean/std first when ``standardize=True``
(default; scikit-learn users do the same with a ``StandardScaler``), which makes the fit
well-conditioned and fast.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from shiftguard._validation import check_positive
from shiftguard.heads._optim import minimize_lbfgs
from shiftguard.heads.base import EmbeddingHead

__all__ = ["LogisticRegressionHead"]


class LogisticRegressionHead(EmbeddingHead):
    """Multinomial logistic regression on embeddings.

    Args:
        C: inverse L2 strength as in scikit-learn (default 1.0).
        standardize: z-score the features with train statistics before the fit (default True).
        max_iter: L-BFGS iterations (default 500).
        tol: projected-gradient tolerance of L-BFGS-B on the objective divided by ``C * n``.
        num_classes: number of classes; inferred when None.

    Learned state: ``coef_ (C, D)``, ``intercept_ (C,)`` (in standardised units when
    ``standardize``), ``mean_``, ``scale_``, ``num_classes_``, ``classes_``, ``n_iter_``.
    """

    _param_names = ("C", "standardize", "max_iter", "num_classes")

    def __init__(
        self,
        C: float = 1.0,
        standardize: bool = True,
        max_iter: int = 500,
        tol: float = 1e-6,
        num_classes: Optional[int] = None,
    ):
        super().__init__(num_classes)
        self.C = C
        self.standardize = standardize
        self.max_iter = max_iter
        self.tol = tol

    def _validate_params(self) -> None:
        super()._validate_params()
        check_positive(self.C, "C")
        check_positive(self.max_iter, "max_iter", integer=True)
        check_positive(self.tol, "tol")

    def fit(self, train_embeddings, train_labels, val_embeddings=None, val_labels=None):
        """Fit on ``train_*`` (``val_*`` are refused: the protocol of [QACT] fits on train only)."""
        self._validate_params()
        self._no_validation(val_embeddings, val_labels)
        emb, y, num_classes = self._check_fit_inputs(train_embeddings, train_labels)
        x = emb.double()
        if self.standardize:
            self.mean_ = x.mean(0)
            std = x.std(0, unbiased=False)
            self.scale_ = torch.where(std > 0, std, torch.ones_like(std))
        else:
            self.mean_ = torch.zeros(x.shape[1], dtype=x.dtype, device=x.device)
            self.scale_ = torch.ones(x.shape[1], dtype=x.dtype, device=x.device)
        x = (x - self.mean_) / self.scale_
        n, d = x.shape

        onehot = F.one_hot(y, num_classes).to(x.dtype)

        def objective(theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # sklearn's objective divided by C * n, so the scale is O(1) for the tolerances:
            # f = mean_i [logsumexp(z_i) - z_{i, y_i}] + ||W||^2 / (2 C n),  z = x W^T + b,
            # with its gradient df/dW = (softmax(z) - onehot(y))^T x / n + W / (C n), df/db = column sums / n.
            w = theta[: num_classes * d].view(num_classes, d)
            b = theta[num_classes * d :]
            z = torch.addmm(b, x, w.t())
            lse = torch.logsumexp(z, dim=1)
            loss = (lse.sum() - z.gather(1, y.unsqueeze(1)).sum()) / n + 0.5 * (w * w).sum() / (self.C * n)
            g = torch.exp(z - lse.unsqueeze(1)).sub_(onehot).div_(n)
            grad_w = g.t() @ x + w / (self.C * n)
            return loss, torch.cat([grad_w.reshape(-1), g.sum(0)])

        theta0 = torch.zeros(num_classes * (d + 1), dtype=torch.float64, device=x.device)
        theta, _, self.n_iter_ = minimize_lbfgs(
            objective, theta0, max_iter=self.max_iter, gtol=self.tol, with_grad=True
        )
        self.coef_ = theta[: num_classes * d].view(num_classes, d).clone()
        self.intercept_ = theta[num_classes * d :].clone()
        self._set_classes(num_classes, emb.device)
        return self

    def decision_function(self, embeddings) -> torch.Tensor:
        """Logits ``(N, C)`` (feed them to ``TemperatureScaling(logit_fn=head.decision_function)``)."""
        self._check_is_fitted()
        emb = self._check_query(embeddings, self.coef_.shape[1])
        x = (emb.to(self.coef_.dtype) - self.mean_) / self.scale_
        return (x @ self.coef_.t() + self.intercept_).to(emb.dtype)

    def predict_proba(self, embeddings) -> torch.Tensor:
        return torch.softmax(self.decision_function(embeddings), dim=1)
