"""Adversarial shift as an axis of the evaluation grid, beside the corruptions ([NED, Sec. 5]).

An attack (``shiftguard.adversarial.AttackSpec``: FGSM, BIM or PGD, L-inf or L2) at budget
``eps`` is a cell ``(attack name, i, "adversarial")`` of the grid, ``i = 1..len(eps)`` indexing
the budgets (``results["data"]["attacks"][name]["eps"][i - 1]``). Unlike a corruption, the shifted
images depend on the model: each (model, context) is attacked white-box, in the context it is
scored in (a QACT model in the batch context is attacked with the evaluation batch as its
context), and every head of that model is scored on the same adversarial images. The attack
ascends the loss of the model's outputs:

- a model with logits: cross-entropy on the logits (log-probabilities of an estimator work as
  logits);
- an embedding model: ``loss(embeddings, labels)`` given per model (``run``: the model's trained
  embedding loss, as [NED, Sec. 5] attacks its metric-learning models through their training
  loss; ``evaluate``: ``attack_loss=``).

A *transfer* cell ``"<attack>@<source>"`` (``transfer_from=``) scores every model on the images
the white-box attack made on model ``source`` (in its first context): a black-box attack on the
other models, the check that tells robustness from gradient masking (Athalye, Carlini & Wagner
2018, Sec. 3.1; Papernot et al. 2017): a model that keeps accuracy under its own white-box attack
but loses more to images made on another model has an uninformative gradient, not robustness.

Adversarial cells never enter the corruption means (mCA, mCE, the bootstrap intervals, the pooled
reliability diagrams); the report shows them in a table of their own.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from shiftguard._rng import seeded
from shiftguard.adversarial import AttackSpec

from .cell import Cell
from .entry import ModelEntry

__all__ = ["ADVERSARIAL", "AttackSuite", "attack_specs"]

#: The ``group`` of adversarial cells.
ADVERSARIAL = "adversarial"

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def attack_specs(attacks: Sequence[Union[str, AttackSpec]], steps: Optional[int] = None) -> list[AttackSpec]:
    """``attacks`` as specs: names are parsed (``AttackSpec.parse``, with ``steps`` when given);
    duplicates and targeted attacks (a grid has no target classes) are errors naming ``attacks``."""
    if isinstance(attacks, (str, AttackSpec)):
        raise TypeError("attacks: expected a list of attack names or AttackSpecs, got a single one")
    specs = []
    for a in attacks:
        if isinstance(a, AttackSpec):
            spec = a
        elif isinstance(a, str):
            try:
                spec = AttackSpec.parse(a, **({"steps": steps} if steps is not None else {}))
            except ValueError as exc:
                raise ValueError(f"attacks: {exc}") from None
        else:
            raise TypeError(f"attacks: expected attack names or AttackSpecs, got {type(a).__name__}")
        if spec.targeted:
            raise ValueError(f"attacks: {spec.name!r} is targeted; the evaluation grid attacks untargeted")
        specs.append(spec)
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"attacks: {', '.join(dup)} given twice (one spec per attack name)")
    return specs


def _check_eps(eps: Sequence[float]) -> list[float]:
    if isinstance(eps, (int, float)):
        raise TypeError("attack_eps: expected a list of budgets, got a single number")
    out = []
    for e in eps:
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not 0.0 < float(e) < float("inf"):
            raise ValueError(f"attack_eps: expected finite budgets > 0 (eps 0 is the clean set), got {e!r}")
        out.append(float(e))
    if not out:
        raise ValueError("attack_eps: at least one budget is needed when attacks are given")
    if len(set(out)) != len(out):
        raise ValueError(f"attack_eps: a budget is given twice in {out}")
    return sorted(out)


class _Embedder(nn.Module):
    """``model.embed`` as a module, so that an attack can differentiate the embedding."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self._embed: Callable[[torch.Tensor], torch.Tensor] = getattr(model, "embed")  # noqa: B009

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._embed(x)


class _LogProbabilities(nn.Module):
    """A model returning class probabilities as one returning their logarithms (its logits)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .outputs import log_probabilities

        return log_probabilities(self.model(x))


class AttackSuite:
    """The adversarial cells of a grid and the images of each, per (model, context).

    Args:
        specs: untargeted attacks (:func:`attack_specs`).
        eps: the budgets, in pixel units of images in [0, 1] (``2 / 255`` is two grey levels).
        test: ``(images, labels)`` of the clean test set (uint8 or float pixels).
        losses: per model name, the loss the attack ascends on that model's EMBEDDINGS, or None
            to attack its logits with cross-entropy (a model without logits needs one).
        seed: seed of PGD's random start (the same for every cell).
        batch_size: images per attack batch (the context of QACT models in the batch context).
        transfer_from: names of models whose white-box images are also scored on every model, as
            cells ``"<attack>@<source>"`` (module docstring).
    """

    def __init__(
        self,
        specs: Sequence[AttackSpec],
        eps: Sequence[float],
        test: tuple[torch.Tensor, torch.Tensor],
        losses: Optional[Mapping[str, Optional[LossFn]]] = None,
        seed: int = 0,
        batch_size: int = 500,
        device: Union[str, torch.device] = "cpu",
        transfer_from: Sequence[str] = (),
    ):
        self.specs = {s.name: s for s in specs}
        self.eps = _check_eps(eps)
        self.test_x, self.test_y = test
        self.losses = dict(losses or {})
        self.seed = seed
        self.batch_size = batch_size
        self.device = torch.device(device)
        if isinstance(transfer_from, str):
            raise TypeError("transfer_from: expected a list of model names, got a single str")
        self.sources = list(dict.fromkeys(transfer_from))
        self._entries: dict[str, ModelEntry] = {}
        self._digests: dict[str, str] = {}
        self._last: Optional[tuple] = None  # (cell name, index, images): cells are scored cell-major

    def _split(self, name: str) -> tuple[str, Optional[str]]:
        base, _, source = name.partition("@")
        return base, (source or None)

    def cells(self) -> list[Cell]:
        """``(attack name, i, "adversarial")`` for every attack and budget index ``i`` (1-based),
        then the transfer cells ``("<attack>@<source>", i, "adversarial")``."""
        names = [*self.specs, *(f"{n}@{src}" for src in self.sources for n in self.specs)]
        return [Cell(name, i, ADVERSARIAL) for name in names for i in range(1, len(self.eps) + 1)]

    def key(self, name: str, index: int) -> str:
        """The output-cache key of a cell: every parameter that changes its images (for a transfer
        cell, also the source model's weights and buffers)."""
        base, source = self._split(name)
        s = self.specs[base].with_eps(self.eps[index - 1])
        key = (
            f"{base}-eps{s.eps:.6g}-steps{s.steps}-step{s.step_size if s.step_size is not None else 'auto'}"
            f"-start{int(bool(s.random_start))}-seed{self.seed}"
        )
        if source is not None:
            key += f"-from-{source}-{self._digests[source][:16]}"
        return key

    def describe(self) -> dict:
        """The protocol of each attack, for ``results["data"]["attacks"]``; a transfer cell's entry
        names its ``source`` model."""
        out = {
            name: {
                "attack": s.attack,
                "norm": s.norm,
                "eps": list(self.eps),
                "steps": s.steps,
                "step_size": s.step_size,
                "random_start": bool(s.random_start),
                "seed": self.seed,
            }
            for name, s in self.specs.items()
        }
        for src in self.sources:
            for name in self.specs:
                out[f"{name}@{src}"] = {**out[name], "source": src, "transfer": True}
        return out

    def check_models(self, entries: Sequence[ModelEntry]) -> None:
        """Every model can be attacked: it has logits, or a loss on its embeddings is given, and its
        parameters can be differentiated; every ``transfer_from`` source is one of the models."""
        from .cache import _state_digest

        self._entries = {m.name: m for m in entries}
        unknown = [s for s in self.sources if s not in self._entries]
        if unknown:
            raise ValueError(
                f"transfer_from: no model named {', '.join(map(repr, unknown))}; models: "
                f"{', '.join(map(repr, self._entries))}"
            )
        self._digests = {s: _state_digest(self._entries[s].model) for s in self.sources}
        for m in entries:
            if any(p.is_inference() for p in m.model.parameters()):
                raise ValueError(
                    f"attacks: model {m.name!r} has parameters created under torch.inference_mode(), "
                    "which autograd cannot differentiate; build the model outside inference mode"
                )
            if self.losses.get(m.name) is None and not m.outputs.has_logits:
                raise ValueError(
                    f"attack_loss: model {m.name!r} returns embeddings; attacking it needs a loss on "
                    "its embeddings (e.g. its training loss), none was given"
                )

    def __call__(self, entry: ModelEntry, context: str, name: str, index: int) -> torch.Tensor:
        """Adversarial test images of cell ``(name, index)`` for model ``entry`` (same dtype as the
        test images); call it inside the model's QACT context. A transfer cell's images are made on
        its source model, in the source's first context, once for every model scored on them."""
        base, source = self._split(name)
        if source is None:
            return self._craft(entry, base, index)
        if self._last is None or self._last[:2] != (name, index):
            from shiftguard.nn import has_qact, qact_context

            src = self._entries[source]
            ctx = list(src.contexts or ["batch"])[0] if has_qact(src.model) else "batch"
            with qact_context(src.model, "batch" if ctx == "none" else ctx):
                self._last = (name, index, self._craft(src, base, index))
        return self._last[2]

    def _craft(self, entry: ModelEntry, name: str, index: int) -> torch.Tensor:
        outs = entry.outputs
        loss = self.losses.get(entry.name)
        model = entry.model
        if loss is not None and outs.output != "embedding":
            model = _Embedder(model) if callable(getattr(model, "embed", None)) else model
        elif outs.output == "probabilities":
            model = _LogProbabilities(model)
        spec = self.specs[name].with_eps(self.eps[index - 1])
        # the pixels in the model's dtype, then the user's preprocess: float64 pixels attack a float32
        # model (and the reverse) as its own evaluation feeds it. An evaluation called under
        # torch.inference_mode() or no_grad() still needs input gradients here: both are lifted for
        # the attack, and images made under inference mode are copied into ordinary tensors.
        # The global RNG is fixed to seed 0 for the attack's passes, as for every other pass of the
        # grid (QACT draws its sampling seeds from it): the images do not depend on the caller's
        # random stream, which is restored after.
        with torch.inference_mode(False), torch.enable_grad(), seeded(0, self.device):
            x = self.test_x.clone() if self.test_x.is_inference() else self.test_x
            y = self.test_y.clone() if self.test_y.is_inference() else self.test_y
            return spec.run(
                model,
                x,
                y,
                preprocess=outs.model_input,
                loss_fn=loss,
                seed=self.seed,
                batch_size=self.batch_size,
                device=self.device,
            )
