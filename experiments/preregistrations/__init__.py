"""The pre-registrations, one document each (``NN-short-name.md``, the README lists them). The scripts keep only the
constants; the rules an analysis writes into its ``analysis.md`` are read from the document that fixed them."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def document(number: int) -> Path:
    """The document of pre-registration ``number`` (exactly one ``NN-*.md`` here, else a FileNotFoundError)."""
    found = sorted(HERE.glob(f"{number:02d}-*.md"))
    if len(found) != 1:
        raise FileNotFoundError(f"pre-registration {number}: expected one {HERE}/{number:02d}-*.md, found {found}")
    return found[0]


def preregistered_rules(number: int) -> str:
    """The rules of pre-registration ``number``: the document's one ```text block, verbatim."""
    text = document(number).read_text(encoding="utf-8")
    start = text.index("```text\n") + len("```text\n")
    return text[start:text.index("\n```", start)]
