import glob
import os
import subprocess
import sys

import pytest

from trl_rollout_corr import RolloutCorrectionConfig
from trl_rollout_corr.cli.main import parse_train_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU = ["--use_cpu", "true"]  # the recipes use bf16 for GPUs; this machine has none
PRESET_RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "*.yaml")))


@pytest.mark.parametrize("path", [p for p in PRESET_RECIPES if not p.endswith("cpu_demo.yaml")], ids=os.path.basename)
def test_every_preset_recipe_parses_into_a_valid_config(path):
    script_args, training_args, model_args = parse_train_args(["--config", path, *CPU])[:3]
    name = os.path.basename(path)[: -len(".yaml")]
    assert training_args.rollout_correction == RolloutCorrectionConfig.from_preset(name)
    assert training_args.use_vllm and not training_args.vllm_importance_sampling_correction
    assert model_args.model_name_or_path and script_args.reward_funcs == ["math_answer_reward"]


def test_command_line_overrides_the_recipe():
    path = os.path.join(ROOT, "recipes", "decoupled_seq_is_rs.yaml")
    _, training_args, _ = parse_train_args(["--config", path, *CPU, "--rollout_rs_threshold", "4.0"])[:3]
    assert training_args.rollout_correction.rollout_rs_threshold == 4.0


def test_invalid_combination_from_command_line_fails_at_parse():
    path = os.path.join(ROOT, "recipes", "decoupled_token_is.yaml")
    with pytest.raises(ValueError, match="use_policy_gradient=True requires bypass_mode"):
        parse_train_args(["--config", path, *CPU, "--use_policy_gradient", "true"])


def test_cpu_demo_recipe_and_a_short_demo_run(tmp_path):
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "trl_rollout_corr", "demo", "--config", os.path.join(ROOT, "recipes", "cpu_demo.yaml"),
           "--arms", "trl_default_top_p_0.8", "--seeds", "230", "--size", "tiny", "--probe_batches", "0", "--engine",
           "emulated", "--output_dir", str(out)]  # the default (vLLM) engine runs in tests/demo/test_demo_numbers.py
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "held-out reward" in res.stdout and "trl_default_top_p_0.8" in res.stdout
    assert (out / "demo_results.csv").exists() and (out / "demo_curves.png").exists()


def test_minimal_example_runs(tmp_path):
    res = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "minimal.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "rollout_corr/kl" in res.stdout


def test_recipes_written_out_work_from_any_directory(tmp_path, monkeypatch, capsys):
    import fnmatch
    import json
    import tomllib

    import yaml

    from trl_rollout_corr.cli.main import main

    elsewhere, out = tmp_path / "elsewhere", tmp_path / "my_recipes"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # not a checkout: nothing named recipes/ here
    main(["recipes", str(out)])
    in_repo = sorted(os.path.relpath(p, os.path.join(ROOT, "recipes"))
                     for p in glob.glob(os.path.join(ROOT, "recipes", "**", "*.*"), recursive=True))
    written = sorted(os.path.relpath(p, out) for p in glob.glob(os.path.join(out, "**", "*.*"), recursive=True))
    assert written == in_repo and len(written) >= 16
    assert f"wrote {len(written)} recipes to {out}" in capsys.readouterr().out
    for name in written:  # no path left relative to a checkout's root
        text = (out / name).read_text()
        assert " recipes/" not in text and ": recipes/" not in text, name
    for stage in (2, 3):  # accelerate's DeepSpeed YAML points at the written JSON, by absolute path
        launch = yaml.safe_load((out / "accelerate" / f"deepspeed_zero{stage}.yaml").read_text())
        ds_path = launch["deepspeed_config"]["deepspeed_config_file"]
        assert os.path.isabs(ds_path) and os.path.exists(ds_path), ds_path
        with open(os.path.join(ROOT, "recipes", "accelerate", f"ds_zero{stage}.json")) as fh:
            assert json.loads(open(ds_path).read()) == json.load(fh)
    # the stale-engine row's two recipes (the monitor's stale remedy: dppo_kl_bypass first, ppo_is_bypass), read from
    # outside the checkout: each its preset, bypass mode, and the engine synced every 4 optimizer steps
    assert {"dppo_kl_bypass.yaml", "ppo_is_bypass.yaml"} <= set(written)
    for preset in ("dppo_kl_bypass", "ppo_is_bypass"):
        _, training_args, _ = parse_train_args(["--config", str(out / f"{preset}.yaml"), *CPU])[:3]
        assert training_args.rollout_correction == RolloutCorrectionConfig.from_preset(preset)
        assert training_args.rollout_correction.bypass_mode and training_args.vllm_sync_interval == 4
    with pytest.raises(FileExistsError, match="--force"):
        main(["recipes", str(out)])
    main(["recipes", str(out), "--force"])
    # a built wheel carries them: the package-data globs cover every recipe (trl_rollout_corr/recipes -> ../recipes)
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        globs = tomllib.load(fh)["tool"]["setuptools"]["package-data"]["trl_rollout_corr"]
    assert all(any(fnmatch.fnmatch(f"recipes/{name}", g) for g in globs) for name in in_repo)
    assert os.path.realpath(os.path.join(ROOT, "trl_rollout_corr", "recipes")) == os.path.join(ROOT, "recipes")
