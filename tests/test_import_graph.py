"""The library's import graph has no arrow into the demo, and the trainer's config none into the trainer (issue #30).

Every import statement of every module of ``trl_rollout_corr`` outside ``demo/`` and ``testing/`` is read with
``ast`` (top level and inside functions alike, relative imports resolved). The one allowed arrow: the CLI's ``demo``
command, which runs the demo, imports it inside ``cli.main``.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "trl_rollout_corr"
OUTSIDE_THE_LIBRARY = ("demo", "testing")
ALLOWED = {("trl_rollout_corr.cli", "main")}  # `trl-rollout-corr demo` runs the demo


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: pathlib.Path):
    """(module imported, name of the enclosing function or None) for each import statement of ``path``."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            scope = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Import):
                yield from ((alias.name, function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                yield base, function
                yield from ((f"{base}.{alias.name}", function) for alias in child.names)  # `from . import demo`
            yield from visit(child, scope)

    yield from visit(tree, None)


def library_files():
    return sorted(p for p in PACKAGE.rglob("*.py")
                  if p.relative_to(PACKAGE).parts[0] not in OUTSIDE_THE_LIBRARY)


def test_the_scan_sees_the_package_and_resolves_relative_imports():
    files = {module_name(p) for p in library_files()}
    assert {"trl_rollout_corr.trainer", "trl_rollout_corr.train_command", "trl_rollout_corr.rewards",
            "trl_rollout_corr.async_grpo.trainer", "trl_rollout_corr.cli"} <= files
    assert not any(f.startswith(("trl_rollout_corr.demo", "trl_rollout_corr.testing")) for f in files)
    cli = set(imported_modules(PACKAGE / "cli.py"))
    assert ("trl_rollout_corr.demo", "main") in cli  # `from .demo import run_demo_cli` inside main()


@pytest.mark.parametrize("path", library_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_library_never_imports_the_demo(path):
    name = module_name(path)
    arrows = [(module, function) for module, function in imported_modules(path)
              if (module == "trl_rollout_corr.demo" or module.startswith("trl_rollout_corr.demo."))
              and (name, function) not in ALLOWED]
    assert not arrows, (f"{name} imports the demo ({arrows}): the toy task is trl_rollout_corr.testing.toy_task; "
                        "the library must not depend on trl_rollout_corr.demo")


def test_the_trainer_config_does_not_import_the_trainer():
    """``grpo_config.py`` once imported ``trainer.py`` inside a function (a cycle: the trainer imports the config) only
    to read the loss types that divide by TRL's ``num_items_in_batch``; they are ``trl_hooks/grpo.py``'s constant."""
    imported = {module for module, _ in imported_modules(PACKAGE / "grpo_config.py")}
    assert "trl_rollout_corr.trl_hooks.grpo.KEPT_TOKEN_NORMALIZER_LOSSES" in imported  # the scan sees its imports
    assert not [m for m in imported if m == "trl_rollout_corr.trainer" or m.startswith("trl_rollout_corr.trainer.")]
