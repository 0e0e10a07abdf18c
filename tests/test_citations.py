"""Citations resolve inside the repository.

Code and documentation cite the five source works by the keys of ``docs/references.md`` with the
location, e.g. ``[QACT, Alg. 1]`` or ``[NED, Sec. 2, eq. (3)]``. Two kinds of citation cannot be
resolved by a reader of the repository and are refused: numbers of source files that live outside
it (three digits, optionally followed by a section, equation, figure ... reference) and bracketed
keys that ``docs/references.md`` does not define.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REFERENCES = ROOT / "docs" / "references.md"

#: Where citations live: the package, its documentation, benchmarks, studies, examples, tests.
SCANNED = ("src", "docs", "README.md", "benchmarks", "studies", "examples", "tests")
TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".rst", ".json", ".cfg", ".ini", ".yaml", ".yml", ".sh"}
SKIPPED_DIRS = {"__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache", ".hypothesis"}


_LOCATION = (
    r"(?:Sec|Secs|Section|Alg|Algorithm|App|app|appendix|Appendix|eq|eqs|Eq|Fig|Figure|Table|Tables"
    r"|Remark|Ch|ch|chapter|Chapter|Art|Article|Paper|URL|Supp|ref|Theorem|Observation)\b"
)
#: A source-file number: 000..004 not inside a larger number ("0.001", "10,000", "1004").
_NUMBER = r"(?<![\w.,])00[0-4](?![\w.])"
SEED_PATTERNS = {
    "file number with a location": re.compile(_NUMBER + r",? ?" + _LOCATION),
    "file number in parentheses": re.compile(r"\(00[0-4](?![\w.])"),
    "possessive file number": re.compile(_NUMBER + r"'s\b"),
    "file number named in prose": re.compile(r"\b(?:paper|papers|document|documents|thesis|seed|seeds) " + _NUMBER),
    "path outside the repository": re.compile(r"shared/seeds|seeds/00[0-4]"),
}


def defined_keys() -> set[str]:
    """The citation keys of docs/references.md: the bold first cell of each table row."""
    return set(re.findall(r"^\| \*\*([A-Za-z]+)\*\* \|", REFERENCES.read_text(encoding="utf-8"), flags=re.M))


def unknown_key_pattern(keys: set[str]) -> re.Pattern:
    """``[Word, <location>`` or ``[Word]`` citing a key outside ``keys`` (``[Tensor, ...]`` has no location)."""
    known = "|".join(sorted(keys))
    return re.compile(r"\[(?!(?:" + known + r")[,\]])([A-Z][A-Za-z-]*),? " + _LOCATION)


def citation_problems(text: str, keys: set[str]) -> list[tuple[int, str, str]]:
    """``(line number, kind, matched text)`` of every unresolvable citation in ``text``."""
    unknown = unknown_key_pattern(keys)
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for kind, pattern in SEED_PATTERNS.items():
            found += [(number, kind, m.group(0)) for m in pattern.finditer(line)]
        found += [(number, "key not in docs/references.md", m.group(0)) for m in unknown.finditer(line)]
    return found


def scanned_files() -> list[Path]:
    files = []
    for entry in SCANNED:
        path = ROOT / entry
        candidates = [path] if path.is_file() else sorted(path.rglob("*")) if path.is_dir() else []
        for f in candidates:
            if f == Path(__file__).resolve():
                continue  # its examples of refused citations are refused on purpose
            if (
                f.is_file()
                and f.suffix in TEXT_SUFFIXES
                and not SKIPPED_DIRS.intersection(f.parts)
                and not any(p.endswith(".egg-info") for p in f.parts)
            ):
                files.append(f)
    return files


def test_references_define_the_five_keys():
    assert defined_keys() == {"QACT", "Kim", "Patel", "Kirchhof", "NED"}


@pytest.mark.parametrize(
    "text",
    [
        "QACT (000, Alg. 1-2) needs",
        "see 004 Sec. 2 eq. (3)",
        "the baseline (002's)",
        "004's claim",
        "(003)",
        "the toy (paper 000, Figure 1)",
        "seed documents 000 and 004 evaluate",
        "001, Article II",
        "in shared/seeds/000_x.txt",
        "[Smith, Sec. 3]",
        "[Qact, Alg. 1]",
    ],
)
def test_unresolvable_citations_are_found(text):
    assert citation_problems(text, defined_keys()), text


@pytest.mark.parametrize(
    "text",
    [
        "[QACT, Alg. 1-2] and [NED, Sec. 2, eq. (3)]",
        "[Kim, Art. II, eq. 3]; [Patel, Sec. 6.3]; [Kirchhof, URL App. B.8]; [NED]",
        "early stopping at +0.001 on 10,000 images of 1,000 classes, seed 1004",
        "def f(x: dict[Tensor, Tensor]) -> tuple[Tensor, ...]:",
        '{"000_table1_0_to_5": 1, "lr": 0.002}',
        "Hendrycks & Dietterich 2019, Sec. 3",
    ],
)
def test_resolvable_text_is_not_flagged(text):
    assert citation_problems(text, defined_keys()) == []


def test_every_citation_resolves_to_docs_references():
    keys = defined_keys()
    problems = []
    for f in scanned_files():
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        rel = f.relative_to(ROOT).as_posix()
        problems += [f"{rel}:{n}: {kind}: {hit!r}" for n, kind, hit in citation_problems(text, keys)]
    assert not problems, "unresolvable citations (use the keys of docs/references.md):\n" + "\n".join(problems)
