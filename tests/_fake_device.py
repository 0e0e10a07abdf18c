"""A second device on a CPU-only machine, for the tests of code that must keep tensors on the device.

:class:`FakeDevice` is a ``TorchDispatchMode`` under which ``torch.device("meta")`` behaves
like an accelerator whose memory is the CPU's: tensors moved there are :class:`DeviceTensor`
wrappers of CPU tensors, every operation on them runs the CPU kernel on the wrapped tensors and
wraps the results, and factories given ``device="meta"`` make wrapped tensors. What a GPU
refuses, it refuses: an operation mixing a device tensor with a CPU tensor of more than one element
(CUDA allows 0-dim CPU scalars, so does this), and ``.numpy()`` of a device tensor. Every copy to
the host (``.cpu()``, ``.to("cpu")``, ``copy_`` into a CPU tensor) and every scalar read
(``.item()``, ``float(t)``, ``.tolist()``, a tensor's truth value) is recorded in :attr:`FakeDevice.host_reads`
(:class:`HostRead`: kind, shape, the source line), so a test can bound what crosses back to the host;
every copy from the host to the device (``torch.tensor(data, device=)``, ``.to(device)`` of a CPU
tensor) in :attr:`FakeDevice.uploads`, and every generator made on the device in
:attr:`FakeDevice.generators` (the source line): neither is allowed while a CUDA graph is captured.

Code that branches on ``device.type == "cpu"`` takes its non-CPU path, as it would on a GPU; code
that branches on ``"cuda"`` (CUDA generators, Triton, cuDNN flags) is not exercised.
"""

from __future__ import annotations

import traceback
from typing import NamedTuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

DEVICE = torch.device("meta")
aten = torch.ops.aten
_INDEXING = (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default)


class DeviceTensor(torch.Tensor):
    """A tensor on :data:`DEVICE` holding a CPU tensor ``elem`` (usable only under :class:`FakeDevice`)."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.shape,
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            device=DEVICE,
            requires_grad=elem.requires_grad,
        )
        r.elem = elem
        return r

    def tolist(self):  # a GPU tensor's tolist() reads it back; so does this (recorded by the mode)
        return self.cpu().tolist()

    def __repr__(self) -> str:  # the CPU tensor's values, for assertion messages
        return f"DeviceTensor({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func}: a tensor on the fake device outside FakeDevice()")


_Generator = torch.Generator


class _DeviceGenerator(_Generator):
    """``torch.Generator(device=DEVICE)`` under the mode: a CPU generator. (The dispatcher hands a
    generator to the mode as a new Python object, so the mode cannot tell a device generator from a
    CPU one: a CPU generator drawing device tensors, which CUDA refuses, passes here.)"""

    def __new__(cls, device="cpu"):
        if _is_device(device):
            for mode in _ACTIVE:
                mode.generators.append(_caller())
        return _Generator.__new__(cls, device="cpu" if _is_device(device) else device)

    def __init__(self, device="cpu") -> None:
        pass


def _is_device(d) -> bool:
    return d is not None and torch.device(d).type == DEVICE.type


def _is_cpu(d) -> bool:
    return d is not None and torch.device(d).type == "cpu"


_ACTIVE: list["FakeDevice"] = []


class _Constructors(TorchFunctionMode):
    """``torch.tensor(data, device=DEVICE)`` and its kin build their tensor below the dispatcher;
    they are made on the CPU and moved (through :class:`FakeDevice`) instead."""

    FUNCTIONS = (torch.tensor, torch.as_tensor, torch.asarray)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in self.FUNCTIONS and _is_device(kwargs.get("device")):
            kwargs["device"] = torch.device("cpu")
            return func(*args, **kwargs).to(DEVICE)
        return func(*args, **kwargs)


class HostRead(NamedTuple):
    """One crossing between host and device: ``kind`` (``"copy"`` or ``"scalar"`` back to the host,
    ``"upload"`` to the device), the tensor's shape, and ``where``: the innermost ``shiftguard``
    source line that asked for it."""

    kind: str
    shape: tuple
    where: str


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()):
        if "/shiftguard/" in frame.filename and "/tests/" not in frame.filename:
            return f"{frame.filename.rsplit('/shiftguard/', 1)[1]}:{frame.lineno}"
    return "?"


class FakeDevice(TorchDispatchMode):
    """The mode that makes :data:`DEVICE` work; see the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.host_reads: list[HostRead] = []
        self.uploads: list[HostRead] = []
        self.generators: list[str] = []

    def __enter__(self):
        torch.Generator = _DeviceGenerator  # type: ignore[misc]
        _ACTIVE.append(self)
        self._constructors = _Constructors()
        self._constructors.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Generator = _Generator  # type: ignore[misc]
        _ACTIVE.remove(self)
        try:
            return super().__exit__(*exc)
        finally:
            self._constructors.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        leaves, _ = tree_flatten((args, kwargs))
        on_device = [t for t in leaves if isinstance(t, DeviceTensor)]
        if func is aten._to_copy.default:
            src, target = args[0], kwargs.get("device")
            if isinstance(src, DeviceTensor) and _is_cpu(target):
                self.host_reads.append(HostRead("copy", tuple(src.shape), _caller()))
                return func(src.elem, **kwargs)
            if not isinstance(src, DeviceTensor) and _is_device(target):
                self.uploads.append(HostRead("upload", tuple(src.shape), _caller()))
                kwargs["device"] = torch.device("cpu")
                return DeviceTensor(func(src, **kwargs))
        if (
            func in (aten.copy_.default,)
            and isinstance(args[1], DeviceTensor)
            and not isinstance(args[0], DeviceTensor)
        ):
            self.host_reads.append(HostRead("copy", tuple(args[1].shape), _caller()))
            args[0].copy_(args[1].elem)
            return args[0]
        if func in (aten._local_scalar_dense.default, aten.is_nonzero.default) and on_device:
            self.host_reads.append(HostRead("scalar", (), _caller()))
        if on_device:
            # CUDA takes CPU index tensors in advanced indexing (``cuda_t[cpu_indices]``), so does this
            checked = leaves
            if func in _INDEXING:
                indices = set(map(id, tree_flatten(args[1])[0]))
                checked = [t for t in leaves if id(t) not in indices]
            for t in checked:
                if isinstance(t, torch.Tensor) and not isinstance(t, DeviceTensor) and t.dim() > 0:
                    raise RuntimeError(
                        f"{func}: Expected all tensors to be on the same device, but found at least two "
                        f"devices, {DEVICE} and {t.device}!"
                    )
        to_device = bool(on_device) or _is_device(kwargs.get("device"))
        if _is_device(kwargs.get("device")):
            kwargs["device"] = torch.device("cpu")
        wrappers = {id(t.elem): t for t in on_device}
        unwrapped_args, unwrapped_kwargs = tree_map(
            lambda t: t.elem if isinstance(t, DeviceTensor) else t, (args, kwargs)
        )
        out = func(*unwrapped_args, **unwrapped_kwargs)
        if not to_device or func in (aten._local_scalar_dense.default, aten.is_nonzero.default):
            return out

        def wrap(t):
            if not isinstance(t, torch.Tensor) or isinstance(t, DeviceTensor):
                return t
            same = wrappers.get(id(t))  # an in-place operation returns its argument
            return same if same is not None else DeviceTensor(t)

        return tree_map(wrap, out)
