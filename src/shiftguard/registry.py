"""``Registry``: name -> object tables with one normalisation, one listing and one error.

Every family of named things the library builds from a string (models, losses, activations,
heads, datasets, corruption suites and corruptions) is looked up through a :class:`Registry`, so
that ``"ResNet-18"``, ``"resnet_18"`` and ``"resnet18"`` name the same entry everywhere, every
family lists its names the same way, and an unknown name is always the same ``ValueError``::

    arch: unknown model 'resnet81'; expected one of densenet121, lenet, ... (did you mean 'resnet18'?)

Names are compared after :func:`normalize`: surrounding whitespace stripped, lower-cased, ``-``
and ``_`` removed. Two entries (or aliases) whose normalised forms coincide are refused at
registration, so a lookup is never ambiguous.

Examples:
    >>> from shiftguard.registry import Registry
    >>> shapes = Registry("shape", argument="kind")
    >>> @shapes.register("unit-square", aliases=("square",))
    ... def unit_square():
    ...     return [(0, 0), (1, 0), (1, 1), (0, 1)]
    >>> shapes.get("Unit_Square") is unit_square, shapes.canonical("SQUARE"), shapes.names()
    (True, 'unit-square', ['unit-square'])
    >>> shapes.get("sqare")
    Traceback (most recent call last):
    ...
    ValueError: kind: unknown shape 'sqare'; expected one of unit-square (did you mean 'unit-square'?)
"""

from __future__ import annotations

import difflib
from typing import Callable, Generic, Iterable, Iterator, Optional, TypeVar, overload

__all__ = ["Registry", "normalize"]

T = TypeVar("T")

#: Minimum ``difflib`` similarity ratio for a "did you mean" suggestion (difflib's own default).
_SUGGEST_CUTOFF = 0.6


def normalize(name: str) -> str:
    """The lookup key of ``name``: whitespace-stripped, lower-cased, without ``-`` and ``_``.

    >>> normalize(" Fashion_MNIST ")
    'fashionmnist'
    """
    return name.strip().lower().replace("-", "").replace("_", "")


class Registry(Generic[T]):
    """A table ``canonical name -> object`` of one ``kind`` (e.g. ``"loss"``), with aliases.

    Args:
        kind: what the entries are, used in error messages (``"unknown {kind} ..."``).
        argument: the argument or config key the name usually comes from, which error messages
            start with (default ``"name"``); :meth:`get` and :meth:`canonical` may override it.
        hint: text appended to the list of valid names in the unknown-name error, for lookups that
            accept more than registered names (e.g. ``"or a factory 'package.module:function'"``).

    Iteration yields the canonical names in registration order; :meth:`names` lists them sorted.

    Examples:
        >>> losses = Registry("loss", argument="loss")
        >>> losses.register("cross-entropy", len, aliases=("ce",)) is len
        True
        >>> losses.get("Cross_Entropy") is losses.get("CE") is len, list(losses)
        (True, ['cross-entropy'])
        >>> losses.get("hinge")
        Traceback (most recent call last):
        ...
        ValueError: loss: unknown loss 'hinge'; expected one of cross-entropy
    """

    def __init__(self, kind: str, *, argument: str = "name", hint: str = ""):
        if not isinstance(kind, str) or not kind.strip():
            raise ValueError(f"kind: expected a non-empty str, got {kind!r}")
        if not isinstance(argument, str) or not argument.strip():
            raise ValueError(f"argument: expected a non-empty str, got {argument!r}")
        if not isinstance(hint, str):
            raise TypeError(f"hint: expected a str, got {type(hint).__name__}")
        self.kind = kind
        self.argument = argument
        self.hint = hint
        self._entries: dict[str, T] = {}  # canonical name -> object, in registration order
        self._keys: dict[str, str] = {}  # normalised name or alias -> canonical name

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()!r})"

    # ------------------------------------------------------------------ registration

    @overload
    def register(self, name: str, obj: None = None, *, aliases: Iterable[str] = ()) -> Callable[[T], T]: ...

    @overload
    def register(self, name: str, obj: T, *, aliases: Iterable[str] = ()) -> T: ...

    def register(self, name, obj=None, *, aliases=()):
        """Register ``obj`` under ``name`` (and ``aliases``); return ``obj``.

        Without ``obj``, returns a decorator that registers the decorated object. ``name`` is the
        canonical name, kept as written (listed by :meth:`names`, returned by :meth:`canonical`).

        Raises:
            TypeError: ``name`` or an alias is not a str; ``aliases`` is a str (a sequence of
                names is expected).
            ValueError: ``name`` or an alias is empty after normalisation, or its normalised form
                is already taken by this registry (names and aliases share one key space).
        """
        if isinstance(aliases, str):
            raise TypeError(f"aliases: expected a sequence of str, got the str {aliases!r}")
        aliases = tuple(aliases)
        self._check_new(name, aliases)

        def add(target: T) -> T:
            keys = self._check_new(name, aliases)  # again: another entry may have come in meanwhile
            self._entries[name] = target
            for key in keys:
                self._keys[key] = name
            return target

        return add if obj is None else add(obj)

    def _check_new(self, name, aliases: tuple) -> list[str]:
        """The normalised keys of ``name`` and ``aliases``, all free and distinct, or an error."""
        keys = [self._new_key(name, "name")] + [self._new_key(a, "aliases") for a in aliases]
        if len(set(keys)) != len(keys):
            raise ValueError(
                f"aliases: {aliases!r} repeat the {self.kind} name {name!r} or each other "
                "(names are compared ignoring case, '-' and '_')"
            )
        return keys

    def _new_key(self, name, what: str) -> str:
        if not isinstance(name, str):
            raise TypeError(f"{what}: expected a str, got {type(name).__name__}")
        key = normalize(name)
        if not key:
            raise ValueError(f"{what}: {name!r} is empty once whitespace, '-' and '_' are removed")
        if key in self._keys:
            raise ValueError(
                f"{what}: {name!r} is already registered as the {self.kind} {self._keys[key]!r} "
                "(names are compared ignoring case, '-' and '_')"
            )
        return key

    # ------------------------------------------------------------------ lookup

    def canonical(self, name: str, *, argument: Optional[str] = None, words: bool = False) -> str:
        """The canonical name that ``name`` (any case, ``-``/``_`` ignored, or an alias) refers to.

        ``words=True``: whitespace between words is a separator like ``-`` and ``_`` too
        (``"motion blur"``); by default an inner space is part of the name. An error quotes
        ``name`` as given.

        Raises:
            TypeError: ``name`` is not a str (the message names ``argument``).
            ValueError: ``name`` is not registered; the message names ``argument``, lists the
                valid names (sorted) and suggests the closest one when one is close.
        """
        argument = self.argument if argument is None else argument
        if not isinstance(name, str):
            raise TypeError(f"{argument}: expected a {self.kind} name (str), got {type(name).__name__}")
        found = self._keys.get(normalize(name))
        if found is None and words:
            found = self._keys.get(normalize("_".join(name.split())))
        if found is None:
            raise self._unknown(name, argument)
        return found

    def get(self, name: str, *, argument: Optional[str] = None) -> T:
        """The object registered under ``name`` (see :meth:`canonical` for matching and errors)."""
        return self._entries[self.canonical(name, argument=argument)]

    def _unknown(self, name: str, argument: str) -> ValueError:
        listing = ", ".join(self.names()) or "(none registered)"
        hint = f" {self.hint}" if self.hint else ""
        close = difflib.get_close_matches(normalize(name), list(self._keys), n=1, cutoff=_SUGGEST_CUTOFF)
        suggestion = f" (did you mean {self._keys[close[0]]!r}?)" if close else ""
        return ValueError(f"{argument}: unknown {self.kind} {name!r}; expected one of {listing}{hint}{suggestion}")

    def __contains__(self, name: object) -> bool:
        """Whether ``name`` is a registered name or alias (normalised); ``False`` for a non-str."""
        return isinstance(name, str) and normalize(name) in self._keys

    # ------------------------------------------------------------------ listing

    def names(self) -> list[str]:
        """The canonical names, sorted (aliases are not listed)."""
        return sorted(self._entries)

    def aliases(self) -> dict[str, str]:
        """``alias -> canonical name`` for the aliases given at registration, in normalised form."""
        return {key: name for key, name in self._keys.items() if key != normalize(name)}

    def items(self) -> list[tuple[str, T]]:
        """``(canonical name, object)`` pairs in registration order."""
        return list(self._entries.items())

    def as_dict(self) -> dict[str, T]:
        """A new ``dict`` ``canonical name -> object`` in registration order (a snapshot)."""
        return dict(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)
