"""One source for "what has run where": docs/snippets/what-has-run.md.

The README and the docs pages that need the status carry an exact copy between ``<!-- what-has-run -->`` markers (links
relative to docs/, so the README's copy prefixes ``docs/``); no page states its own version: a sentence outside the
copy that names an NVIDIA GPU beside a status word ("has not run", "only", "everything else", ...) or says "what has
run where" fails. To update: edit the snippet, then ``python tests/repo/test_what_has_run.py`` rewrites the copies.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SNIPPET = ROOT / "docs" / "snippets" / "what-has-run.md"
MARKED = re.compile(r"(<!-- what-has-run -->\n)(.*?)(<!-- /what-has-run -->)", re.S)
PAGES = ["README.md", "docs/index.md", "docs/evidence.md", "docs/install.md", "docs/engines.md", "docs/benchmarks.md",
         "docs/async.md"]
STATUS = re.compile(r"has not run|have not run|never run|not run on a GPU|everything else|the only GPU|one GPU run|"
                    r"ran on CPUs only|what has run where", re.I)


def copy_for(page: str) -> str:
    """The snippet as ``page`` shows it (relative links rewritten for the README at the repository root)."""
    text = SNIPPET.read_text(encoding="utf-8")
    if page == "README.md":
        text = re.sub(r"\]\((?!https?://|#)([^)]+)\)", r"](docs/\1)", text)
    return text


def test_the_snippet_is_not_a_site_page():
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    assert "snippets/" in config.get("exclude_docs", ""), "mkdocs.yml must exclude docs/snippets/ from the site"


@pytest.mark.parametrize("page", PAGES)
def test_the_page_carries_the_snippet_verbatim(page):
    text = (ROOT / page).read_text(encoding="utf-8")
    blocks = MARKED.findall(text)
    assert len(blocks) == 1, f"{page}: expected one <!-- what-has-run --> block, found {len(blocks)}"
    assert blocks[0][1] == copy_for(page), (
        f"{page}'s copy differs from docs/snippets/what-has-run.md: run python tests/repo/test_what_has_run.py")


def _sentences(text: str) -> list[str]:
    text = MARKED.sub("", text)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.split(r"(?<=[.!?])\s+", " ".join(text.split()))


@pytest.mark.parametrize("page", ["README.md", *sorted(p.relative_to(ROOT).as_posix()
                                                       for p in (ROOT / "docs").glob("*.md"))])
def test_no_page_states_its_own_version(page):
    found = [s for s in _sentences((ROOT / page).read_text(encoding="utf-8"))
             if (re.search(r"\bH[12]00\b|\bGPUs? (?:run|check)", s) and STATUS.search(s))
             or re.search(r"what has run where", s, re.I)]
    assert not found, f"{page} states what has run where itself (use the snippet's copy): {found}"


def test_the_checker_catches_a_page_s_own_version():
    assert re.search(r"\bH[12]00\b", "vLLM has not run on the H100.") and STATUS.search("vLLM has not run on the H100.")
    assert MARKED.sub("", "<!-- what-has-run -->\nWhat has run where.<!-- /what-has-run -->") == ""


def sync() -> None:
    """Rewrite every page's copy from the snippet."""
    for page in PAGES:
        path = ROOT / page
        text = path.read_text(encoding="utf-8")
        copy = copy_for(page)
        path.write_text(MARKED.sub(lambda m, copy=copy: m.group(1) + copy + m.group(3), text), encoding="utf-8")


if __name__ == "__main__":
    sync()
    sys.exit(0)
