"""What the experiment-result and documentation tests share: the generated blocks of the README and the docs pages
(``<!-- marker -->`` ... ``<!-- /marker -->``). An experiment's script is imported as a module of the
``experiments`` package (``from experiments import mismatch_bench``)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def doc_files() -> list[Path]:
    """The README and every page of the docs site (``docs/*.md``), README first."""
    root = Path(ROOT)
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def doc_containing(text: str) -> tuple[Path, str]:
    """The one README/docs page that contains ``text``, and its content (an error if none or several do)."""
    found = [(path, content) for path in doc_files() if text in (content := path.read_text(encoding="utf-8"))]
    names = ", ".join(str(path.relative_to(ROOT)) for path, _ in found)
    assert len(found) == 1, f"{text!r} is in {len(found)} of README.md and docs/*.md ({names}); it must be in one"
    return found[0]


def doc_block(marker: str, path: str | None = None) -> str:
    """The text between ``<!-- marker -->`` and ``<!-- /marker -->``, stripped, from the README or the docs page that
    has it (``path``, relative to the repository root, to say which one it must be)."""
    opening, closing = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    if path is None:
        _, text = doc_containing(opening)
    else:
        text = Path(ROOT, path).read_text(encoding="utf-8")
    start = text.index(opening) + len(opening)
    return text[start:text.index(closing, start)].strip()
