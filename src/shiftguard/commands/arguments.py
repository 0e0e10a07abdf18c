"""What the ``shiftguard`` subcommands share on the command line: list options, suite names and
where a ``--dataset`` is found.

- :class:`ListAction`: a list option (``--corruptions``, ``--severities``, ``--heads``,
  ``--adapt``, ``--conformal``, ``--split``) takes its values space-separated, comma-separated or
  both: ``--corruptions fog zoom_blur``, ``--corruptions fog,zoom_blur`` and
  ``--corruptions fog, zoom_blur`` give the same list. Names keep the spelling typed; the library
  canonicalises them (case, ``-``, ``_`` and spaces do not matter).
- :func:`suite_name`: ``--suite`` in any spelling (``MNIST_C`` is ``mnist-c``).
- :func:`load_dataset`: ``--dataset`` and ``--root`` read as ``shiftguard run`` reads its data
  (``mnist-default``: the embedded MNIST subset; any other name from ``--root``, else
  ``$SHIFTGUARD_DATA/<name>``, else the per-user cache), with a missing-files error in
  command-line terms.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Optional, Sequence

__all__ = ["ListAction", "split_list", "suite_name", "load_dataset", "DEFAULT_DATASETS"]

#: ``--dataset`` names of the embedded MNIST subset (offline, no files needed), as in ``shiftguard run``.
DEFAULT_DATASETS = ("mnist-default", "default")


def split_list(tokens: Sequence[str], *, options: bool = False) -> list[str]:
    """The items of a list option's tokens: each token split at commas, blanks dropped.

    ``options=True`` is for items that carry their own ``name:key=value,key=value`` options
    (``--adapt tent:lr=0.001,steps=2``): a piece with ``=`` and no ``:`` continues the options of
    the item before it instead of starting a new item.

    >>> split_list(["fog,zoom_blur", "snow", ","])
    ['fog', 'zoom_blur', 'snow']
    >>> split_list(["none,tent:lr=0.001,steps=2", "bn:prior=16"], options=True)
    ['none', 'tent:lr=0.001,steps=2', 'bn:prior=16']
    """
    items: list[str] = []
    for token in tokens:
        for piece in (p.strip() for p in str(token).split(",")):
            if not piece:
                continue
            if options and items and "=" in piece and ":" not in piece.split("=", 1)[0]:
                items[-1] += "," + piece
            else:
                items.append(piece)
    return items


class ListAction(argparse.Action):
    """A list option (``nargs="+"``) whose values may also be comma-separated (:func:`split_list`).

    Keyword arguments of ``add_argument`` beyond argparse's own:

    - ``item``: converts each item (default ``str``); an item it refuses is the usual
      ``argument --flag: invalid ... value`` error.
    - ``options``: items carry ``name:key=value,...`` options (see :func:`split_list`).

    The option given twice keeps the last list, as a plain ``nargs="+"`` option does.
    """

    def __init__(
        self,
        option_strings: Sequence[str],
        dest: str,
        *,
        item: Callable[[str], Any] = str,
        options: bool = False,
        nargs: Any = "+",
        **kwargs: Any,
    ):
        if nargs != "+":
            raise ValueError(f"nargs: a list option takes one or more values (nargs='+'), got {nargs!r}")
        if kwargs.get("type") is not None:
            raise ValueError("type: give item= instead (each comma-separated item is converted)")
        super().__init__(option_strings, dest, nargs=nargs, **kwargs)
        self.item = item
        self.options = options

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: Optional[str] = None,
    ) -> None:
        items = split_list(values, options=self.options)
        if not items:
            raise argparse.ArgumentError(self, "expected at least one value")
        out = []
        for piece in items:
            try:
                out.append(self.item(piece))
            except (TypeError, ValueError):
                what = getattr(self.item, "__name__", "item")
                raise argparse.ArgumentError(self, f"invalid {what} value: {piece!r}") from None
        setattr(namespace, self.dest, out)


def suite_name(text: str) -> str:
    """``--suite``'s value in its registered spelling: any case, ``-``, ``_`` or spaces
    (``"CIFAR_C+Extra"`` -> ``"cifar-c+extra"``). An unknown name comes back as given, for the
    option's ``choices`` to refuse with the list of suites."""
    from shiftguard.corruptions import canonical_suite

    base, plus, rest = text.partition("+")
    try:
        base = canonical_suite(base)
    except ValueError:
        return text
    return base + plus + "".join(rest.split()).lower()


def load_dataset(dataset: str, split: str, root: Optional[str]):
    """Split ``split`` of ``--dataset``, found as ``shiftguard run`` finds its data: ``mnist-default``
    (or ``default``) is the embedded MNIST subset; any other name is read by
    :func:`shiftguard.data.load` from ``--root``, else ``$SHIFTGUARD_DATA/<name>``, else the per-user
    cache.

    Raises ``ValueError`` naming ``--dataset`` for an unknown name, and ``FileNotFoundError`` in one
    line for missing files: what was expected, where it was looked for, and what to pass on the
    command line (``--root``, ``SHIFTGUARD_DATA``).
    """
    from shiftguard import data as D
    from shiftguard.data.registry import DATASET_REGISTRY

    if dataset in DEFAULT_DATASETS:
        return D.load_default(split)
    if dataset not in DATASET_REGISTRY:
        raise ValueError(
            f"--dataset: unknown dataset {dataset!r}; expected {DEFAULT_DATASETS[0]} (the embedded MNIST "
            f"subset) or one of {', '.join(D.names())}"
        )
    try:
        return D.load(dataset, split, root)
    except FileNotFoundError as exc:
        raise FileNotFoundError(missing_files_line(str(exc), dataset)) from None


def missing_files_line(message: str, dataset: str, *, root: str = "--root", dataset_option: str = "--dataset") -> str:
    """A loader's missing-files message (what it expected, the folders it looked in, then advice
    for a Python caller) as one line of command-line advice: ``root`` and ``dataset_option`` name
    where the user sets the data folder and the data set (a flag, or a config key for
    ``shiftguard run``). A message of another form is only joined into one line."""
    from shiftguard.data.download import RESOURCES
    from shiftguard.data.registry import DATASET_REGISTRY

    lines = message.splitlines()
    folders = [line.strip() for line in lines[1:] if line.startswith("  ")]
    if len(lines) < 2 or not folders or not lines[0].rstrip().endswith(":"):
        return " ".join(message.split())
    name = DATASET_REGISTRY.canonical(dataset, argument="--dataset") if dataset in DATASET_REGISTRY else dataset
    text = (
        f"{lines[0].rstrip()} {', '.join(folders)}; set {root} to the folder that holds them, "
        f"or SHIFTGUARD_DATA to a folder holding {name}/"
    )
    if name == "mnist":
        text += f" (or {dataset_option} {DEFAULT_DATASETS[0]}: the embedded MNIST subset, no files needed)"
    if RESOURCES.get(name):
        text += "; official files: " + ", ".join(r.urls[0] for r in RESOURCES[name])
    return text
