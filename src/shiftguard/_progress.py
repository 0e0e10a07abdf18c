"""Progress output that reads well both on a terminal and in a log file.

On a terminal (``stream.isatty()``) :func:`progress` is a tqdm bar redrawn in place. Anywhere else
(a file, a pipe, a CI log, ``nohup``) a redrawn bar would fill the log with carriage returns and
hundreds of partial lines, so it prints plain lines instead: one when a tenth of ``total`` more has
been done (``line_every`` updates, by default ``ceil(total / 10)``), and one when the work
completes; never a ``'\\r'``. :func:`write` prints a line without breaking an open bar.

Both go to ``sys.stderr`` by default, where tqdm draws; epoch and summary lines that belong in the
output proper are written by the caller to ``sys.stdout`` (:func:`write`).
"""

from __future__ import annotations

import math
import sys
import time
from typing import IO, Optional, Union

__all__ = ["Progress", "progress", "is_terminal", "write"]

Info = Union[str, dict, None]


def is_terminal(stream: Optional[IO] = None) -> bool:
    """Whether ``stream`` (default ``sys.stderr``) is an interactive terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


def write(line: str, stream: Optional[IO] = None) -> None:
    """Print ``line`` to ``stream`` (default ``sys.stdout``), above any tqdm bar on a terminal."""
    stream = sys.stdout if stream is None else stream
    if is_terminal(stream) or is_terminal(sys.stderr):
        from tqdm.auto import tqdm

        tqdm.write(line, file=stream)
        stream.flush()
    else:
        print(line, file=stream, flush=True)


def _format_info(info: Info) -> str:
    if info is None:
        return ""
    if isinstance(info, dict):
        return ", ".join(f"{k}={v}" for k, v in info.items())
    return str(info)


class Progress:
    """Counter of ``total`` steps; see :func:`progress`. ``update(n, info)`` after each step,
    ``close()`` at the end (or use it as a context manager)."""

    def __init__(
        self,
        total: int,
        desc: str = "",
        enabled: bool = True,
        unit: str = "it",
        *,
        line_every: Optional[int] = None,
        lines: bool = True,
        stream: Optional[IO] = None,
    ):
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ValueError(f"total: expected a non-negative integer, got {total!r}")
        if line_every is not None and (
            isinstance(line_every, bool) or not isinstance(line_every, int) or line_every < 1
        ):
            raise ValueError(f"line_every: expected a positive integer, got {line_every!r}")
        self.total, self.desc, self.unit = total, desc, unit
        self.n = 0
        self.stream = sys.stderr if stream is None else stream
        self.line_every = line_every or max(1, math.ceil(total / 10))
        self._bar = None
        self._plain = False
        self._last_line_n = 0
        self._info: Info = None
        self._t0 = time.perf_counter()
        self._closed = not enabled
        if not enabled:
            return
        if is_terminal(self.stream):
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream, leave=False, dynamic_ncols=True)
        else:
            self._plain = bool(lines)

    def update(self, n: int = 1, info: Info = None) -> None:
        """Count ``n`` more steps; ``info`` (a string or a dict) is shown next to the count."""
        if self._closed:
            return
        self.n += n
        if info is not None:
            self._info = info
        if self._bar is not None:
            if info is not None:
                self._bar.set_postfix_str(_format_info(info), refresh=False)
            self._bar.update(n)
        elif self._plain:
            due = self.n - self._last_line_n >= self.line_every
            if due or self.n >= self.total > self._last_line_n:  # every line_every steps, and at completion
                self._line()

    def _line(self) -> None:
        self._last_line_n = self.n
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        info = _format_info(self._info)
        text = (
            f"{self.desc + ': ' if self.desc else ''}{self.n}/{self.total} {self.unit}{pct}, "
            f"{time.perf_counter() - self._t0:.1f} s{', ' + info if info else ''}"
        )
        print(text, file=self.stream, flush=True)

    def close(self) -> None:
        """End the bar; in plain mode, print the count reached if it has not been printed yet."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        elif self._plain and self.n > self._last_line_n:
            self._line()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(
    total: int,
    desc: str = "",
    enabled: bool = True,
    unit: str = "it",
    *,
    line_every: Optional[int] = None,
    lines: bool = True,
    stream: Optional[IO] = None,
) -> Progress:
    """A progress counter of ``total`` steps.

    Args:
        total: number of steps (int >= 0).
        desc: label printed before the count. unit: what a step is ("batch", "cell", ...).
        enabled: False gives a counter that prints nothing.
        line_every: off a terminal, print a line every this many steps (default ``ceil(total / 10)``:
            at most ~10 lines); a line is also printed when ``total`` is reached, and by ``close()``
            for a count not printed yet.
        lines: off a terminal, print the plain lines at all (False: silent there, a bar on a terminal
            only; for callers that print their own summary line per unit of work).
        stream: where to print (default ``sys.stderr``); whether it is a terminal picks the mode.

    Raises:
        ValueError: ``total`` not a non-negative integer, ``line_every`` not a positive integer.
    """
    return Progress(total, desc, enabled, unit, line_every=line_every, lines=lines, stream=stream)
