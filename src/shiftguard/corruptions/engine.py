"""The corruption engine: suites, names, :func:`corrupt` and :func:`warm_up` (the package's API,
re-exported by ``shiftguard.corruptions``; see its docstring for the contract)."""

from __future__ import annotations

import time
from typing import Optional

import numpy as np
import torch

from shiftguard._numba import AVAILABLE as NUMBA_AVAILABLE
from shiftguard.corruptions.cifar_c import CIFAR_C, CIFAR_C_EXTRA
from shiftguard.corruptions.mnist_c import MNIST_C
from shiftguard.corruptions.registry import CorruptionSpec
from shiftguard.registry import Registry

__all__ = [
    "SUITES",
    "SUITE_REGISTRY",
    "CORRUPTION_REGISTRIES",
    "CorruptionSpec",
    "names",
    "get",
    "canonical_name",
    "canonical_suite",
    "corrupt",
    "warm_up",
    "CHUNK",
]

#: The suites by name: ``suite -> {corruption name -> CorruptionSpec}`` (benchmark order). Suite
#: and corruption names are matched ignoring case, ``-``, ``_`` and spaces (:func:`canonical_name`).
SUITE_REGISTRY: Registry[dict[str, CorruptionSpec]] = Registry("suite", argument="suite")
SUITE_REGISTRY.register("mnist-c", MNIST_C)
SUITE_REGISTRY.register("cifar-c", CIFAR_C)
SUITE_REGISTRY.register("cifar-c-extra", CIFAR_C_EXTRA)

SUITES: dict[str, dict[str, CorruptionSpec]] = SUITE_REGISTRY.as_dict()

#: The corruptions of each suite: ``suite -> Registry(corruption name -> CorruptionSpec)``.
CORRUPTION_REGISTRIES: dict[str, Registry[CorruptionSpec]] = {}
for _suite, _table in SUITES.items():
    CORRUPTION_REGISTRIES[_suite] = Registry(f"{_suite} corruption", argument="name")
    for _name, _spec in _table.items():
        CORRUPTION_REGISTRIES[_suite].register(_name, _spec)

# Every corruption name of every suite -> the suites that have it (a name may be in several).
_ANY_SUITE: Registry[list[str]] = Registry("corruption", argument="name")
for _suite, _table in SUITES.items():
    for _name in _table:
        if _name in _ANY_SUITE:
            _ANY_SUITE.get(_name).append(_suite)
        else:
            _ANY_SUITE.register(_name, [_suite])
del _suite, _table, _name, _spec


def _canonical(registry: Registry, name, argument: Optional[str] = None) -> str:
    """``registry``'s canonical name for ``name``, whitespace between words a separator like ``-``
    and ``_`` (``"motion blur"`` is ``"motion_blur"``)."""
    return registry.canonical(name, argument=argument, words=True)


def canonical_suite(suite: str, *, argument: str = "suite") -> str:
    """The registered name of corruption suite ``suite`` (``"MNIST_C"``, ``"mnist c"`` ->
    ``"mnist-c"``).

    Raises ``TypeError`` (not a str) or ``ValueError`` (unknown: the message lists the suites and
    suggests the closest), naming ``argument``.
    """
    return _canonical(SUITE_REGISTRY, suite, argument)


def canonical_name(
    name: str, suite: Optional[str] = None, *, channels: Optional[int] = None, argument: str = "name"
) -> str:
    """The registered name of corruption ``name``: case, ``-``, ``_`` and spaces do not matter
    (``"Motion-Blur"``, ``"motion blur"``, ``"MOTION_BLUR"`` -> ``"motion_blur"``). Every entry point
    that takes corruption names (:func:`corrupt`, ``shiftguard.evaluate(corruptions=)``, the run
    config, the command line) resolves them here, so results carry one spelling.

    ``suite`` (any spelling, see :func:`canonical_suite`) restricts the lookup to that suite; a
    qualified ``"suite/name"`` does the same. Otherwise the name may come from any suite
    (``channels`` picks the suite of a name two suites share, as in :func:`get`).

    Raises:
        TypeError: ``name`` or ``suite`` is not a str.
        ValueError: an unknown suite or corruption, in one line naming ``argument`` (or ``suite``)
            that lists the valid names and suggests the closest.
    """
    return get(name, suite, channels, argument=argument).name


#: Images processed per step (bounds memory; the random stream continues across chunks).
CHUNK = 8192


def names(suite: str = "cifar-c", *, extra: bool = False) -> list[str]:
    """Corruption names of ``suite`` in benchmark order (``extra=True`` appends the 4 CIFAR-10-C
    extras to ``"cifar-c"``).

    Raises ``TypeError`` / ``ValueError`` naming ``suite`` for a non-str or unknown suite (the
    message lists the suites), ``ValueError`` naming ``extra`` for extras of another suite.
    """
    out = list(SUITE_REGISTRY.get(canonical_suite(suite)))
    if extra:
        if canonical_suite(suite) != "cifar-c":
            raise ValueError(f"extra: only the 'cifar-c' suite has extra corruptions, got suite={suite!r}")
        out += list(CIFAR_C_EXTRA)
    return out


def get(
    name: str, suite: Optional[str] = None, channels: Optional[int] = None, *, argument: str = "name"
) -> CorruptionSpec:
    """The :class:`CorruptionSpec` for ``name``.

    ``suite`` may be given, or a qualified name ``"mnist-c/fog"`` used. Otherwise the suite is
    inferred: names that exist in both MNIST-C and CIFAR-10-C (shot_noise, impulse_noise,
    glass_blur, motion_blur, brightness, fog, spatter) resolve to MNIST-C for one-channel images
    and to CIFAR-10-C otherwise. Names are matched ignoring case, ``-``, ``_`` and spaces
    (:func:`canonical_name`).

    Raises:
        TypeError: ``name`` or ``suite`` is not a str.
        ValueError: an unknown suite or corruption; the message names the argument (``argument``
            for the corruption), lists the valid names (of ``suite`` where one is given) and
            suggests the closest.
    """
    if not isinstance(name, str):
        raise TypeError(f"{argument}: expected a string, got {type(name).__name__}")
    if "/" in name and suite is None:
        suite, name = name.split("/", 1)
    if suite is not None:
        table = CORRUPTION_REGISTRIES[canonical_suite(suite)]
        return table.get(_canonical(table, name, argument))
    name = _canonical(_ANY_SUITE, name, argument)
    found = _ANY_SUITE.get(name)
    if len(found) > 1:
        pick = "mnist-c" if channels == 1 else next(s for s in found if s != "mnist-c")
    else:
        pick = found[0]
    return CORRUPTION_REGISTRIES[pick].get(name)


def _check_images(images) -> torch.Tensor:
    if not isinstance(images, torch.Tensor):
        raise TypeError(f"images: expected a torch.Tensor (N, C, H, W), got {type(images).__name__}")
    if images.dim() != 4:
        raise ValueError(f"images: expected 4 dimensions (N, C, H, W), got shape {tuple(images.shape)}")
    if images.dtype != torch.uint8 and not images.is_floating_point():
        raise TypeError(f"images: expected dtype uint8 or floating point, got {images.dtype}")
    if images.shape[1] not in (1, 3):
        raise ValueError(f"images: expected 1 or 3 channels (N, C, H, W), got C={images.shape[1]}")
    if images.shape[2] < 8 or images.shape[3] < 8:
        raise ValueError(f"images: expected H, W >= 8, got shape {tuple(images.shape)}")
    from shiftguard.data.convert import check_pixels  # lazy: data and corruptions are sibling leaves

    return check_pixels(images, "images")  # one aminmax pass for floats; uint8 is valid by its dtype


def _check_severity(severity) -> int:
    if isinstance(severity, bool) or not isinstance(severity, int):
        try:
            import numpy as np

            if isinstance(severity, np.integer):
                severity = int(severity)
            else:
                raise TypeError
        except TypeError:
            raise TypeError(f"severity: expected an int in 0..5, got {type(severity).__name__}") from None
    if not 0 <= severity <= 5:
        raise ValueError(f"severity: expected 0..5 (0 = clean), got {severity}")
    return severity


def _check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: expected an int, got {type(seed).__name__}")
    return seed


def corrupt(
    images,
    name: str,
    severity: int,
    seed: int = 0,
    *,
    suite: Optional[str] = None,
    params=None,
):
    """Corrupt a batch of images.

    The return type follows the input's: tensor in, tensor out; ``ImageDataset`` in, a new
    ``ImageDataset`` out (corrupted images; the same labels, classes, name, split and transform;
    ``meta`` plus ``corruption``, ``suite``, ``severity``, ``seed`` and, when given, ``params``);
    any other form :func:`shiftguard.data.as_tensors` reads (a torch ``Dataset`` of
    ``(image, label)`` pairs, a ``DataLoader``, a tuple ``(images, labels)``) in, the tuple
    ``(corrupted images, labels)`` out, whatever the dtype. For another layout or a subset, call
    ``as_tensors`` first.

    Args:
        images: a tensor ``(N, C, H, W)`` with C in {1, 3}, H, W >= 8; ``uint8`` (0..255) or
            float in [0, 1] (float16/bfloat16 are computed in float32); or a labelled form above.
        name: corruption name (see :func:`names`), optionally qualified as ``"suite/name"``.
        severity: 1..5, or 0 for the unchanged images (a copy).
        seed: seed of the ``torch.Generator`` (on the images' device) driving all randomness.
        suite: ``"mnist-c"``, ``"cifar-c"`` or ``"cifar-c-extra"``; inferred when omitted (see
            :func:`get`).
        params: advanced: use this parameter setting instead of the suite's entry for
            ``severity`` (same structure as ``get(name).params[i]``), e.g. the ImageNet-C constants
            in :data:`.cifar_c.IMAGECORRUPTIONS_PARAMS` for comparisons with that package.

    Returns:
        A new tensor with the shape, dtype and device of ``images``, clipped to the valid range
        (or an ``ImageDataset`` / ``(images, labels)`` holding it, see above).

    Raises:
        TypeError: ``images`` of another type or dtype; a non-int ``severity`` or ``seed``.
        ValueError: a wrong shape; float pixels outside [0, 1] (the message gives the min and
            max found) or not finite (how many); an unknown name or suite; severity outside 0..5.

    Examples:
        >>> import torch
        >>> x = torch.randint(0, 256, (4, 1, 28, 28), dtype=torch.uint8)
        >>> y = corrupt(x, "fog", severity=3, seed=0)
        >>> y.shape, y.dtype, torch.equal(y, corrupt(x, "fog", severity=3, seed=0))
        (torch.Size([4, 1, 28, 28]), torch.uint8, True)
    """
    if not isinstance(images, torch.Tensor):
        return _corrupt_labelled(images, name, severity, seed, suite=suite, params=params)
    images = _check_images(images)
    spec = get(name, suite, channels=images.shape[1])
    severity = _check_severity(severity)
    _check_seed(seed)
    if severity == 0 or images.shape[0] == 0:
        return images.clone()
    work = torch.float64 if images.dtype == torch.float64 else torch.float32
    gen = torch.Generator(device=images.device)
    gen.manual_seed(seed)
    out = torch.empty_like(images)
    with torch.no_grad():
        for start in range(0, images.shape[0], CHUNK):
            chunk = images[start : start + CHUNK]
            if images.dtype == torch.uint8 and spec.u8 is not None:
                p = spec.params[severity - 1] if params is None else params
                y = spec.u8(chunk, p, gen, min(chunk.shape[-2:]) / spec.ref_size)
                if images.shape[0] <= CHUNK:
                    return y  # a new tensor already: spare the copy
                out[start : start + CHUNK] = y
                continue
            x = chunk.to(work, copy=True)  # our own buffer: the ops below may work in place
            if images.dtype == torch.uint8:
                x = x.div_(255.0)  # float input is in [0, 1] already (_check_images)
            if params is None:
                y = spec(x, severity, gen)
            else:
                y = spec.fn(x, params, gen, min(x.shape[-2:]) / spec.ref_size)
            # in place: these passes dominate the cost of the cheap corruptions
            y = y.nan_to_num_(0.0).clamp_(0, 1)
            if images.dtype == torch.uint8:
                y = y.mul_(255).round_()
            out[start : start + CHUNK].copy_(y)
    return out


def _corrupt_labelled(data, name, severity, seed, *, suite, params):
    """:func:`corrupt` for an ``ImageDataset`` (returns one) or any form ``as_tensors`` reads."""
    import numpy as np

    from shiftguard.data import ImageDataset, as_tensors

    if isinstance(data, np.ndarray):
        raise TypeError(
            "images: expected a torch.Tensor (N, C, H, W) (torch.from_numpy converts an array), an ImageDataset "
            "or a labelled form shiftguard.data.as_tensors reads, got a numpy array"
        )
    # the arguments' errors first, before a possibly long pass over a Dataset
    get(name, suite)
    severity = _check_severity(severity)
    _check_seed(seed)
    if isinstance(data, ImageDataset):
        out = corrupt(data.images, name, severity, seed, suite=suite, params=params)
        spec = get(name, suite, channels=data.images.shape[1])
        meta = {**data.meta, "corruption": spec.name, "suite": spec.suite, "severity": severity, "seed": seed}
        if params is not None:
            meta["params"] = params
        return ImageDataset(out, data.labels, data.classes, data.name, data.split, data.transform, meta)
    images, labels = as_tensors(data, name="images")
    return corrupt(images, name, severity, seed, suite=suite, params=params), labels


def warm_up(dtypes=(torch.uint8, torch.float32), suites=("mnist-c", "cifar-c")) -> float:
    """Compile (or load from numba's disk cache) the corruption kernels; return the seconds taken.

    Runs every corruption of the ``mnist-c`` suite on two 1x28x28 images and of the ``cifar-c``
    suite (``cifar-c-extra`` too where ``suites`` names it) on two 3x32x32 images, at severity 3,
    once per dtype in ``dtypes`` (uint8 0..255, float in [0, 1]) and suite in ``suites``; the
    outputs are discarded and the global RNG is not used. The kernels compile on their
    first call per argument types (seconds on a machine whose cache is empty): called first, the
    compilation is a step of its own that a caller can time and announce, instead of a part of the
    first evaluation's time. A variant that a later input needs and these did not (another dtype)
    still compiles on its first call. Returns 0.0 at once without numba (the torch code runs:
    nothing to compile).

    Raises:
        ValueError: ``dtypes`` holds a dtype other than uint8 or a float one (those
            :func:`shiftguard.corruptions.corrupt` takes); ``suites`` names an unknown suite.
    """
    for dtype in dtypes:
        if not isinstance(dtype, torch.dtype) or (dtype != torch.uint8 and not dtype.is_floating_point):
            raise ValueError(f"dtypes: expected torch.uint8 or float dtypes, got {dtype}")
    if isinstance(suites, str):
        suites = (suites,)
    suites = tuple(canonical_suite(suite, argument="suites") for suite in suites)
    if not NUMBA_AVAILABLE:
        return 0.0
    t0 = time.perf_counter()
    for suite in suites:
        shape = (2, 1, 28, 28) if suite == "mnist-c" else (2, 3, 32, 32)
        # a deterministic image spanning the gray levels
        levels = (torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape) * 37 % 256) / 255.0
        for dtype in dtypes:
            x = (levels * 255).round().to(dtype) if dtype == torch.uint8 else levels.to(dtype)
            for name in names(suite):
                corrupt(x, name, 3, suite=suite)
    return time.perf_counter() - t0
