"""The pre-registrations are documents (experiments/preregistrations/NN-short-name.md, issue 53): one per number,
each naming the commit that fixed it; the scripts point at them, and the rules an analysis writes into its
analysis.md are the documents' text, verbatim."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from experiments import async_mismatch as am
from experiments import vllm_truncation as vt
from experiments.preregistrations import HERE, document, preregistered_rules

ROOT = Path(__file__).resolve().parents[2]
NUMBERS = range(1, 26)


def test_one_document_per_number_each_naming_its_commit():
    names = sorted(p.name for p in HERE.glob("*.md"))
    assert [int(n[:2]) for n in names] == list(NUMBERS), names
    for n in NUMBERS:
        text = document(n).read_text(encoding="utf-8")
        assert text.startswith(f"# Pre-registration {n}: "), document(n).name
        assert re.search(r"Fixed before its runs in commit `[0-9a-f]{7,}` \(2026-\d\d-\d\d \d\d:\d\d UTC\)", text), n


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_the_named_commits_exist():
    for n in NUMBERS:
        commit = re.search(r"in commit `([0-9a-f]+)`", document(n).read_text(encoding="utf-8")).group(1)
        proc = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ROOT, capture_output=True)
        assert proc.returncode == 0, f"pre-registration {n}: commit {commit} is not in this repository's history"


def test_the_analyses_write_the_documents_rules():
    """Each RULES constant is its document's ```text block, which starts with its own number (a wrong number or a
    second block would show here)."""
    rules = {17: am.RULES, 18: am.RULES_18, 19: am.RULES_19, 22: am.RULES_22, 20: vt.RULES_20, 21: vt.RULES_21,
             23: vt.RULES_23, 24: vt.RULES_24}
    for n, text in rules.items():
        assert text == preregistered_rules(n)
        assert text.startswith(f"Pre-registration {n} (") and "```" not in text
        assert document(n).read_text(encoding="utf-8").count("```text") == 1


def test_every_pointer_in_the_scripts_names_a_document():
    pointers, pointer = [], re.compile(r"pre-registration (\d+): experiments/preregistrations/([\w.-]+\.md)")
    for script in sorted((ROOT / "experiments").glob("*.py")):
        pointers += pointer.findall(script.read_text())
    assert {int(n) for n, _ in pointers} == set(NUMBERS)
    for n, name in pointers:
        assert document(int(n)).name == name


def test_a_missing_document_is_named():
    with pytest.raises(FileNotFoundError, match="pre-registration 99"):
        preregistered_rules(99)


@pytest.mark.parametrize("number, analysis", [
    (17, "async_mismatch_s4_analysis.md"), (18, "async_mismatch_s4_analysis.md"), (19, "async_mismatch_s4_analysis.md"),
    (22, "async_mismatch_s4_analysis.md"), (20, "vllm_truncation_analysis.md"), (21, "vllm_truncation_21_analysis.md"),
    (23, "vllm_truncation_23_analysis.md"), (24, "vllm_truncation_24_analysis.md")])
def test_the_committed_analyses_quote_the_documents_verbatim(number, analysis):
    """The rules moved out of the scripts unchanged: each committed analysis.md (written by the script from its
    RULES constant before issue 53) holds its document's rules character for character."""
    assert preregistered_rules(number) in (ROOT / "experiments" / "results" / analysis).read_text(encoding="utf-8")
