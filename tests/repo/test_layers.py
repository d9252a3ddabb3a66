"""The layer contract: which folder of ``trl_rollout_corr`` may import which (issue #39).

Every import statement of every module of the package (top level and inside functions alike, relative imports
resolved) is read with ``ast``. The folders, bottom to top (docs/architecture.md draws them):

- ``core/`` (pure tensor math), ``runtime/`` (process-level helpers): import nothing of the package;
- ``config/`` (fields, presets, names, the plan), ``rollout/`` (pi_rollout), ``testing/`` (toy tasks): ``core/``;
- ``trl_hooks/`` (the boundary with TRL's private names: the bottom of the TRL side), ``monitor/``: the two above;
- ``vllm/``, ``training/`` (what both trainers share): those below;
- ``grpo/`` and ``async_grpo/`` (the trainers, side by side): those below, not each other;
- ``demo/``, ``cli/``, the package's ``__init__``: the top.

A folder may import itself and what its entry lists; nothing else (an arrow up or sideways is a failure naming the
module, the import and the rule).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "trl_rollout_corr"

BELOW_TRL_HOOKS = {"core", "runtime", "config", "rollout", "testing"}
MAY_IMPORT = {
    "core": set(),
    "runtime": set(),
    "config": {"core"},
    "rollout": {"core"},
    "testing": {"core"},
    "trl_hooks": {"core", "config", "runtime"},
    "monitor": {"core", "config", "runtime"},
    "vllm": BELOW_TRL_HOOKS | {"trl_hooks"},
    "training": BELOW_TRL_HOOKS | {"trl_hooks", "monitor"},
    "grpo": BELOW_TRL_HOOKS | {"trl_hooks", "monitor", "vllm", "training"},
    "async_grpo": BELOW_TRL_HOOKS | {"trl_hooks", "monitor", "vllm", "training"},
    "demo": BELOW_TRL_HOOKS | {"trl_hooks", "monitor", "vllm", "training", "grpo", "async_grpo", "__init__"},
    "cli": BELOW_TRL_HOOKS | {"trl_hooks", "monitor", "vllm", "training", "grpo", "async_grpo", "__init__", "demo"},
    "__init__": BELOW_TRL_HOOKS | {"trl_hooks", "monitor", "vllm", "training", "grpo", "async_grpo"},
    "__main__": {"cli"},
}
# finer rules inside a folder: (importer, imported) module pairs that must not exist
FORBIDDEN_MODULE_ARROWS = {
    # the trainer's config once imported the trainer inside a function (a cycle: the trainer imports the config) only
    # to read the loss types that divide by TRL's num_items_in_batch; they are trl_hooks/grpo.py's constant
    ("trl_rollout_corr.grpo.config", "trl_rollout_corr.grpo.trainer"),
}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: pathlib.Path, name: str | None = None):
    """(module imported, name of the enclosing function or None) for each import statement of ``path`` (the module
    ``name``, by default the one its place in the package gives)."""
    name = name or module_name(path)
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


def folder(module: str) -> str | None:
    """The layer folder of a ``trl_rollout_corr`` module (``__init__`` for the package's own face)."""
    parts = module.split(".")
    if parts[0] != "trl_rollout_corr":
        return None
    if len(parts) == 1 or not ((PACKAGE / parts[1]).is_dir() or (PACKAGE / f"{parts[1]}.py").is_file()):
        return "__init__"  # `from trl_rollout_corr import RolloutCorrectionConfig` & co.: the package's face
    return parts[1]


def arrows_against_the_contract(path: pathlib.Path, importer: str | None = None) -> list[str]:
    importer = importer or module_name(path)
    source = "__init__" if importer == "trl_rollout_corr" else folder(importer)
    bad = []
    for module, function in imported_modules(path, importer):
        target = folder(module)
        if target is None:
            continue
        where = f"{importer}{f' (in {function}())' if function else ''} imports {module}"
        if target != source and target not in MAY_IMPORT[source]:
            bad.append(f"{where}: {source}/ may import only {sorted(MAY_IMPORT[source]) or 'nothing of the package'}")
        if any(importer == a and (module == b or module.startswith(b + ".")) for a, b in FORBIDDEN_MODULE_ARROWS):
            bad.append(f"{where}: forbidden (FORBIDDEN_MODULE_ARROWS)")
    return bad


def library_files():
    return sorted(PACKAGE.rglob("*.py"))


def test_every_folder_of_the_package_has_a_rule():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    assert folders | modules == set(MAY_IMPORT), "a new folder or top-level module needs its line in MAY_IMPORT"


def test_the_scan_sees_the_package_and_resolves_relative_imports():
    files = {module_name(p) for p in library_files()}
    assert {"trl_rollout_corr.grpo.trainer", "trl_rollout_corr.cli.train", "trl_rollout_corr.cli.rewards",
            "trl_rollout_corr.async_grpo.trainer", "trl_rollout_corr.cli.main"} <= files
    cli = set(imported_modules(PACKAGE / "cli" / "main.py"))
    assert ("trl_rollout_corr.demo", "main") in cli  # `from ..demo import run_demo_cli` inside main()
    imported = {module for module, _ in imported_modules(PACKAGE / "grpo" / "config.py")}
    assert "trl_rollout_corr.trl_hooks.grpo.KEPT_TOKEN_NORMALIZER_LOSSES" in imported


def test_the_contract_catches_an_arrow_up_and_a_forbidden_module_arrow(tmp_path):
    """A planted ``trl_hooks`` module importing the trainer; ``grpo/config.py`` with an import of ``grpo/trainer.py``
    added (both written outside the package, scanned under the module name they would have)."""
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from ..grpo.trainer import RolloutCorrGRPOTrainer\n")
    bad = arrows_against_the_contract(planted, "trl_rollout_corr.trl_hooks.planted")
    assert bad and all("trl_hooks/ may import only" in b and "(in f())" in b for b in bad)
    config = tmp_path / "config.py"
    config.write_text((PACKAGE / "grpo" / "config.py").read_text()
                      + "\ndef g():\n    from .trainer import RolloutCorrGRPOTrainer\n")
    assert not arrows_against_the_contract(PACKAGE / "grpo" / "config.py")
    assert [b for b in arrows_against_the_contract(config, "trl_rollout_corr.grpo.config") if "FORBIDDEN" in b]


OUTSIDE_THE_LIBRARY = ("experiments", "benchmarks", "tests")  # the lab, the performance checks, the suite


def outside_imports(path: pathlib.Path, name: str | None = None) -> list[str]:
    return [f"{name or module_name(path)}{f' (in {function}())' if function else ''} imports {module}"
            for module, function in imported_modules(path, name) if module.split(".")[0] in OUTSIDE_THE_LIBRARY]


@pytest.mark.parametrize("path", library_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_package_imports_nothing_outside_the_library(path):
    """The package ships without ``experiments/``, ``benchmarks/`` and ``tests/`` (issue 53): no module of it imports
    them, at top level or inside a function."""
    bad = outside_imports(path)
    assert not bad, "\n".join(bad)


def test_the_outside_check_catches_an_import_of_the_lab(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("import torch\n\ndef f():\n    from experiments.stats import paired_t\n")
    assert outside_imports(planted, "trl_rollout_corr.monitor.planted") == [
        "trl_rollout_corr.monitor.planted (in f()) imports experiments.stats",
        "trl_rollout_corr.monitor.planted (in f()) imports experiments.stats.paired_t"]


@pytest.mark.parametrize("path", library_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_import_follows_the_layer_contract(path):
    bad = arrows_against_the_contract(path)
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------------------------ one path down (issue 53)
# The trainers orchestrate downward: they ask trl_hooks for the policy's log-probs, core for the correction and
# trl_hooks for TRL's loss. Nothing below the trainers calls back into a trainer: a module below them never calls a
# method on a trainer object it was handed (``trainer.<method>(...)``; ``super(owner, trainer).<method>(...)`` is
# TRL's own method, the way down), and a trainer never hands a module below it one of its own methods or a closure
# over ``self`` to be called back (``reduce_fn=self._rc_reduce``, ``lambda: ...self...``).
TRAINER_FOLDERS = {"grpo", "async_grpo", "training"}
BELOW_THE_TRAINERS = {"core", "runtime", "config", "rollout", "testing", "trl_hooks", "monitor", "vllm"}


def trainer_calls(path: pathlib.Path, shown: str | None = None) -> list[str]:
    """``trainer.<method>(...)`` calls in ``path``, on a name a function was handed as its ``trainer`` parameter."""
    shown = shown or str(path.relative_to(PACKAGE))
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        params = {a.arg for a in (*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs)}
        if "trainer" not in params:
            continue
        for node in ast.walk(function):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "trainer"):
                bad.append(f"{shown}:{node.lineno} calls trainer.{node.func.attr}(): a call back "
                           "into the trainer")
    return bad


def trainer_methods() -> set[str]:
    """The names of the methods the trainers' classes define (the trainers' folders and the mixin they share)."""
    names = set()
    for path in library_files():
        if folder(module_name(path)) in TRAINER_FOLDERS:
            tree = ast.parse(path.read_text(), filename=str(path))
            names |= {f.name for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body
                      if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return names


def handed_callbacks(path: pathlib.Path, methods: set[str], shown: str | None = None) -> list[str]:
    """Call arguments in a trainer module that hand the callee one of the trainers' own ``methods``
    (``self.<method>``) or a lambda that reads ``self``."""
    shown = shown or str(path.relative_to(PACKAGE))
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        for arg in (*node.args, *(k.value for k in node.keywords)):
            bound = (isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name) and arg.value.id == "self"
                     and arg.attr in methods)
            closure = isinstance(arg, ast.Lambda) and any(isinstance(n, ast.Name) and n.id == "self"
                                                          for n in ast.walk(arg.body))
            if bound or closure:
                what = f"self.{arg.attr}" if bound else "a lambda over self"
                bad.append(f"{shown}:{arg.lineno} hands {what} to {ast.unparse(node.func)}(): "
                           "a call back into the trainer")
    return bad


def test_the_callback_scan_sees_a_planted_call_back(tmp_path):
    hook = tmp_path / "hook.py"
    hook.write_text("def f(trainer, x):\n    return trainer._rc_reduce(x, 'sum')\n")
    trainer = tmp_path / "trainer.py"
    trainer.write_text("class T:\n    def _r(self, x):\n        return x\n"
                       "    def step(self, x):\n        g(x, reduce_fn=self._r)\n"
                       "        return h(lambda: self._r(x))\n")
    assert [b for b in trainer_calls(hook, "hook.py") if "trainer._rc_reduce()" in b]
    found = handed_callbacks(trainer, {"_r"}, "trainer.py")
    assert len(found) == 2 and "self._r" in found[0] and "lambda" in found[1], found
    assert not handed_callbacks(trainer, set(), "trainer.py")[:-1]  # not a method of a trainer: only the lambda


@pytest.mark.parametrize("path", library_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_nothing_below_the_trainers_calls_back_into_a_trainer(path):
    layer = folder(module_name(path))
    bad = (trainer_calls(path) if layer in BELOW_THE_TRAINERS else []) + (
        handed_callbacks(path, trainer_methods()) if layer in TRAINER_FOLDERS else [])
    assert not bad, "\n".join(bad)
