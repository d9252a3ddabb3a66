"""Metric-key prefixes are defined once (``core/stats.py``) and stripped by name, never sliced by position (#30)."""

from __future__ import annotations

import ast
import pathlib

import torch

from trl_rollout_corr.core.stats import MAX, METRIC_PREFIX, MIN, SUM, RolloutStats, summed

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "trl_rollout_corr"


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
