"""Examples and recipes follow the verdict: each runs TRL's default correction or a verdict row's recommendation.

The allowed presets come from the code's own record of the advice (``monitor/verdict.py``'s ``VERDICTS``: a row's
``setting`` ``rollout_correction_preset=NAME``; no preset is TRL's default). A recipe that only shows a method's
settings is an explicit exception below, with its reason, and must say "NOT ADVISED" in its first comment; one that
follows a row other than the default names the row's key in its comments (and an example, in its docstring).
"""

from __future__ import annotations

import ast
import glob
import os

import pytest
import yaml

from trl_rollout_corr.monitor.advice import REMEDIES
from trl_rollout_corr.monitor.verdict import VERDICTS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRESET_SETTING = "rollout_correction_preset="
#: None: no preset (TRL's default correction); trl_default names the same correction
DEFAULT = {None, "trl_default"}
#: preset -> the verdict rows that recommend it
ROW_PRESETS: dict[str, list[str]] = {}
#: a row that recommends the monitor's stale remedy recommends each of its equally confirmed settings
#: (``monitor/advice.py``'s ``Remedy.settings``: dppo_kl_bypass first, ppo_is_bypass, experiment G)
STALE_SETTINGS = REMEDIES["stale"].settings
for _row in VERDICTS:
    _settings = list(STALE_SETTINGS) if _row.setting in STALE_SETTINGS else [_row.setting]
    for _setting in _settings:
        if _setting.startswith(PRESET_SETTING):
            ROW_PRESETS.setdefault(_setting.removeprefix(PRESET_SETTING), []).append(_row.key)

_NO_ROW = "shows the method's settings; no verdict row recommends it"
#: recipes that are not the default or a row's recommendation, and why they stay (docs/trainer.md lists them all)
NOT_ADVISED = {
    "decoupled_geo_rs": _NO_ROW + " (its band rejected 88% of the tokens at a per-token KL of 7e-4, docs/probe.md)",
    "decoupled_seq_is": _NO_ROW,
    "decoupled_seq_is_rs": _NO_ROW,
    "decoupled_token_is": _NO_ROW,
    "pg_is": _NO_ROW,
    "pg_rs": _NO_ROW,
    "disabled": "no correction: the uncorrected reference arm of a comparison, for diagnostics",
}
#: recipes that configure something other than one training run
NOT_TRAINING = {"cpu_demo": "the main job's configuration (`trl-rollout-corr demo`): its variants compare methods"}

RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "*.yaml")))
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "*.py")))


def _name(path: str) -> str:
    return os.path.basename(path).rsplit(".", 1)[0]


def test_the_allowed_presets_come_from_the_verdict_table():
    # the non-default presets a row recommends today: the stale-engine row's two, equally confirmed (experiment G)
    assert {p: rows for p, rows in ROW_PRESETS.items() if p not in DEFAULT} == {
        "dppo_kl_bypass": ["stale-engine"], "ppo_is_bypass": ["stale-engine"]}
    assert not set(NOT_ADVISED) & (DEFAULT | set(ROW_PRESETS)), "an exception that is advised: remove it"


@pytest.mark.parametrize("path", RECIPES, ids=_name)
def test_every_recipe_runs_the_default_or_a_rows_recommendation(path):
    name = _name(path)
    with open(path) as f:
        text = f.read()
    config = yaml.safe_load(text)
    comments = "\n".join(line for line in text.splitlines() if line.lstrip().startswith("#"))
    if name in NOT_TRAINING:
        assert "rollout_correction_preset" not in config, name
        return
    preset = config.get("rollout_correction_preset")
    if name in NOT_ADVISED:
        assert text.startswith("# NOT ADVISED"), f"recipes/{name}.yaml must open with '# NOT ADVISED ...'"
        assert "trl_default.yaml" in comments.split("\n# trl-rollout-corr train")[0]  # where to start instead
        return
    assert preset in DEFAULT or preset in ROW_PRESETS, (
        f"recipes/{name}.yaml runs preset {preset!r}: neither TRL's default nor a verdict row's recommendation "
        f"({sorted(ROW_PRESETS)}); advise it in VERDICTS, or list it in NOT_ADVISED with its reason")
    for key in [] if preset in DEFAULT else ROW_PRESETS.get(preset, []):
        assert key in comments, f"recipes/{name}.yaml follows the verdict row {key!r}: name it in its comments"
    if "stale-engine" in ROW_PRESETS.get(preset, []):  # the row is for a stale engine only
        assert config.get("vllm_sync_interval", 1) > 1 and config.get("rollout_corr_monitor_lag", 0) > 0


def test_trl_default_has_a_recipe():
    with open(os.path.join(ROOT, "recipes", "trl_default.yaml")) as f:
        assert yaml.safe_load(f)["rollout_correction_preset"] == "trl_default"


def _example_presets(path: str) -> tuple[set[str | None], str]:
    """The presets an example can run with no arguments: every ``rollout_correction_preset=`` keyword's constant (or,
    for ``cli.preset``, its argparse default), None where no call sets one; and its docstring."""
    with open(path) as f:
        tree = ast.parse(f.read())
    defaults = {}
    for node in ast.walk(tree):  # parser.add_argument("--preset", default=...)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args and \
                isinstance(node.args[0], ast.Constant):
            for kw in node.keywords:
                if kw.arg == "default" and isinstance(kw.value, ast.Constant):
                    defaults[node.args[0].value.lstrip("-")] = kw.value.value
    presets: set[str | None] = set()
    configs = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")).endswith(
                "GRPOConfig"):
            configs += 1
            found = [kw.value for kw in node.keywords if kw.arg == "rollout_correction_preset"]
            if not found:
                presets.add(None)
            for value in found:
                if isinstance(value, ast.Constant):
                    presets.add(value.value)
                elif isinstance(value, ast.Attribute) and value.attr in defaults:
                    presets.add(defaults[value.attr])
                else:
                    raise AssertionError(f"{path}: cannot read rollout_correction_preset={ast.unparse(value)}")
    assert configs, f"{path}: no *GRPOConfig(...) call found"
    return presets, ast.get_docstring(tree) or ""


@pytest.mark.parametrize("path", EXAMPLES, ids=_name)
def test_every_example_runs_the_default_or_names_its_row(path):
    presets, doc = _example_presets(path)
    doc = " ".join(doc.split())
    for preset in presets:
        assert preset in DEFAULT or preset in ROW_PRESETS, (
            f"{os.path.basename(path)} runs preset {preset!r} by default: run TRL's default (no preset) unless the "
            "example is about a verdict row")
        for key in [] if preset in DEFAULT else ROW_PRESETS.get(preset, []):
            assert key in doc, f"{os.path.basename(path)} is about the verdict row {key!r}: say so in its docstring"
    assert "TRL's default" in doc or any(p not in DEFAULT for p in presets)


def test_the_reader_fails_on_an_unadvised_default(tmp_path):
    """The example reader sees a preset set directly and one behind an argparse default (the old gsm8k example)."""
    bad = tmp_path / "bad.py"
    bad.write_text('"""x"""\nimport argparse\np = argparse.ArgumentParser()\np.add_argument("--preset", '
                   'default="decoupled_token_is")\ncli = p.parse_args()\nRolloutCorrGRPOConfig(rollout_correction_'
                   'preset=cli.preset)\nRolloutCorrGRPOConfig(rollout_correction_preset="pg_rs")\n')
    assert _example_presets(str(bad))[0] == {"decoupled_token_is", "pg_rs"}
    with pytest.raises(AssertionError, match="decoupled_token_is|pg_rs"):
        test_every_example_runs_the_default_or_names_its_row(str(bad))
