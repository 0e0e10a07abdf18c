"""Every registered head keeps the head contract (as scikit-learn's estimator checks do for estimators).

Each ``check_*`` below states one rule of the contract (``shiftguard.heads.base.Head``) and runs on
every name in ``HEAD_NAMES``, fitted the one way the evaluation grid fits every head:
``fit(train, train_labels, *validation)`` with the inputs its ``input`` names and the validation set
where it ``uses_validation``. Each check also runs on a head built to break that one rule, and must
reject it: a check that cannot fail checks nothing.

The last checks are scikit-learn's habits (``sklearn.utils.estimator_checks`` checks the same of its
estimators): ``__init__`` stores its arguments unchanged and ``fit`` validates them, ``get_params``
round-trips through the constructor, ``clone`` gives an unfitted head that fits alike, and a fitted
head has ``classes_``, one label per column of ``predict_proba``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pytest
import torch

from shiftguard._validation import check_positive
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
    clone,
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


def _same_params(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for name, x in a.items():
        y = b[name]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)):
                return False
        elif x is not y and x != y:
            return False
    return True


def _learned_state(head: Head) -> list[str]:
    """The attributes ``fit`` sets: a trailing underscore, no leading one (scikit-learn's convention)."""
    return sorted(n for n in vars(head) if n.endswith("_") and not n.startswith("_"))


def check_get_params_round_trips_through_the_constructor(make: Make) -> None:
    head = make()
    name = type(head).__name__
    try:
        params = head.get_params()
        again = type(head)(**params)
        round_trip = again.get_params()
    except (AttributeError, TypeError) as exc:
        raise AssertionError(f"{name}: get_params does not name what __init__ takes and stores: {exc}") from exc
    for key, value in params.items():
        # scikit-learn's clone asks the same: the constructor stores each argument as it is given
        assert round_trip[key] is value, f"{name}.__init__ stores {key}={value!r} as {round_trip[key]!r}"
    assert _same_params(type(head)().set_params(**params).get_params(), params), f"{name}.set_params loses a value"


def check_clone_is_an_unfitted_head_that_fits_alike(make: Make) -> None:
    prob = problem(make().input)
    head = fitted(make(), prob)
    twin = clone(head)
    name = type(head).__name__
    assert type(twin) is type(head), f"clone of a {name} is a {type(twin).__name__}"
    assert not _learned_state(twin), f"a clone of a fitted {name} has learned state {_learned_state(twin)}"
    assert _same_params(twin.get_params(), head.get_params()), f"a clone of {name} has other parameters"
    p = probabilities(head, prob)
    assert torch.equal(probabilities(fitted(twin, prob), prob), p), f"a clone of {name} fitted alike answers otherwise"


def check_classes_after_fit(make: Make) -> None:
    head = make()
    name = type(head).__name__
    assert not hasattr(head, "classes_"), f"an unfitted {name} has classes_"
    prob = problem(head.input)
    p = probabilities(fitted(head, prob), prob)
    classes = getattr(head, "classes_", None)
    assert isinstance(classes, torch.Tensor), f"a fitted {name} has no classes_ tensor (got {classes!r})"
    assert classes.shape == (p.shape[1],), (
        f"classes_ has shape {tuple(classes.shape)}, predict_proba {p.shape[1]} columns"
    )
    assert torch.equal(classes.cpu(), torch.arange(p.shape[1])), f"classes_ = {classes.tolist()}, not the labels"
    assert head.num_classes_ == classes.numel(), f"num_classes_ = {head.num_classes_}, {classes.numel()} classes_"


#: A bad value for each head parameter of that name: the constructor must accept it, ``fit`` refuse
#: it with one line that begins with the parameter's name.
BAD_VALUES: dict[str, Any] = {
    "num_classes": 0,
    "k": 0,
    "fit_mode": "cv",
    "holdout_fraction": 1.5,
    "max_fit_queries": 0,
    "seed": "0",
    "backend": "annoy",
    "searches": {},
    "kind": "uniform",
    "C": -1.0,
    "max_iter": 0,
    "tol": -1.0,
    "init_log_rho": math.nan,
    "proxies": torch.zeros(C, D + 1),
    "logit_fn": "softmax",
    "classifier_kwargs": ["n_samples"],
    "fit_kwargs": 30,
    "temperature": -1.0,
}


def check_parameters_are_validated_by_fit_not_by_the_constructor(make: Make) -> None:
    head = make()
    name = type(head).__name__
    prob = problem(head.input)
    bad = {key: BAD_VALUES[key] for key in head.get_params() if key in BAD_VALUES}
    assert "num_classes" in bad, f"{name} has no num_classes parameter"
    for key, value in bad.items():
        try:
            broken = type(head)(**{**head.get_params(), key: value})
        except (TypeError, ValueError) as exc:
            raise AssertionError(f"{name}({key}={value!r}) raised in __init__, not in fit: {exc}") from exc
        try:
            fitted(broken, prob)
        except (TypeError, ValueError) as exc:
            assert str(exc).startswith(f"{key}:"), f"{name}({key}={value!r}).fit: the error does not name {key}: {exc}"
            assert "\n" not in str(exc), f"{name}({key}={value!r}).fit: a message of several lines: {exc}"
        else:
            raise AssertionError(f"{name}({key}={value!r}).fit accepted the bad value")


CHECKS = [
    check_declares_what_it_reads,
    check_probabilities_are_rows_on_the_simplex,
    check_predict_is_the_argmax_of_predict_proba,
    check_validation_is_read_or_refused_as_declared,
    check_fits_without_training_data_only_if_it_says_so,
    check_refitting_gives_the_same_probabilities,
    check_unfitted_predict_proba_is_a_clear_error,
    check_get_params_round_trips_through_the_constructor,
    check_clone_is_an_unfitted_head_that_fits_alike,
    check_classes_after_fit,
    check_parameters_are_validated_by_fit_not_by_the_constructor,
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
    """A correct head: softmax of minus the squared distances to the class means over ``temperature``."""

    def __init__(self, temperature: float = 1.0, num_classes: Optional[int] = None):
        super().__init__(num_classes)
        self.temperature = temperature

    def _validate_params(self) -> None:
        super()._validate_params()
        check_positive(self.temperature, "temperature")

    def fit(self, train_embeddings, train_labels, val_embeddings=None, val_labels=None):
        self._validate_params()
        self._no_validation(val_embeddings, val_labels)
        emb, y, num_classes = self._check_fit_inputs(train_embeddings, train_labels)
        self.means_ = torch.stack([emb[y == c].mean(0) for c in range(num_classes)])
        self._set_classes(num_classes, emb.device)
        return self

    def predict_proba(self, embeddings) -> torch.Tensor:
        self._check_is_fitted()
        emb = self._check_query(embeddings, self.means_.shape[1])
        return torch.softmax(-(torch.cdist(emb, self.means_) ** 2) / self.temperature, dim=1)


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


class ChangesItsArgument(Prototype):
    def __init__(self, temperature: float = 1.0, num_classes: Optional[int] = None):
        super().__init__(2 * temperature, num_classes)  # stores something else than it was given


class RenamesItsArgument(Prototype):
    def __init__(self, tau: float = 1.0, num_classes: Optional[int] = None):
        super().__init__(tau, num_classes)  # kept as .temperature: get_params cannot find "tau"


class MisreportsItsParameters(Prototype):
    def __init__(self, temperature: float = 0.3, num_classes: Optional[int] = None):
        super().__init__(temperature, num_classes)

    def get_params(self, deep=True):
        return {**super().get_params(deep), "temperature": 1.0}  # a clone is built with another value


class FittedAtBirth(Prototype):
    def __init__(self, temperature: float = 1.0, num_classes: Optional[int] = None):
        super().__init__(temperature, num_classes)
        self.history_: list = []  # learned state made by the constructor survives a clone


class WithoutClasses(Prototype):
    def fit(self, *args, **kwargs):
        super().fit(*args, **kwargs)
        del self.classes_
        return self


class ClassesOneTooMany(Prototype):
    def fit(self, *args, **kwargs):
        super().fit(*args, **kwargs)
        self.classes_ = torch.arange(self.num_classes_ + 1)
        return self


class ValidatesInInit(Prototype):
    def __init__(self, temperature: float = 1.0, num_classes: Optional[int] = None):
        super().__init__(temperature, num_classes)
        self._validate_params()


class NeverValidates(Prototype):
    def _validate_params(self) -> None:
        pass


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
    (check_get_params_round_trips_through_the_constructor, ChangesItsArgument),
    (check_get_params_round_trips_through_the_constructor, RenamesItsArgument),
    (check_clone_is_an_unfitted_head_that_fits_alike, MisreportsItsParameters),
    (check_clone_is_an_unfitted_head_that_fits_alike, FittedAtBirth),
    (check_classes_after_fit, WithoutClasses),
    (check_classes_after_fit, ClassesOneTooMany),
    (check_parameters_are_validated_by_fit_not_by_the_constructor, ValidatesInInit),
    (check_parameters_are_validated_by_fit_not_by_the_constructor, NeverValidates),
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
