"""Metric-key prefixes are defined once (``core/stats.py``) and stripped by name, never sliced by position (#30)."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest
import torch

from trl_rollout_corr.core.stats import MAX, METRIC_PREFIX, MIN, SUM, RolloutStats, summed

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "trl_rollout_corr"


def test_summed_strips_the_sum_tag_by_name():
    stats = RolloutStats(sums={"loss.micro_batches": torch.tensor(4.0), "loss.empty_micro_batches": torch.tensor(1.0),
                               "mask.tok_n": torch.tensor(9.0)},
                         maxes={"loss.micro_batches": torch.tensor(7.0)}, mins={"loss.x": torch.tensor(-1.0)})
    floats = stats.to_floats()
    assert floats.keys() == {SUM + "loss.micro_batches", SUM + "loss.empty_micro_batches", SUM + "mask.tok_n",
                             MAX + "loss.micro_batches", MIN + "loss.x"}
    assert summed(floats, "loss.") == {"loss.micro_batches": 4.0, "loss.empty_micro_batches": 1.0}
    assert summed(floats, "mask.") == {"mask.tok_n": 9.0} and summed(floats, "lag.") == {}


def test_the_metric_prefix_is_defined_once():
    """No module but core/stats.py binds a name to the string "rollout_corr/" (the others import METRIC_PREFIX)."""
    assert METRIC_PREFIX == "rollout_corr/"
    defined = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant)
                    and node.value.value == METRIC_PREFIX):
                defined.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert [d.split(":")[0] for d in defined] == ["core/stats.py"], defined


def test_no_metric_key_is_sliced_by_position():
    """``key[4:]`` after ``key.startswith("sum:...")`` silently breaks when a tag changes: strip with removeprefix."""
    sliced = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice) and node.slice.upper is None
                    and isinstance(node.slice.lower, ast.Constant) and node.slice.lower.value in (len(SUM),
                                                                                              len(METRIC_PREFIX))
                    and isinstance(node.value, ast.Name) and node.value.id in ("k", "key", "name")):
                sliced.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not sliced, sliced


# ---------------------------------------------------------------- one registry of metric names (issue #30 item 4)
REGISTRY = "core/metric_names.py"
_SPELT = re.compile(r"(?<![\w/.-])rollout_corr/(?!\*)")  # a key spelt by hand; not trl_rollout_corr/..., rollout_corr/*


def hand_spelled_metric_keys(source: str, where: str) -> list[str]:
    """``line: text`` of every metric key spelt by hand in module ``where`` (path relative to the package): a string
    (f-string pieces and implicit concatenations included, docstrings and other bare string statements excepted)
    with ``rollout_corr/`` in it, and outside ``core/`` (whose finalizers build the names) ``METRIC_PREFIX + "name"``
    or ``f"{METRIC_PREFIX}name"``. Only core/stats.py's ``METRIC_PREFIX = "rollout_corr/"`` is allowed."""
    tree = ast.parse(source)
    documentation = {id(node.value) for node in ast.walk(tree)
                     if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    allowed = {id(node.value) for node in ast.walk(tree) if where == "core/stats.py" and isinstance(node, ast.Assign)
               and [ast.unparse(t) for t in node.targets] == ["METRIC_PREFIX"]}
    prefix_names = ("METRIC_PREFIX", "PREFIX")
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in documentation | allowed
                and _SPELT.search(node.value)):
            found.append(f"{node.lineno}: {node.value!r}")
        if where.startswith("core/"):
            continue
        if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and isinstance(node.left, ast.Name)
                and node.left.id in prefix_names and isinstance(node.right, ast.Constant)):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.JoinedStr):
            for before, after in zip(node.values, node.values[1:]):
                if (isinstance(before, ast.FormattedValue) and isinstance(before.value, ast.Name)
                        and before.value.id in prefix_names and isinstance(after, ast.Constant)
                        and re.match(r"\w", after.value)):
                    found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_scan_flags_every_hand_spelled_form():
    """The forms the package had before the registry (git 80eaf99: monitor/rules.py, monitor/callback.py, demo/run.py,
    the trainers) are flagged; docstrings, ``rollout_corr/*`` and paths like ``trl_rollout_corr/recipes`` are not."""
    flagged = '''
SIGNALS = {"kl": "rollout_corr/kl"}
message = (f"the correction rejects {x:.1%} of tokens (smoothed rollout_corr/rejected_token_fraction)"
           "more text")
warning = ("are counted in "
           "rollout_corr/missing_rollout_logprobs_fraction. Set require_rollout_logprobs=True")
out = [f"  rollout_corr/{k:28s} {log['rollout_corr/' + k]: .3e}" for k in keys]
metrics[METRIC_PREFIX + "all_rejected_micro_batches"] = 1
other = f"{METRIC_PREFIX}rollout_rs_{name}"
'''
    lines = lambda where: sorted(int(hit.split(":")[0]) for hit in hand_spelled_metric_keys(flagged, where))  # noqa: E731
    assert lines("monitor/rules.py") == [2, 3, 5, 7, 7, 8, 9]  # line 7: the f-string piece and 'rollout_corr/' + k
    assert lines("core/divergence.py") == [2, 3, 5, 7, 7]  # the core's finalizers may prefix a name
    clean = '''"""Module docstring: logs ``rollout_corr/kl``."""
def f():
    """``{"rollout_corr/<name>": float}``"""
x = 1
"""Attribute docstring: rollout_corr/kl."""
lead = f"No {METRIC_PREFIX}* metrics are logged"
note = "a precision mismatch the rollout_corr/* metrics measure"
path = "(trl_rollout_corr/recipes is missing)"
key = metric("kl")
line = f"  {METRIC_PREFIX}{k:28s} {log[metric(k)]: .3e}"
'''
    assert hand_spelled_metric_keys(clean, "monitor/rules.py") == []
    assert hand_spelled_metric_keys('METRIC_PREFIX = "rollout_corr/"', "core/stats.py") == []
    assert len(hand_spelled_metric_keys('METRIC_PREFIX = "rollout_corr/"', "monitor/rules.py")) == 1


def test_no_module_but_the_registry_spells_a_metric_key():
    """Every module of the package asks the registry (``metric("kl")``) for a metric key instead of spelling
    ``"rollout_corr/kl"``; a renamed metric then fails where it is read, not silently in the logs."""
    spelt = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where != REGISTRY and (found := hand_spelled_metric_keys(path.read_text(encoding="utf-8"), where)):
            spelt[where] = found
    assert not spelt, spelt


def test_metric_returns_the_logged_key_or_names_the_unknown_name():
    from trl_rollout_corr.core.metric_names import METRIC_NAMES, is_metric, metric

    assert metric("kl") == METRIC_PREFIX + "kl" and metric("rollout_is_eff_sample_size") in {
        METRIC_PREFIX + name for name in METRIC_NAMES}
    assert metric("lag_0/kl") == METRIC_PREFIX + "lag_0/kl" and is_metric("lag_12/sample_fraction")
    assert metric("rollout_rs_seq_max_k2_seq_masked_fraction") and metric("all_rejected_micro_batches")
    for bad in ("kl_divergence", METRIC_PREFIX + "kl", "lag_1/lag_mean", "lag_01/kl", "lag_k/kl", "", "rollout_is"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            metric(bad)


def test_every_key_the_monitor_reads_is_a_registered_metric():
    """The alert rules' signals and the plotted columns: TRL's own keys, or a metric the registry knows."""
    from trl_rollout_corr.core.metric_names import is_metric
    from trl_rollout_corr.monitor.callback import _PLOTTED
    from trl_rollout_corr.monitor.rules import SIGNALS

    trl_keys = {"reward", "entropy"}
    read = [*SIGNALS.values(), *_PLOTTED]
    ours = [key for key in read if key not in trl_keys]
    assert len(set(ours)) == 7 and all(key.startswith(METRIC_PREFIX) for key in ours), ours  # lag_0/kl: 7th
    unknown = [key for key in ours if not is_metric(key.removeprefix(METRIC_PREFIX))]
    assert not unknown, unknown
