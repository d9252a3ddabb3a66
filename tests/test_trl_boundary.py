"""Nothing outside ``trl_rollout_corr/trl_hooks/`` touches TRL's private API or patches TRL (issue #30).

Every module of ``trl_rollout_corr`` outside ``trl_hooks/`` is parsed with ``ast`` (all of it: top level, functions,
class bodies) and must contain none of:

1. an attribute access ``<anything>.<name>``, or a string constant equal to ``<name>`` (``getattr(obj, "<name>")``),
   for ``<name>`` in :data:`TRL_PRIVATE_NAMES`: the private TRL attributes the package used outside the boundary
   before it existed (found with grep: the private methods of ``GRPOTrainer`` / ``AsyncGRPOTrainer`` / the
   ``transformers.Trainer`` methods TRL's trainer inherits, TRL's private timer, TRL's vLLM weight iterator and its
   tree-attention kernel loader);
2. an import of a private name from a ``trl`` module (``from trl.x import _y``) or of a private ``trl`` module
   (``import trl._x``, ``from trl._x import y``);
3. a patch of TRL: an assignment to an attribute of a name imported from ``trl`` (``trl_module.Name = ...``,
   ``setattr(trl_module, ...)``), or ``importlib.import_module("trl...")``, the module path given as a string or as a
   name assigned such a string (the way a module is fetched to patch it).

What it does not check: method *definitions* named like TRL's private hooks (``def _generate(self, ...)`` in the
trainers: overriding a hook is how a subclass plugs in; the calls to TRL's versions go through ``trl_hooks``), private
names of other libraries (transformers' ``GenerationMixin``, vLLM), and private names not in the list (add them when
the package starts using one: the last test checks that every listed name is still used, inside the boundary).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "trl_rollout_corr"
BOUNDARY = "trl_hooks"

TRL_PRIVATE_NAMES = (
    "_generate",  # GRPOTrainer
    "_generate_and_score_completions",
    "_generate_single_turn",
    "_get_per_token_logps_and_entropies",
    "_compute_loss",
    "_save_checkpoint",  # transformers.Trainer, as GRPOTrainer inherits it
    "_get_output_dir",
    "_sync_weight",  # AsyncGRPOTrainer
    "_step_forward_s",
    "_iter_named_params",  # trl.generation.vllm_generation.VLLMGeneration
    "_flash_attn",  # trl.experimental.async_grpo.packing
)


def is_trl(module: str | None) -> bool:
    return module == "trl" or (module or "").startswith("trl.")


def violations(source: str) -> list[str]:
    """What ``source`` does that only the boundary may do (each as ``line: what``)."""
    tree = ast.parse(source)
    trl_names = set()  # local names bound to something imported from trl
    trl_paths = set()  # names assigned a "trl...." module path
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if is_trl(alias.name):
                    trl_names.add(alias.asname or alias.name.split(".")[0])
                    if any(part.startswith("_") for part in alias.name.split(".")):
                        found.append(f"{node.lineno}: import of the private module {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and is_trl(node.module):
            if any(part.startswith("_") for part in node.module.split(".")):
                found.append(f"{node.lineno}: import from the private module {node.module}")
            for alias in node.names:
                trl_names.add(alias.asname or alias.name)
                if alias.name.startswith("_"):
                    found.append(f"{node.lineno}: import of {node.module}.{alias.name}")
        elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
              and isinstance(node.value.value, str) and is_trl(node.value.value)):
            trl_paths.update(target.id for target in node.targets if isinstance(target, ast.Name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in TRL_PRIVATE_NAMES:
            found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in TRL_PRIVATE_NAMES:
            found.append(f"{node.lineno}: the string {node.value!r}")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id in trl_names):
                    found.append(f"{node.lineno}: patches {target.value.id}.{target.attr}")
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            first = node.args[0] if node.args else None
            if name == "setattr" and isinstance(first, ast.Name) and first.id in trl_names:
                found.append(f"{node.lineno}: setattr on {first.id}")
            if name == "import_module" and (
                    (isinstance(first, ast.Constant) and isinstance(first.value, str) and is_trl(first.value))
                    or (isinstance(first, ast.Name) and first.id in trl_paths)):
                found.append(f"{node.lineno}: import_module({ast.unparse(first)})")
    return found


def outside_files():
    return sorted(p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != BOUNDARY)


def test_the_scan_finds_each_kind_of_violation():
    source = """
import importlib
import trl.generation.vllm_generation as trl_vllm
from trl.experimental.async_grpo import packing
from trl.trainer.utils import _private
from trl._compat import thing

class T:
    def _generate(self, prompts):  # an override: allowed
        return super()._generate(prompts)

def f(trainer, gen):
    trainer._step_forward_s += 1.0
    getattr(gen, "_iter_named_params")
    trl_vllm.LLM = None
    setattr(packing, "x", 1)
    importlib.import_module("trl.experimental.async_grpo.async_grpo_trainer")
    importlib.import_module(_MODULE)

_MODULE = "trl.generation.vllm_generation"
"""
    found = violations(source)
    for what in ("import of trl.trainer.utils._private", "import from the private module trl._compat",
                 ": ._generate", ": ._step_forward_s", "the string '_iter_named_params'", "patches trl_vllm.LLM",
                 "setattr on packing", "import_module('trl.experimental", "import_module(_MODULE)"):
        assert any(what in line for line in found), (what, found)
    assert len(found) == 9, found  # the override `def _generate` itself is not one
    assert outside_files() and not any(BOUNDARY in p.parts for p in outside_files())


@pytest.mark.parametrize("path", outside_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_trl_private_name_or_patch_outside_the_boundary(path):
    found = violations(path.read_text())
    assert not found, (f"{path.relative_to(PACKAGE.parent)} uses TRL's private API outside trl_rollout_corr/"
                       f"{BOUNDARY}/: {found}. Move it behind a function of the boundary that checks the assumption "
                       "and raises TrlInternalsChanged.")


def test_every_listed_private_name_is_still_used_inside_the_boundary():
    source = "\n".join(p.read_text() for p in sorted((PACKAGE / BOUNDARY).rglob("*.py")))
    unused = [name for name in TRL_PRIVATE_NAMES if name not in source]
    assert not unused, f"{unused} no longer appear in trl_hooks/: drop them from TRL_PRIVATE_NAMES"
