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
   name assigned such a string (the way a module is fetched to patch it);
4. a patch of, or a reach into, one of TRL's *objects* the package reaches through a trainer: an assignment, augmented
   assignment or ``del`` of an attribute or item of it, ``setattr``/``delattr`` on it, or its requests ``.session``
   (``client.session.mount(...)``, ``client.session.post(...)``). TRL's objects are the values of the attributes in
   :data:`TRL_OBJECT_ATTRIBUTES` (``trainer.vllm_generation``, ``gen.vllm_client``), anything reached from one by
   attribute (``gen.vllm_client``, ``gen.llm``, ``gen.sync_weights``), the local names bound to one (``gen =
   trainer.vllm_generation``, in a function's scope and the functions nested in it, unless they bind the name
   themselves) and the parameters of a function of the same module called with one
   (``install_cpu_server_sync(gen)``). Nothing else is TRL's: the trainer itself is this package's subclass
   (``trainer.vllm_sync_steps = []`` is fine), and what a call returns is not tracked (a boundary function's result,
   ``client_session(client).post(...)``, is fine). Calling an object's methods (``gen.generate(...)``,
   ``client.get_server_info()``) and reading its attributes is not a patch.

What it does not check: method *definitions* named like TRL's private hooks (``def _generate(self, ...)`` in the
trainers: overriding a hook is how a subclass plugs in; the calls to TRL's versions go through ``trl_hooks``), private
names of other libraries (transformers' ``GenerationMixin``, vLLM), and private names not in the list (add them when
the package starts using one: the last test checks that every listed name is still used, inside the boundary), and
TRL objects reached otherwise than through the attributes in :data:`TRL_OBJECT_ATTRIBUTES` (add the attribute when the
package starts reaching one).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "trl_rollout_corr"
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

TRL_OBJECT_ATTRIBUTES = (  # attributes of TRL's trainers (or of its objects) that hold one of TRL's objects
    "vllm_generation",  # GRPOTrainer.vllm_generation: trl.generation.vllm_generation.VLLMGeneration
    "vllm_client",  # VLLMGeneration.vllm_client: trl.generation.vllm_client.VLLMClient
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
    return found + trl_object_patches(tree)


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _parameters(scope: ast.AST) -> list[str]:
    a = scope.args
    return [p.arg for p in (*a.posonlyargs, *a.args, a.vararg, *a.kwonlyargs, a.kwarg) if p is not None]


def _scope_nodes(scope: ast.AST):
    """Every node of ``scope``'s own body: nested functions are yielded, not entered (their defaults and decorators
    are counted in their own scope, a simplification)."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, _SCOPES):
            stack.extend(ast.iter_child_nodes(node))


def trl_object_patches(tree: ast.Module) -> list[str]:
    """Rule 4 of the module docstring: the patches of, or reaches into, TRL's objects in ``tree`` (``line: what``)."""
    functions: dict[str, list[ast.AST]] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions.setdefault(node.name, []).append(node)
    bound_params: dict[ast.AST, set[str]] = {}  # function -> its parameters passed one of TRL's objects at a call

    def visit(scope: ast.AST, inherited: frozenset[str], found: list[str]) -> None:
        nodes = list(_scope_nodes(scope))
        local = set(_parameters(scope)) if isinstance(scope, _SCOPES) else set()
        local |= {node.id for node in nodes if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
        owned = (set(inherited) - local) | bound_params.get(scope, set())  # a name bound here is this scope's

        def trl_object(expr: ast.AST) -> bool:
            if isinstance(expr, ast.Name):
                return expr.id in owned
            if isinstance(expr, ast.Attribute):
                return expr.attr in TRL_OBJECT_ATTRIBUTES or trl_object(expr.value)
            return False

        grew = True
        while grew:  # names bound to one of TRL's objects, wherever in the scope they are bound
            grew = False
            for node in nodes:
                if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and node.value is not None \
                        and trl_object(node.value):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    new = {t.id for t in targets if isinstance(t, ast.Name)} - owned
                    owned.update(new)
                    grew = grew or bool(new)
        for node in nodes:
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Delete):
                targets = node.targets
            for target in targets:
                if isinstance(target, (ast.Attribute, ast.Subscript)) and trl_object(target.value):
                    found.append(f"{node.lineno}: patches TRL's object: {ast.unparse(target)}")
            if isinstance(node, ast.Attribute) and node.attr == "session" and trl_object(node.value):
                found.append(f"{node.lineno}: reaches TRL's requests session: {ast.unparse(node)}")
            if isinstance(node, ast.Call):
                if isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") and node.args \
                        and trl_object(node.args[0]):
                    found.append(f"{node.lineno}: {node.func.id} on TRL's object {ast.unparse(node.args[0])}")
                if isinstance(node.func, ast.Name):  # a function of this module called with one of TRL's objects
                    for function in functions.get(node.func.id, []):
                        a = function.args
                        positional = [p.arg for p in (*a.posonlyargs, *a.args)]
                        passed = set()
                        for i, arg in enumerate(node.args):
                            if isinstance(arg, ast.Starred) or not trl_object(arg):
                                continue
                            if i < len(positional):
                                passed.add(positional[i])
                            elif a.vararg is not None:
                                passed.add(a.vararg.arg)
                        passed |= {kw.arg for kw in node.keywords
                                   if kw.arg in _parameters(function) and trl_object(kw.value)}
                        bound_params.setdefault(function, set()).update(passed)
            if isinstance(node, _SCOPES):
                visit(node, frozenset(owned), found)

    while True:  # until no call passes one of TRL's objects to a parameter not yet known to hold one
        before = sum(map(len, bound_params.values()))
        found: list[str] = []
        visit(tree, frozenset(), found)
        if sum(map(len, bound_params.values())) == before:
            return sorted(set(found), key=lambda line: (int(line.split(":")[0]), line))


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


def test_the_scan_finds_patches_of_trls_objects_and_not_of_the_packages():
    """The patches vllm/engine.py made before they moved to trl_hooks/vllm.py (abridged), each found; the same
    operations on the package's own objects, and calls through the boundary, not."""
    source = """
import functools

def finish(trainer, setup):
    gen = trainer.vllm_generation
    install_sync(gen, token=setup["token"])
    bound(gen.vllm_client, 10.0)
    trainer.vllm_sync_steps = []            # the trainer is this package's subclass: fine
    trainer.vllm_engine_dtype = "float32"   # fine
    setattr(trainer, "vllm_refresh_pending", False)  # fine
    trainer.vllm_generation.generate = None
    setattr(gen, "generate", None)

def install_sync(gen, token=None):
    def sync_weights():
        client = gen.vllm_client
        client_session(client).post("/collective_rpc")   # through the boundary: fine
        client.reset_prefix_cache()                       # a method of TRL's client, called: fine
        gen = None                                        # rebinds the name in this scope
        gen.x = 1                                         # so not TRL's object here
    gen.sync_weights = sync_weights

def bound(client, timeout):
    client.session.mount("http://", None)

def wrap(trainer):
    gen = trainer.vllm_generation
    gen.generate = functools.partial(print, gen.generate)
    del gen.vllm_client.session
    gen.llm.cache[0] = None
    sync = gen.sync_weights
    sync.__doc__ = "x"    # what is read off TRL's object is TRL's too

def own(engine, client, gen):
    engine.generate = None    # parameters of a function called with no TRL object: the package's own
    client.session = None
    gen.sync_weights = None

def calls_own(engine):
    own(engine, object(), engine)
"""
    found = violations(source)
    expected = ("11: patches TRL's object: trainer.vllm_generation.generate", "12: setattr on TRL's object gen",
                "21: patches TRL's object: gen.sync_weights",
                "24: reaches TRL's requests session: client.session",
                "28: patches TRL's object: gen.generate", "29: patches TRL's object: gen.vllm_client.session",
                "29: reaches TRL's requests session: gen.vllm_client.session",
                "30: patches TRL's object: gen.llm.cache[0]", "32: patches TRL's object: sync.__doc__")
    assert found == list(expected), found


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
    source = "\n".join(p.read_text() for p in sorted(PACKAGE.rglob("*.py")))
    unreached = [name for name in TRL_OBJECT_ATTRIBUTES if f".{name}" not in source]
    assert not unreached, f"the package no longer reaches {unreached}: drop them from TRL_OBJECT_ATTRIBUTES"
