"""Every registered head keeps the head contract (as scikit-learn's estimator checks do for estimators).

Each ``check_*`` below states one rule of the contract (``shiftguard.heads.base.Head``) and runs on
every name in ``HEAD_NAMES``, fitted the one way the evaluation grid fits every head:
``fit(train, train_labels, *validation)`` with the inputs its ``input`` names and the validation set
where it ``uses_validation``. Each check also runs on a head built to break that one rule, and must
reject it: a check that cannot fail checks nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from shiftguard.heads import (
    EMBEDDING_HEADS,
    HEAD_INPUTS,
    HEAD_NAMES,
    LOGIT_HEADS,
    EmbeddingHead,
    Head,
    LogitHead,
    NotFittedError,
    build_head,
    head_class,
    head_input,
)

C, D, N_TRAIN, N_VAL, N_QUERY = 3, 5, 60, 30, 25


@dataclass
class Problem:
    """A small random classification problem in the inputs a head reads."""

    train: tuple[torch.Tensor, torch.Tensor]
    val: tuple[torch.Tensor, torch.Tensor]
    query: torch.Tensor


def problem(input: str, seed: int = 0) -> Problem:
    """Three Gaussian classes: logits ``(N, C)`` near ``3 * onehot``, or embeddings ``(N, D)``."""
    g = torch.Generator().manual_seed(seed)
    width = C if input == "logits" else D
    centres = 3.0 * torch.eye(C, width)

    def sample(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.arange(n) % C
        return centres[y] + torch.randn(n, width, generator=g), y

    return Problem(sample(N_TRAIN), sample(N_VAL), sample(N_QUERY)[0])


def fitted(head: Head, prob: Problem, seed: int = 0) -> Head:
    """``head`` fitted as the grid fits every head (the global RNG seeded, as the grid does)."""
    torch.manual_seed(seed)
    return head.fit(*prob.train, *(prob.val if head.uses_validation else ()))


def probabilities(head: Head, prob: Problem, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return head.predict_proba(prob.query)


# ------------------------------------------------------------------------------------------ the checks
Make = Callable[[], Head]


def check_declares_what_it_reads(make: Make) -> None:
    head = make()
    assert head.input in HEAD_INPUTS, f"{type(head).__name__}.input = {head.input!r}, not one of {HEAD_INPUTS}"
    base = LogitHead if head.input == "logits" else EmbeddingHead
    assert isinstance(head, base), f"{type(head).__name__} reads {head.input} but is no {base.__name__}"
    assert not head.needs_validation or head.uses_validation, "needs_validation without uses_validation"


def check_probabilities_are_rows_on_the_simplex(make: Make) -> None:
    prob = problem(make().input)
    p = probabilities(fitted(make(), prob), prob)
    assert isinstance(p, torch.Tensor) and p.shape == (N_QUERY, C), f"shape {tuple(p.shape)}, expected {(N_QUERY, C)}"
    assert torch.isfinite(p).all(), "non-finite probabilities"
    assert (p >= 0).all(), f"negative probabilities (min {float(p.min())})"
    sums = p.sum(1).double()
    assert torch.allclose(sums, torch.ones_like(sums), atol=1e-5), f"rows sum to {sums.min():.6f}..{sums.max():.6f}"


def check_predict_is_the_argmax_of_predict_proba(make: Make) -> None:
    prob = problem(make().input)
    head = fitted(make(), prob)
    p = probabilities(head, prob)
    torch.manual_seed(0)
    assert torch.equal(head.predict(prob.query), p.argmax(1)), "predict differs from predict_proba's argmax"


def check_validation_is_read_or_refused_as_declared(make: Make) -> None:
    head = make()
    prob = problem(head.input)
    if not head.uses_validation:
        try:
            head.fit(*prob.train, *prob.val)
        except ValueError as exc:
            assert f"val_{head.input}" in str(exc), f"the refusal does not name val_{head.input}: {exc}"
        else:
            raise AssertionError(f"{type(head).__name__} (uses_validation=False) accepted validation data")
        return
    # a head that reads its validation set answers differently when that set says something else
    shuffled = Problem(prob.train, (prob.val[0], prob.val[1].roll(1)), prob.query)
    p = probabilities(fitted(make(), prob), prob)
    q = probabilities(fitted(make(), shuffled), shuffled)
    assert not torch.allclose(p, q), f"{type(head).__name__} (uses_validation=True) ignores its validation data"


def check_fits_without_training_data_only_if_it_says_so(make: Make) -> None:
    head = make()
    prob = problem(head.input)
    no_train = Problem((None, None), prob.val, prob.query)  # type: ignore[arg-type]
    if head.needs_support:
        try:
            fitted(head, no_train)
        except (TypeError, ValueError) as exc:
            assert "train_" in str(exc), f"the refusal does not name the training data: {exc}"
        else:
            raise AssertionError(f"{type(head).__name__} (needs_support=True) was fitted without training data")
        return
    _on_the_simplex(probabilities(fitted(head, no_train), prob))


def _on_the_simplex(p: torch.Tensor) -> None:
    assert p.shape == (N_QUERY, C) and (p >= 0).all() and torch.allclose(p.sum(1), torch.ones(N_QUERY), atol=1e-5)


def check_refitting_gives_the_same_probabilities(make: Make) -> None:
    prob = problem(make().input)
    head = fitted(make(), prob)
    first = probabilities(head, prob)
    again = probabilities(fitted(head, prob), prob)  # the same instance, refitted
    fresh = probabilities(fitted(make(), prob), prob)  # a new instance
    assert torch.equal(first, again), "refitting the same head on the same data changed its probabilities"
    assert torch.equal(first, fresh), "two heads fitted alike on the same data disagree"


def check_unfitted_predict_proba_is_a_clear_error(make: Make) -> None:
    head = make()
    query = problem(head.input).query
    try:
        head.predict_proba(query)
    except NotFittedError as exc:
        assert type(head).__name__ in str(exc) and "fit" in str(exc), f"unclear message: {exc}"
    else:
        raise AssertionError(f"an unfitted {type(head).__name__} answered predict_proba")


CHECKS = [
    check_declares_what_it_reads,
    check_probabilities_are_rows_on_the_simplex,
    check_predict_is_the_argmax_of_predict_proba,
    check_validation_is_read_or_refused_as_declared,
    check_fits_without_training_data_only_if_it_says_so,
    check_refitting_gives_the_same_probabilities,
    check_unfitted_predict_proba_is_a_clear_error,
]


# ------------------------------------------------------------------------------------------ every registered head
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", HEAD_NAMES)
def test_every_registered_head_keeps_the_contract(name, check):
    check(lambda: build_head(name, C, k=5))


@pytest.mark.parametrize("name", HEAD_NAMES)
def test_the_lists_of_heads_follow_the_classes_declarations(name):
    cls = head_class(name)
    assert isinstance(build_head(name, C), cls)
    assert head_input(name) == cls.input
    assert (name in LOGIT_HEADS) == (cls.input == "logits") and (name in EMBEDDING_HEADS) == (cls.input == "embeddings")


# ------------------------------------------------------------------------------------------ each check can fail
class Prototype(EmbeddingHead):
    """A correct head: softmax of minus the squared distances to the class means."""

    def fit(self, train_embeddings, train_labels, val_embeddings=None, val_labels=None):
        self._no_validation(val_embeddings, val_labels)
        emb, y, num_classes = self._check_fit_inputs(train_embeddings, train_labels)
        self.means_ = torch.stack([emb[y == c].mean(0) for c in range(num_classes)])
        self.num_classes_ = num_classes
        return self

    def predict_proba(self, embeddings) -> torch.Tensor:
        self._check_is_fitted()
        emb = self._check_query(embeddings, self.means_.shape[1])
        return torch.softmax(-(torch.cdist(emb, self.means_) ** 2), dim=1)


class ReadsFeatures(Prototype):
    input = "features"


class LogitsButEmbeddingBase(Prototype):
    input = "logits"


class Unnormalised(Prototype):
    def predict_proba(self, embeddings):
        return 2 * super().predict_proba(embeddings)


class Negative(Prototype):
    def predict_proba(self, embeddings):
        p = super().predict_proba(embeddings)
        return p + 0.1 * (torch.arange(p.shape[1]) == 0).float() - 0.1 * (torch.arange(p.shape[1]) == 1).float()


class WrongShape(Prototype):
    def predict_proba(self, embeddings):
        return super().predict_proba(embeddings)[:, :-1].softmax(1)


class ArgminPredict(Prototype):
    def predict(self, embeddings):
        return self.predict_proba(embeddings).argmin(1)


class SwallowsValidation(Prototype):
    def fit(self, train_embeddings, train_labels, val_embeddings=None, val_labels=None):
        return super().fit(train_embeddings, train_labels)


class IgnoresDeclaredValidation(SwallowsValidation):
    uses_validation = True


class FitsOnNothing(Prototype):
    def fit(self, train_embeddings, train_labels, val_embeddings=None, val_labels=None):
        self.means_ = torch.zeros(C, D)
        self.num_classes_ = C
        return self


class Drifts(Prototype):
    fits = 0

    def fit(self, *args, **kwargs):
        Drifts.fits += 1  # a state outside the data and the seed
        super().fit(*args, **kwargs)
        self.means_ = self.means_ + 0.01 * Drifts.fits
        return self


class AnswersUnfitted(Prototype):
    def predict_proba(self, embeddings):
        if not hasattr(self, "means_"):
            return torch.full((embeddings.shape[0], C), 1.0 / C)
        return super().predict_proba(embeddings)


BROKEN = [
    (check_declares_what_it_reads, ReadsFeatures),
    (check_declares_what_it_reads, LogitsButEmbeddingBase),
    (check_probabilities_are_rows_on_the_simplex, Unnormalised),
    (check_probabilities_are_rows_on_the_simplex, Negative),
    (check_probabilities_are_rows_on_the_simplex, WrongShape),
    (check_predict_is_the_argmax_of_predict_proba, ArgminPredict),
    (check_validation_is_read_or_refused_as_declared, SwallowsValidation),
    (check_validation_is_read_or_refused_as_declared, IgnoresDeclaredValidation),
    (check_fits_without_training_data_only_if_it_says_so, FitsOnNothing),
    (check_refitting_gives_the_same_probabilities, Drifts),
    (check_unfitted_predict_proba_is_a_clear_error, AnswersUnfitted),
]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_each_check_passes_a_correct_head(check):
    check(lambda: Prototype(num_classes=C))


@pytest.mark.parametrize(("check", "broken"), BROKEN, ids=lambda x: x.__name__)
def test_each_check_rejects_a_head_that_breaks_its_rule(check, broken):
    with pytest.raises(AssertionError):
        check(lambda: broken(num_classes=C))


def test_every_check_has_a_head_it_rejects():
    assert {check for check, _ in BROKEN} == set(CHECKS)
