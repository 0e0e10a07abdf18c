"""Model outputs on disk, so an interrupted evaluation of a large grid resumes where it stopped.

Outputs are reused only for the evaluation that wrote them: each model's folder holds a
``fingerprint.json`` of everything that determines its outputs (:func:`fingerprint`: a digest of
the weights and buffers, of the test, support, validation and calibration images, of what ``preprocess`` does
to a fixed probe batch, and the batch size, output kind, embedding, corruption source and seed).
A folder whose fingerprint differs is refused with the fields that differ
(:func:`check_fingerprint`), never read: another model under the same name (every
``nn.Sequential`` is called ``Sequential``), other weights or other data would otherwise be scored
with the old outputs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from shiftguard.io import atomic_write, atomic_write_json

__all__ = ["OutputCache", "FINGERPRINT_FILE", "check_fingerprint", "fingerprint", "tensor_digest"]

#: The file in each model's cache folder that says which evaluation its outputs belong to.
FINGERPRINT_FILE = "fingerprint.json"


def tensor_digest(*tensors: Optional[torch.Tensor]) -> Optional[str]:
    """SHA-256 of the tensors' dtypes, shapes and bytes (None when every tensor is None)."""
    if all(t is None for t in tensors):
        return None
    h = hashlib.sha256()
    for t in tensors:
        if t is None:
            h.update(b"none")
            continue
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _state_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256(type(model).__qualname__.encode())
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(str(tensor_digest(t)).encode() if isinstance(t, torch.Tensor) else repr(t).encode())
    return h.hexdigest()


def _callable_name(fn) -> Optional[str]:
    if fn is None:
        return None
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def fingerprint(
    model: torch.nn.Module,
    *,
    test: tuple,
    support: Optional[tuple],
    validation: Optional[tuple],
    preprocess: Optional[Callable],
    probe: torch.Tensor,
    batch_size: int,
    output: str,
    embed: Any,
    corruption_source: str,
    seed: int,
    calibration: Optional[tuple] = None,
) -> dict:
    """What determines one model's cached outputs, as a JSON-able dict (module docstring).
    ``probe``: a fixed float batch shaped like the images, passed through ``preprocess``."""
    from shiftguard._version import __version__

    with torch.no_grad():
        probed = preprocess(probe.clone()) if preprocess is not None else probe
    return {
        "shiftguard": __version__,
        "model": type(model).__qualname__,
        "weights": _state_digest(model),
        "test": tensor_digest(*test),
        "support": tensor_digest(*support) if support is not None else None,
        "validation": tensor_digest(*validation) if validation is not None else None,
        "calibration": tensor_digest(*calibration) if calibration is not None else None,
        "preprocess": {
            "name": _callable_name(preprocess),
            "probe": tensor_digest(probed) if isinstance(probed, torch.Tensor) else repr(probed),
        },
        "batch_size": int(batch_size),
        "output": output,
        "embed": embed if embed is None or isinstance(embed, (bool, str)) else _callable_name(embed),
        "corruption_source": corruption_source,
        "seed": int(seed),
    }


def check_fingerprint(folder: Path, expected: dict, write: bool = True) -> None:
    """Refuse ``folder`` when it holds outputs of another evaluation than ``expected`` describes;
    record ``expected`` there when it holds none yet (``write``).

    Raises:
        ValueError: the folder's fingerprint differs (the message names the fields) or cannot be read.
    """
    path = Path(folder) / FINGERPRINT_FILE
    if path.is_file():
        try:
            found = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"cache_dir: {path} cannot be read ({type(exc).__name__}); delete the folder "
                f"{folder} or use another cache_dir"
            ) from None
        expected = json.loads(json.dumps(expected))
        if found != expected:
            keys = [k for k in sorted(set(found) | set(expected)) if found.get(k) != expected.get(k)]
            raise ValueError(
                f"cache_dir: {folder} holds the outputs of another evaluation ({', '.join(keys)} "
                "differ); use another cache_dir, or delete that folder to recompute"
            )
        return
    if any(p.suffix == ".pt" for p in Path(folder).rglob("*.pt")) if Path(folder).is_dir() else False:
        raise ValueError(
            f"cache_dir: {folder} holds outputs without a {FINGERPRINT_FILE} (of another evaluation, or "
            "of an older shiftguard); use another cache_dir, or delete that folder to recompute"
        )
    if write:
        atomic_write_json(path, expected)


class OutputCache:
    """Outputs of one (model, context) on disk: ``<root>/<key>.pt``, written atomically.

    A file that cannot be read (e.g. left by a killed process on a filesystem without atomic
    rename) is recomputed. ``enabled=False`` computes every time and writes nothing.
    """

    def __init__(self, root: str | Path, enabled: bool = True):
        self.root = Path(root)
        self.enabled = enabled
        self.hits = 0
        self.misses = 0

    def path(self, key: str) -> Path:
        return self.root / f"{key}.pt"

    def get_or_compute(self, key: str, fn: Callable[[], dict], device: Optional[torch.device] = None) -> dict:
        """The outputs ``fn()`` computes, read from ``<root>/<key>.pt`` when that file is there.

        The file holds host copies (the same bytes whatever device computed them); outputs read
        from it are moved to ``device`` (None: left on the host), computed ones returned as ``fn``
        made them."""
        p = self.path(key)
        if self.enabled and p.is_file():
            try:
                out = torch.load(p, map_location="cpu", weights_only=True)
                self.hits += 1
                return out if device is None else _map_tensors(out, lambda t: t.to(device))
            except Exception:  # damaged cache file: recompute it
                pass
        out = fn()
        self.misses += 1
        if self.enabled:
            on_host = _map_tensors(out, lambda t: t.cpu())
            atomic_write(p, lambda fh: torch.save(on_host, fh))
        return out


def _map_tensors(out: dict, fn: Callable[[torch.Tensor], torch.Tensor]) -> dict:
    return {k: fn(v) if isinstance(v, torch.Tensor) else v for k, v in out.items()}
