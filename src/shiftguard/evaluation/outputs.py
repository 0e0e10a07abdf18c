"""What a model says about a batch of pixels: its logits and its embedding.

shiftguard evaluates *any* ``nn.Module``; this module decides, once per model, where its logits
and its embedding come from (:class:`ModelOutputs`) and runs it over an image set in a fixed
batch order (:func:`compute_outputs`).

- ``output="logits"`` (default): ``model(x)`` are the logits ``(N, C)``. The embedding is, by
  default, the input of the last ``nn.Linear`` the forward pass calls (the classifier's input),
  captured by forward pre-hooks; ``embed="layer.name"`` takes that submodule's output instead
  (flattened to ``(N, D)``), ``embed=callable`` calls ``embed(x)`` on the model input, and
  ``embed=False`` uses no embedding (logit heads only). Models following shiftguard's own
  ``embed()`` / ``classifier`` contract (``shiftguard.models``) use it: one pass gives both.
- ``output="embedding"``: ``model(x)`` is the embedding; there are no logits (embedding heads only).
- ``output="probabilities"``: ``model(x)`` are class probabilities (non-negative rows summing to
  1, e.g. a model ending in a softmax); their logarithms serve as the logits (a softmax of them
  gives the probabilities back), so every logit head and the attacks' cross-entropy work on them.

Pixels reach the model as floats in [0, 1] (uint8 / 255) in the dtype of the model's first
floating parameter (float32 for a model without one), then ``preprocess`` (the user's
normalisation, resizing, ...) is applied -- after any corruption, as ImageNet-C and robustbench do.
Every output must have one row per input image: a model that returns more or fewer rows is an
error naming it, never scored against shifted labels.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
from torch import nn

from shiftguard._rng import seeded

__all__ = ["ModelOutputs", "OUTPUTS", "batch_order", "compute_outputs", "in_input_order", "model_dtype"]

#: What ``model(x)`` may return (``ModelOutputs(output=...)``).
OUTPUTS = ("logits", "embedding", "probabilities")
#: How far from 1 a row of ``output="probabilities"`` may sum (float32 softmax rounding is ~1e-6).
PROBABILITY_TOLERANCE = 1e-3


def model_dtype(model: nn.Module) -> torch.dtype:
    """The floating dtype ``model`` computes in: its first floating parameter's, else its first
    floating buffer's, else float32."""
    for t in (*model.parameters(), *model.buffers()):
        if t.is_floating_point():
            return t.dtype
    return torch.float32


EmbedSpec = Union[None, bool, str, Callable[[torch.Tensor], torch.Tensor]]


class ModelOutputs:
    """Logits and embeddings of ``model`` for one input batch.

    Args:
        model: any ``nn.Module``.
        embed: where the embedding comes from (module docstring); ``None`` = the default.
        output: ``"logits"``, ``"embedding"`` or ``"probabilities"``: what ``model(x)`` returns.
        preprocess: callable applied to the float pixel batch before the model (``None``: none).

    ``has_logits`` / ``has_embeddings`` say what :meth:`__call__` returns; ``embedding_source``
    names it in words (for reports).
    """

    def __init__(
        self,
        model: nn.Module,
        embed: EmbedSpec = None,
        output: str = "logits",
        preprocess: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        if output not in OUTPUTS:
            raise ValueError(f"output: expected one of {', '.join(map(repr, OUTPUTS))}, got {output!r}")
        if preprocess is not None and not callable(preprocess):
            raise TypeError(f"preprocess: expected a callable or None, got {type(preprocess).__name__}")
        self.model = model
        self.output = output
        self.preprocess = preprocess
        self.dtype = model_dtype(model)
        self._embed = embed
        self._layer: Optional[nn.Module] = None
        self._embed_fn: Optional[Callable] = None
        self._own_contract = False
        if output == "embedding":
            if embed not in (None, True):
                raise ValueError(
                    "embed: with output='embedding' the model's output is the embedding; leave embed unset"
                )
            self.has_logits, self.has_embeddings, self.embedding_source = False, True, "the model's output"
            return
        self.has_logits = True
        if embed is False:
            self.has_embeddings, self.embedding_source = False, "none (embed=False)"
        elif isinstance(embed, str):
            modules = dict(model.named_modules())
            if embed not in modules or embed == "":
                names = [n for n in modules if n][:12]
                raise ValueError(
                    f"embed: model has no submodule named {embed!r}; some of its names: {', '.join(names)}"
                )
            self._layer = modules[embed]
            self.has_embeddings, self.embedding_source = True, f"output of {embed!r}"
        elif callable(embed):
            self._embed_fn = embed
            self.has_embeddings, self.embedding_source = True, f"embed={getattr(embed, '__name__', 'callable')}"
        elif embed is None or embed is True:
            if callable(getattr(model, "embed", None)) and isinstance(getattr(model, "classifier", None), nn.Module):
                self._own_contract = True
                self.has_embeddings, self.embedding_source = True, "model.embed()"
            elif any(isinstance(m, nn.Linear) for m in model.modules()):
                self.has_embeddings, self.embedding_source = True, "input of the last nn.Linear called"
            else:
                self.has_embeddings, self.embedding_source = False, "none (the model has no nn.Linear)"
        else:
            raise TypeError(f"embed: expected None, False, a submodule name or a callable, got {type(embed).__name__}")

    @property
    def rebindable(self) -> bool:
        """Whether :meth:`rebind` can give the same outputs of another model: not with a callable
        ``embed``, which is bound to the model it was written for."""
        return self._embed_fn is None

    def rebind(self, model: nn.Module) -> "ModelOutputs":
        """The same recipe (``embed``, ``output``, ``preprocess``) applied to ``model``, e.g. a copy
        of this one: a submodule name is looked up again in ``model``.

        Raises:
            ValueError: when ``embed`` is a callable (:attr:`rebindable`).
        """
        if not self.rebindable:
            raise ValueError(
                "embed: a callable embedding reads the model it was written for; give the name of a submodule instead"
            )
        return ModelOutputs(model, embed=self._embed, output=self.output, preprocess=self.preprocess)

    def model_input(self, pixels: torch.Tensor) -> torch.Tensor:
        """Floating pixels in [0, 1] as the model takes them: in its dtype, then ``preprocess``
        (differentiable: the attacks take gradients through it)."""
        x = pixels.to(self.dtype)
        return self.preprocess(x) if self.preprocess is not None else x

    def _model_input(self, pixels: torch.Tensor, device) -> torch.Tensor:
        x = pixels.to(device)
        x = x.to(self.dtype).div_(255.0) if x.dtype == torch.uint8 else x.to(self.dtype)
        return self.preprocess(x) if self.preprocess is not None else x

    def __call__(self, pixels: torch.Tensor, device="cpu") -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(embeddings (N, D) | None, logits (N, C) | None)``, float32 on ``device``, no graph."""
        emb, logits = self.raw(pixels, device)
        return (None if emb is None else _as_2d(emb)), (None if logits is None else _as_2d(logits))

    def raw(self, pixels: torch.Tensor, device="cpu") -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(embeddings | None, logits | None)`` as the model returns them: on ``device``, in the
        model's dtype and shape, attached to the autograd graph when gradients are enabled (what a
        test-time adaptation step differentiates)."""
        x = self._model_input(pixels, device)
        emb, out = self._forward(x)
        n = pixels.shape[0]
        for t, what in ((emb, f"the embedding ({self.embedding_source})"), (out, "model(x)")):
            if t is not None and t.shape[0] != n:
                raise ValueError(
                    f"model: {what} has {t.shape[0]} rows for a batch of {n} images; the model must "
                    "return one row per input image (outputs would be scored against other images' "
                    "labels)"
                )
        if self.output == "probabilities" and out is not None:
            out = log_probabilities(out)
        return emb, out

    def _forward(self, x: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        if self.output == "embedding":
            return _checked(self.model(x), "model output"), None
        if self._own_contract:
            # embed and classifier were checked at construction (a callable and a module); nn.Module's
            # __getattr__ is typed Tensor | Module, which the type checker cannot call.
            emb = self.model.embed(x)  # type: ignore[operator]
            logits = self.model.classifier(emb)  # type: ignore[operator]
            return _checked(emb, "model.embed(x)"), _checked(logits, "model.classifier")
        if self._embed_fn is not None:
            return _checked(self._embed_fn(x), "embed(x)"), _checked(self.model(x), "model(x)")
        if not self.has_embeddings:
            return None, _checked(self.model(x), "model(x)")
        captured: dict = {}
        handles = []
        if self._layer is not None:
            handles.append(self._layer.register_forward_hook(lambda m, i, o: captured.__setitem__("emb", o)))
        else:

            def pre_hook(module, inputs):
                captured["emb"] = inputs[0]  # every Linear overwrites: the last one called wins

            handles += [m.register_forward_pre_hook(pre_hook) for m in self.model.modules() if isinstance(m, nn.Linear)]
        try:
            logits = self.model(x)
        finally:
            for h in handles:
                h.remove()
        if "emb" not in captured:
            where = self.embedding_source
            raise RuntimeError(f"embed: the forward pass never reached the embedding layer ({where})")
        return _checked(captured["emb"], self.embedding_source), _checked(logits, "model(x)")


def looks_like_probabilities(out: torch.Tensor) -> bool:
    """Whether every row of ``out`` ``(N, C)`` is non-negative and sums to 1 (within
    :data:`PROBABILITY_TOLERANCE`): the output of a softmax, not logits."""
    out = out.detach().reshape(out.shape[0], -1).double()
    return bool(
        out.numel()
        and out.shape[1] > 1
        and (out >= 0).all()
        and ((out.sum(1) - 1).abs() <= PROBABILITY_TOLERANCE).all()
    )


def log_probabilities(p: torch.Tensor) -> torch.Tensor:
    """``log p`` of the class probabilities ``p`` (N, C) a model returned with
    ``output="probabilities"``, as logits; refuses rows that are not probabilities."""
    flat = p.reshape(p.shape[0], -1)
    if not looks_like_probabilities(flat):
        bad = (flat.detach() < 0).any(1) | ((flat.detach().double().sum(1) - 1).abs() > PROBABILITY_TOLERANCE)
        i = int(torch.nonzero(bad)[0]) if bad.any() else 0
        raise ValueError(
            f"output: 'probabilities' was given, but row {i} of model(x) is not a probability vector "
            f"(min {float(flat[i].min()):.4g}, sum {float(flat[i].double().sum()):.6g})"
        )
    return torch.log(flat.clamp_min(torch.finfo(flat.dtype).tiny))


def _checked(t, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a tensor, got {type(t).__name__}")
    if t.dim() < 2:
        raise ValueError(f"{what}: expected a batch (N, ...), got shape {tuple(t.shape)}")
    return t


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(t.shape[0], -1).float()


def batch_order(n: int, batch_size: int, order_seed: Optional[int] = 0, device=None) -> tuple[torch.Tensor, list[int]]:
    """``(order, bounds)``: the order in which :func:`compute_outputs` feeds ``n`` images to a model
    and its batch boundaries (batch ``i`` is ``order[bounds[i]:bounds[i + 1]]``).

    A fixed random permutation (``order_seed``; ``None`` keeps the file order), cut into batches of
    ``batch_size``; a last batch of fewer than ``batch_size / 2`` images is merged into the previous
    one, so every batch (the context of QACT and of batch-statistics BatchNorm) holds at least half
    a batch. The permutation is drawn on the CPU (the same on every device) and placed on
    ``device`` (the images' device, so that indexing them moves nothing; None: the CPU)."""
    if order_seed is None:
        order = torch.arange(n)
    else:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(order_seed))
    bounds = list(range(0, n, batch_size)) + [n]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] < batch_size // 2:
        del bounds[-2]
    return (order if device is None else order.to(device)), bounds


def in_input_order(batches: list[torch.Tensor], order: torch.Tensor) -> torch.Tensor:
    """The rows of ``batches``, computed for the images ``order`` (:func:`batch_order`) in turn, put
    back in the images' order, on the batches' device."""
    rows = torch.cat(batches)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return rows[inv.to(rows.device)]


@torch.no_grad()
def compute_outputs(
    outputs: ModelOutputs, images: torch.Tensor, batch_size: int, device="cpu", order_seed: Optional[int] = 0
) -> dict:
    """``{"embeddings": (N, D) or None, "logits": (N, C) or None}`` of ``images`` in eval mode.

    Batches are drawn in a fixed random order (``order_seed``; ``None`` keeps the file order) and
    the outputs put back in input order: for QACT the batch is the context [QACT, Sec. 3], and a
    class-sorted test file must not give class-pure contexts. A last batch of fewer than
    ``batch_size / 2`` images is merged into the previous one, so every context holds at least
    half a batch. The global RNG (QACT's KDE draws) is fixed to seed 0 inside and restored after,
    so the same call gives the same outputs without disturbing the caller's random stream.
    The outputs stay on ``device`` (the heads are fitted and scored there); ``images`` may be on
    the host or on ``device``, a batch at a time is moved.
    """
    outputs.model.eval()
    with seeded(0, device):
        n = images.shape[0]
        order, bounds = batch_order(n, batch_size, order_seed, device=images.device)
        # Each batch returns embeddings exactly when outputs.has_embeddings, logits when has_logits.
        embs: list[torch.Tensor] = []
        logits: list[torch.Tensor] = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            e, lg = outputs(images[order[a:b]], device)
            if e is not None:
                embs.append(e)
            if lg is not None:
                logits.append(lg)
    return {
        "embeddings": in_input_order(embs, order) if outputs.has_embeddings else None,
        "logits": in_input_order(logits, order) if outputs.has_logits else None,
    }
