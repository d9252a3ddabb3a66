"""What the benchmark-result tests share: a benchmark script loaded as a module, a generated block of the README."""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module (the benchmarks folder is not a package)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def readme_block(marker: str) -> str:
    """The README's text between ``<!-- marker -->`` and ``<!-- /marker -->``, stripped."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    start = text.index(f"<!-- {marker} -->") + len(f"<!-- {marker} -->")
    return text[start:text.index(f"<!-- /{marker} -->")].strip()
