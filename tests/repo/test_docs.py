"""The documentation builds and says what the code does.

- ``mkdocs build --strict`` (warnings are errors: broken links and anchors, pages missing from the nav, docstrings the
  API reference cannot render) into a temporary directory;
- every docs page is linked from the README, and every relative link of the README leads to a file (and a heading);
- the preset table of docs/trainer.md lists exactly ``RolloutCorrectionConfig.preset_names()``, its recipe column and
  the recipe list are the files in ``recipes/``, and every preset count stated in the README, the docs and the
  changelog is the registry's;
- the configuration table lists every correction field and this package's trainer-config fields, with their defaults;
- the metrics reference lists every ``rollout_corr/*`` name the package can log, and nothing else;
- the monitor's documented thresholds are its defaults; the README's decision table quotes the benchmark's numbers.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.bench_utils import doc_block, doc_files

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGE = {path.name: path.read_text(encoding="utf-8") for path in DOCS}


def table_rows(block: str) -> list[list[str]]:
    """The cells of a markdown table's body rows (header and separator dropped)."""
    rows = [line for line in block.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows[2:]]


def code_names(cell: str) -> list[str]:
    """The names written as code in a table cell."""
    return re.findall(r"`([^`]+)`", cell)


# ---------------------------------------------------------------- the site builds, every page is reachable
def test_the_site_builds_with_warnings_as_errors(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None:
        pytest.skip("mkdocs / mkdocstrings are not installed (pip install -e \".[docs]\"; the dev extra has them)")
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(ROOT / "mkdocs.yml"), "--site-dir", str(site)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    for name in ("RolloutCorrGRPOConfig", "RolloutCorrGRPOTrainer", "RolloutCorrAsyncGRPOConfig",
                 "RolloutCorrAsyncGRPOTrainer", "RolloutCorrectionConfig", "RolloutCorrectionMonitor",
                 "compute_rollout_correction_and_rejection_mask", "compute_rollout_correction_stats"):
        assert 'id="trl_rollout_corr.' in api and f"{name}</code>" in api, name
    assert "Resolution order" in api  # a docstring's text, not only the headings


def test_every_docs_page_is_in_the_nav_and_linked_from_the_readme():
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["nav"]
    in_nav = {page for entry in nav for page in entry.values()}
    assert in_nav == set(PAGE), "mkdocs.yml's nav and docs/*.md differ"
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)(?:#[\w-]*)?\)", README))
    assert set(PAGE) <= linked, f"docs pages not linked from the README: {sorted(set(PAGE) - linked)}"


def _anchors(markdown_text: str) -> set[str]:
    from markdown.extensions.toc import slugify  # mkdocs' (Python-Markdown's) heading ids

    text = re.sub(r"```.*?```", "", markdown_text, flags=re.S)
    return ({slugify(re.sub(r"[`*]", "", heading), "-") for heading in re.findall(r"^#+ (.+)$", text, re.M)}
            | set(re.findall(r'<a id="([\w-]+)"></a>', text)))  # the evidence page's anchors per row


def test_the_readme_s_relative_links_resolve():
    links = re.findall(r"\]\((?!https?://)([^)#\s]+)(?:#([^)\s]+))?\)", README)
    assert links
    for target, anchor in links:
        path = ROOT / target
        assert path.is_file(), f"README links to {target}, which does not exist"
        if anchor and importlib.util.find_spec("markdown") is not None:
            assert anchor in _anchors(path.read_text(encoding="utf-8")), f"README links to {target}#{anchor}"


# ---------------------------------------------------------------- presets, recipes and counts
def _registry():
    from trl_rollout_corr.config.correction import RolloutCorrectionConfig
    from trl_rollout_corr.config.compat import VERL_PRESETS

    return RolloutCorrectionConfig.preset_names(), RolloutCorrectionConfig.PRESETS, VERL_PRESETS


def _recipes() -> list[str]:
    return sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml") if p.stem != "cpu_demo")


def test_the_preset_table_is_the_registry():
    names, _, _ = _registry()
    rows = table_rows(doc_block("preset-table", "docs/trainer.md"))
    documented = [code_names(row[0])[0] for row in rows]
    assert len(documented) == len(set(documented)), "a preset is listed twice"
    assert set(documented) == set(names), (sorted(set(names) - set(documented)), sorted(set(documented) - set(names)))
    for row in rows:  # the recipe column names exactly the presets that have a YAML in recipes/
        preset, recipe = code_names(row[0])[0], row[-1]
        assert recipe == (f"`recipes/{preset}.yaml`" if preset in _recipes() else "–"), preset


def test_the_recipe_list_is_the_recipes_folder():
    listed = [name.removesuffix(".yaml") for name in code_names(doc_block("recipe-list", "docs/trainer.md"))]
    assert listed == _recipes()


def test_preset_counts_in_the_text_are_the_registry_s():
    names, ours, verl = _registry()
    texts = {path.name: path.read_text(encoding="utf-8") for path in [*doc_files(), ROOT / "CHANGELOG.md"]}
    seen = 0
    for name, text in texts.items():
        text = " ".join(text.split())  # counts may wrap across lines
        for n in re.findall(r"\b(\d+) presets\b(?! with a recipe)", text):
            assert int(n) == len(names), f"{name}: '{n} presets', the registry has {len(names)}"
            seen += 1
        for n in re.findall(r"\b(\d+) (?:presets with a recipe|of the \d+ presets)\b", text):
            assert int(n) == len(_recipes()), f"{name}: {n} presets with a recipe, recipes/ has {len(_recipes())}"
        for n in re.findall(r"\b(\d+) of this package's\b", text):
            assert int(n) == len(ours), f"{name}: '{n} of this package's', the registry has {len(ours)}"
        for n in re.findall(r"\b(\d+) of verl's\b", text):
            assert int(n) == len(verl), f"{name}: '{n} of verl's', the registry has {len(verl)}"
    assert seen >= 3


# ---------------------------------------------------------------- configuration fields and defaults
def _dataclass_defaults(path: Path, class_name: str) -> dict[str, object]:
    """Field -> default of a dataclass, read from its source (importing TRL's config classes takes seconds)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    cls = next(node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == class_name)
    out = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            if "ClassVar" in ast.unparse(node.annotation):
                continue
            value = node.value
            if isinstance(value, ast.Call) and ast.unparse(value.func) == "field":
                value = next(k.value for k in value.keywords if k.arg == "default")
            out[node.target.id] = ast.literal_eval(value)
    return out


def _shown(value: object) -> str:
    return "`" + (f'"{value}"' if isinstance(value, str) else repr(value)) + "`"


def test_the_configuration_table_has_every_field_and_its_default():
    from trl_rollout_corr.config.correction import RolloutCorrectionConfig
    from trl_rollout_corr.config.fields import RolloutCorrectionFields
    from trl_rollout_corr.config.server_fields import VllmServerFields

    flat = {f.name: f.default for f in dataclasses.fields(RolloutCorrectionFields)}
    flat.update(_dataclass_defaults(ROOT / "trl_rollout_corr" / "grpo" / "config.py", "RolloutCorrGRPOConfig"))
    flat.update({f.name: f.default for f in dataclasses.fields(VllmServerFields)})  # shared with the async config
    core = {f.name: f.default for f in dataclasses.fields(RolloutCorrectionConfig)}
    rows = table_rows(doc_block("config-fields", "docs/trainer.md"))
    documented = [code_names(row[0])[0] for row in rows]
    missing, extra = sorted(set(flat) - set(documented)), sorted(set(documented) - set(flat))
    assert sorted(documented) == sorted(flat), (missing, extra)
    for row in rows:
        name = code_names(row[0])[0]
        assert row[1] == _shown(flat[name]), f"{name}: documented default {row[1]}, code {flat[name]!r}"
        assert row[2] == (_shown(core[name]) if name in core else "–"), f"{name}: RolloutCorrectionConfig default"


def _class_constant(path: Path, class_name: str, name: str) -> object:
    """A class-level constant, read from the source (as ``_dataclass_defaults``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    cls = next(node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == class_name)
    return next(ast.literal_eval(node.value) for node in cls.body if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == name for t in node.targets))


def test_the_default_corrections_table_is_the_code_s():
    """One documented default per config: the table names the preset each trainer config's ``_RC_DEFAULT_PRESET``
    names, and ``RolloutCorrectionConfig()`` equals the preset listed for it."""
    from trl_rollout_corr.config.correction import RolloutCorrectionConfig

    rows = {code_names(row[0])[0]: code_names(row[1])[0] for row in table_rows(doc_block("default-corrections",
                                                                                          "docs/trainer.md"))}
    package = ROOT / "trl_rollout_corr"
    assert rows == {
        "RolloutCorrGRPOConfig": _class_constant(package / "grpo" / "config.py", "RolloutCorrGRPOConfig",
                                                 "_RC_DEFAULT_PRESET"),
        "RolloutCorrAsyncGRPOConfig": _class_constant(package / "async_grpo" / "config.py",
                                                      "RolloutCorrAsyncGRPOConfig", "_RC_DEFAULT_PRESET"),
        "RolloutCorrectionConfig()": rows["RolloutCorrectionConfig()"]}
    assert RolloutCorrectionConfig() == RolloutCorrectionConfig.from_preset(rows["RolloutCorrectionConfig()"])


def test_the_async_config_s_own_fields_are_named():
    own = _dataclass_defaults(ROOT / "trl_rollout_corr" / "async_grpo" / "config.py", "RolloutCorrAsyncGRPOConfig")
    text = " ".join(PAGE["trainer.md"].split())
    for name in own:
        assert f"`{name}`" in text, name
    assert f"`server_unreachable_timeout_s` (default `{own['server_unreachable_timeout_s']!r}`)" in text


# ---------------------------------------------------------------- metrics
def _generic(name: str) -> str:
    from trl_rollout_corr.core.divergence import DIVERGENCE_CRITERIA

    name = re.sub(r"^rollout_corr/lag_\d+/", "rollout_corr/lag_<k>/", name)
    for criterion in sorted(DIVERGENCE_CRITERIA, key=len, reverse=True):
        name = name.replace(f"rollout_corr/rollout_rs_{criterion}_", "rollout_corr/rollout_rs_<criterion>_")
    return name


@functools.cache
def _emitted_metric_names() -> frozenset[str]:
    """Every ``rollout_corr/*`` name the package logs: the core run with every statistic switched on (two runs: the
    masked IS bound and the batch normalization are separate levels), the truncated-support and lag statistics, and
    the names the trainers write themselves (``metric("<name>")``, the registry's form, or ``METRIC_PREFIX +
    "<name>"`` / ``"rollout_corr/<name>"`` in the package's source)."""
    import torch

    from trl_rollout_corr.core import compute_rollout_correction_stats, finalize_stats
    from trl_rollout_corr.core.lag import finalize_lag, lag_stats
    from trl_rollout_corr.core.group_baseline import finalize_baseline
    from trl_rollout_corr.core.truncation import finalize_truncation

    torch.manual_seed(0)
    old, rollout = -torch.rand(4, 6), -torch.rand(4, 6)
    mask = torch.ones(4, 6)
    common = dict(rollout_rs="token", rollout_rs_threshold=5.0, rollout_token_veto_threshold=1e-4,
                  rollout_rs_criteria="token_k1,seq_max_k2", rollout_rs_criteria_threshold="0.2_5,1.0",
                  rollout_m2_threshold=0.04)
    names = set()
    for extra in (dict(rollout_is="token", rollout_is_bound="mask", rollout_is_threshold_lower=0.5),
                  dict(rollout_is="sequence", rollout_is_batch_normalize=True)):
        names |= set(finalize_stats(compute_rollout_correction_stats(old, rollout, mask, **common, **extra,
                                                                     advantages=torch.tensor([1., -1, 2, 0])).stats))
    m2po = compute_rollout_correction_stats(old, rollout, mask, rollout_m2_threshold=0.04,
                                            rollout_m2_scope="trust_region", advantages=torch.tensor([1., -1, 1, -1]))
    names |= set(finalize_stats(m2po.stats))
    lengths = torch.tensor([1, 64, 256, 1024, 4096])  # one sequence in each completion-length bucket
    long_mask = torch.arange(4096) < lengths[:, None]  # (5, 4096)
    names |= set(finalize_stats(compute_rollout_correction_stats(-torch.rand(5, 4096), -torch.rand(5, 4096),
                                                                 long_mask).stats))
    names |= set(finalize_truncation({"sum:trunc.n": 0.0}))
    names |= set(finalize_baseline({"sum:baseline.n": 8.0, "sum:baseline.excluded_n": 1.0}))
    lag = lag_stats(old, rollout, mask, mask.bool(), mask.bool(), torch.tensor([0, 1, 1, 0]), 1, torch.ones(4, 6))
    names |= set(finalize_lag(lag.to_floats()))
    for path in (ROOT / "trl_rollout_corr").rglob("*.py"):
        source = path.read_text(encoding="utf-8")
        names |= set(re.findall(r"[\"'](rollout_corr/[a-z0-9_]+)[\"']", source))
        names |= {"rollout_corr/" + n for n in re.findall(r"\b(?:METRIC_)?PREFIX \+ [\"']([a-z0-9_]+)[\"']", source)}
        names |= {"rollout_corr/" + n for n in re.findall(r"\bmetric\([\"']([a-z0-9_/]+)[\"']\)", source)}
    return frozenset(_generic(name) for name in names)


def test_the_metrics_reference_lists_every_metric_and_only_those():
    emitted = _emitted_metric_names()
    rows = table_rows(doc_block("metrics-reference", "docs/metrics.md"))
    documented = [name for row in rows for name in code_names(row[0])]
    assert all(name.startswith("rollout_corr/") for name in documented)
    assert len(documented) == len(set(documented)), "a metric is listed twice"
    assert set(documented) == emitted, (sorted(emitted - set(documented)), sorted(set(documented) - emitted))
    for row in rows:
        assert all(cell.strip() for cell in row[1:]), row[0]  # definition, direction, range: never empty


def test_the_registry_is_every_metric_the_package_emits():
    """core/metric_names.py (what ``metric(name)`` accepts) knows exactly the names above: a metric added to a
    finalizer but not to its tuple, or a registered name nothing emits, fails here."""
    from trl_rollout_corr.core.lag import LAG_METRICS
    from trl_rollout_corr.core.metric_names import METRIC_NAMES, is_metric
    from trl_rollout_corr.core.stats import METRIC_PREFIX

    registered = {_generic(METRIC_PREFIX + name) for name in METRIC_NAMES}
    registered |= {f"rollout_corr/lag_<k>/{name}" for name in LAG_METRICS}
    emitted = _emitted_metric_names()
    assert registered == emitted, (sorted(emitted - registered), sorted(registered - emitted))
    assert all(is_metric(f"lag_{k}/{name}") for k in (0, 1, 7) for name in LAG_METRICS)


def test_the_five_metrics_to_watch_are_metrics():
    emitted = _emitted_metric_names()
    watch = README[README.index("## Five metrics to watch"):].split("\n## ")[0]
    names = [code_names(row[0])[0] for row in table_rows(watch)]
    assert len(names) == 5 and all(f"rollout_corr/{name}" in emitted for name in names), names


# ---------------------------------------------------------------- the monitor's numbers, the decision table's numbers
def test_documented_alert_thresholds_are_the_monitor_s_defaults():
    from trl_rollout_corr.monitor.rules import DEFAULTS

    page = PAGE["monitor.md"]
    table = page[page.index("| alert | fires when"):].split("\n\n")[0]
    default = {code_names(row[0])[0]: [float(x) for x in re.findall(r"\d+(?:\.\d+)?(?:e-?\d+)?", row[-1])]
               for row in table_rows(table)}
    assert default == {
        "policy_collapse": [DEFAULTS[k] for k in ("reward_drop", "reward_scale", "entropy_rise", "severe_reward_drop",
                                                  "collapse_window")],
        "all_rejected": [DEFAULTS["rejected_fraction_threshold"]],
        "ess_collapse": [DEFAULTS["ess_threshold"]],
        "weights_pinned": [DEFAULTS["pinned_fraction_threshold"]],
        "negative_kl": [DEFAULTS["negative_kl_tolerance"]],
    }
    d = {k: f"{v:g}" for k, v in DEFAULTS.items()}
    d["negative_kl_tolerance"] = f"{DEFAULTS['negative_kl_tolerance']:.0e}".replace("e-0", "e-")  # 1e-3
    watch = " ".join(README[README.index("## Five metrics to watch"):].split("\n## ")[0].split())
    for expected in (f"≤ {d['ess_threshold']}: `ess_collapse`", f"≥ {d['pinned_fraction_threshold']}: `weights_pinned`",
                     f"≥ {d['rejected_fraction_threshold']}: `all_rejected`",
                     f"≤ −{d['negative_kl_tolerance']}: `negative_kl`"):
        assert expected in watch, expected


def test_the_readme_s_decision_table_quotes_the_benchmark():
    """Every held-out reward the README's table quotes (0.xxx, not a p-value: those follow "p ") is a row's."""
    numbers = re.findall(r"(?<!p )\b0\.\d{3}\b", doc_block("preset-decision", "docs/evidence.md"))
    benchmark = doc_block("mismatch-table", "docs/evidence.md")
    assert numbers
    for number in numbers:
        assert f"| {number} ± " in benchmark, f"{number} is not a held-out reward of the mismatch benchmark"


def test_no_page_points_to_readme_sections_that_moved():
    """Pointers into the old one-page README ("README.md#...", "the README's ... section") would be dead links."""
    for path in [*doc_files(), ROOT / "benchmarks" / "README.md", ROOT / "experiments" / "README.md"]:
        assert "README.md#" not in path.read_text(encoding="utf-8"), path.name
    for path in (ROOT / "trl_rollout_corr").rglob("*.py"):
        assert not re.search(r"README[,:]? \"|README's \"", path.read_text(encoding="utf-8")), path


def test_the_documented_level_of_the_plan_s_log_line_is_the_code_s():
    """docs/exactness.md says at which level the trainer logs its correction plan; that is what trainer.py does."""
    source = (ROOT / "trl_rollout_corr" / "grpo" / "trainer.py").read_text(encoding="utf-8")
    level = re.search(r"logger\.(\w+)\(\s*\"Rollout correction: %s\"", source).group(1)
    assert f"at {level.upper()} level" in " ".join(PAGE["exactness.md"].split()), level
