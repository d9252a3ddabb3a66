"""``trl-rollout-corr train`` takes what ``trl grpo`` takes (TRL 1.16): a user's reward module, a reward model, LoRA,
dtype and attention implementation, dataset mixtures, accelerate launch arguments; clear errors for what is
missing; ``--help`` lists every command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import accelerate.commands.config
from trl_rollout_corr import RolloutCorrectionConfig
from trl_rollout_corr.cli.main import main as cli_main
from trl_rollout_corr.cli.train import main as train_main
from trl_rollout_corr.cli.train import parse_train_args, resolve_reward_funcs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REWARD_MODULE = textwrap.dedent('''
    import os

    def count_yes(prompts, completions, source, **kwargs):
        """A user's reward: counts the digit 7 in each completion; logs each call (batch size, whether it runs under
        accelerate launch, the rows' data sources) to prove it ran."""
        launched = os.environ.get("ACCELERATE_MIXED_PRECISION", "-")
        with open(os.environ["REWARD_CALL_LOG"], "a") as log:
            log.write(f"{len(completions)} {launched} {','.join(sorted(set(source)))}\\n")
        return [float(c.count("7")) for c in completions]
''')


@pytest.fixture(autouse=True)
def no_accelerate_default_config(monkeypatch, tmp_path):
    """Train here unless launch arguments are given (a user's default accelerate config would relaunch)."""
    monkeypatch.setattr(accelerate.commands.config, "default_config_file", str(tmp_path / "no_default_config.yaml"))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A user's directory: a tiny model, a tiny reward model, two data directories and a reward module."""
    from transformers import Qwen2ForSequenceClassification

    from trl_rollout_corr.testing.toy_task import build_model, build_tokenizer, reverse_prompts

    root = tmp_path_factory.mktemp("user")
    tok = build_tokenizer()
    model = build_model(hidden_size=32)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    reward_config = model.config.__class__(**{**model.config.to_dict(), "num_labels": 1,
                                              "pad_token_id": tok.pad_token_id})
    Qwen2ForSequenceClassification(reward_config).save_pretrained(root / "reward_model")
    tok.save_pretrained(root / "reward_model")
    for name, seed in (("data_a", 0), ("data_b", 1)):
        (root / name).mkdir()
        with open(root / name / "train.jsonl", "w") as f:
            for prompt in reverse_prompts(32, n_digits=4, seed=seed):
                f.write(json.dumps({"question": prompt, "source": name}) + "\n")
    (root / "my_rewards.py").write_text(REWARD_MODULE)
    return root


TINY_RUN = ["--max_steps", "2", "--per_device_train_batch_size", "4", "--num_generations", "4",
            "--max_completion_length", "6", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
            "--prompt_column", "question", "--learning_rate", "1e-3"]


def run_cli(workspace, args, timeout=400):
    env = {**os.environ, "REWARD_CALL_LOG": str(workspace / "reward_calls.log"), "TRL_ROLLOUT_CORR_NO_VLLM": "1",
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "HF_HOME": str(workspace / "hf_home")}
    env.pop("LOCAL_RANK", None)
    res = subprocess.run([sys.executable, "-m", "trl_rollout_corr", "train", *args], cwd=workspace, env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return res


def test_users_reward_module_and_lora_end_to_end(workspace):
    """The issue's command: a reward by import path plus a built-in one, LoRA flags, dtype, attention."""
    out = workspace / "out_lora"
    (workspace / "reward_calls.log").unlink(missing_ok=True)
    run_cli(workspace, ["--model_name_or_path", str(workspace / "model"), "--dataset_name", str(workspace / "data_a"),
                        "--reward_funcs", "my_rewards.count_yes", "reverse_reward",
                        "--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "q_proj", "v_proj",
                        "--dtype", "float32", "--attn_implementation", "eager",
                        "--rollout_correction_preset", "decoupled_token_is", "--rollout_is_threshold", "3.0",
                        "--rollout_corr_monitor", "true", "--use_cpu", "--output_dir", str(out), *TINY_RUN])
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["lora_alpha"] == 8 and set(adapter["target_modules"]) == {"q_proj", "v_proj"}
    assert (out / "adapter_model.safetensors").exists() and not (out / "model.safetensors").exists()
    saved = RolloutCorrectionConfig.from_pretrained(out)
    assert saved == RolloutCorrectionConfig.decoupled_token_is(threshold=3.0)
    calls = [line.split() for line in (workspace / "reward_calls.log").read_text().splitlines()]
    assert calls == [["4", "-", "data_a"]] * 2  # one call per generation batch of 4 completions, in this process
    assert (out / "rollout_corr_metrics.csv").exists()  # the monitor ran


def test_reward_model_and_dataset_mixture_through_accelerate_launch(workspace):
    """A YAML recipe with a `datasets` mixture and a reward model, relaunched under `accelerate launch` by the
    launcher arguments on the command line (as `trl grpo --num_processes 1 ...` is)."""
    out = workspace / "out_mixture"
    (workspace / "reward_calls.log").unlink(missing_ok=True)
    recipe = workspace / "mixture.yaml"
    recipe.write_text(textwrap.dedent(f"""
        model_name_or_path: {workspace / "model"}
        reward_model_name_or_path: {workspace / "reward_model"}
        reward_funcs: [reverse_reward, my_rewards.count_yes]
        datasets:
          - path: {workspace / "data_a"}
            split: train
          - path: {workspace / "data_b"}
            split: train
        rollout_correction_preset: pg_rs
        use_cpu: true
        output_dir: {out}
    """))
    run_cli(workspace, ["--config", str(recipe), "--num_processes", "1", "--cpu", "--mixed_precision", "no",
                        *TINY_RUN])
    assert (out / "model.safetensors").exists() and not (out / "adapter_config.json").exists()
    assert RolloutCorrectionConfig.from_pretrained(out) == RolloutCorrectionConfig.pg_rs()
    calls = [line.split() for line in (workspace / "reward_calls.log").read_text().splitlines()]
    assert len(calls) == 2 and all(n == "4" and launched == "no" for n, launched, _ in calls)  # under accelerate
    assert set(",".join(c[2] for c in calls).split(",")) <= {"data_a", "data_b"}


# ------------------------------------------------------------------ what is parsed, and the errors
def test_every_trl_grpo_argument_is_accepted():
    """Each dataclass of `trl grpo`'s parser is part of `train`'s, with every field."""
    import dataclasses

    from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig
    from trl.scripts.grpo import make_parser as trl_grpo_parser

    ours = {action.dest for action in __import__("trl_rollout_corr.cli.train", fromlist=["make_parser"])
            .make_parser()._actions}
    theirs = {action.dest for action in trl_grpo_parser()._actions}
    assert theirs <= ours, sorted(theirs - ours)
    for cls in (GRPOConfig, ModelConfig, DatasetMixtureConfig):
        assert {f.name for f in dataclasses.fields(cls) if f.init} <= ours


def test_parsed_like_trl_grpo(tmp_path):
    script, training, model, monitor, data = parse_train_args([
        "--model_name_or_path", "m", "--dataset_name", "d", "--dataset_config", "main", "--dataset_test_split", "dev",
        "--reward_funcs", "accuracy_reward", "x.y", "--use_peft", "--lora_r", "8", "--load_in_4bit",
        "--dtype", "bfloat16", "--attn_implementation", "sdpa", "--output_dir", str(tmp_path), "--use_cpu",
        "--rollout_correction_preset", "bypass_ppo_clip"])
    assert script.reward_funcs == ["accuracy_reward", "x.y"] and script.dataset_test_split == "dev"
    assert model.use_peft and model.lora_r == 8 and model.load_in_4bit and model.dtype == "bfloat16"
    assert training.rollout_correction.bypass_mode and data.datasets == [] and not monitor.rollout_corr_monitor


@pytest.mark.parametrize("field,preset", [("rollout_token_veto_threshold", "decoupled_geo_rs"),
                                          ("rollout_rs_threshold_lower", "decoupled_token_band_rs"),
                                          ("rollout_rs_criteria", "decoupled_k3_rs_token_tis")])
def test_none_switches_a_preset_field_off_from_the_cli_and_a_yaml(tmp_path, field, preset):
    """Any field whose off value is None: 'none' sets it off over the preset's value (None in Python means 'not set
    here', so a preset's veto could not be switched off from a CLI, a YAML or the config before). Switching the
    criteria off drops the preset's criteria thresholds too, as switching RS off drops its thresholds."""
    base = ["--model_name_or_path", "m", "--output_dir", str(tmp_path), "--use_cpu", "--rollout_correction_preset",
            preset]
    kept = parse_train_args(base)[1]
    off = parse_train_args(base + [f"--{field}", "none"])[1]
    (tmp_path / "run.yaml").write_text(f"{field}: none\n")
    from_yaml = parse_train_args(base + ["--config", str(tmp_path / "run.yaml")])[1]
    assert getattr(kept.rollout_correction, field) is not None
    for args in (off, from_yaml):
        assert getattr(args.rollout_correction, field) is None
        if field == "rollout_rs_criteria":  # its thresholds leave with it
            assert args.rollout_correction.rollout_rs_criteria_threshold is None
        # everything else is the preset's
        others = {k: v for k, v in args.rollout_correction.to_dict().items() if not k.startswith(field)}
        assert others == {k: v for k, v in kept.rollout_correction.to_dict().items() if not k.startswith(field)}


def test_a_field_switched_off_survives_a_round_trip_through_the_saved_fields(tmp_path):
    """args.to_dict()'s correction fields, written to a YAML and read back, rebuild the same correction: a preset's
    veto switched off is written back as 'none' (None would mean 'not set here' and bring the preset's back)."""
    import yaml

    from trl_rollout_corr.config.fields import CORRECTION_FIELDS

    base = ["--model_name_or_path", "m", "--output_dir", str(tmp_path), "--use_cpu"]
    args = parse_train_args(base + ["--rollout_correction_preset", "decoupled_geo_rs",
                                    "--rollout_token_veto_threshold", "none"])[1]
    saved = {k: v for k, v in args.to_dict().items() if k in CORRECTION_FIELDS or k == "rollout_correction_preset"}
    assert saved["rollout_token_veto_threshold"] == "none"
    (tmp_path / "saved.yaml").write_text(yaml.safe_dump(saved))
    again = parse_train_args(base + ["--config", str(tmp_path / "saved.yaml")])[1]
    assert again.rollout_correction == args.rollout_correction


@pytest.mark.parametrize("rs,threshold", [("token_k1", "0.5_2"), ("seq_mean_k3,token_k1", "0.01,0.5_2")])
def test_verl_s_threshold_strings_pass_through_the_flat_fields(tmp_path, rs, threshold):
    """verl's criteria spelling keeps its threshold string ('0.5_2' is the band [0.5, 2], not float('0.5_2') =
    0.52) from Python and from the CLI, as RolloutCorrectionConfig reads it."""
    from trl_rollout_corr import RolloutCorrGRPOConfig

    expected = RolloutCorrectionConfig(rollout_rs=rs, rollout_rs_threshold=threshold)
    python = RolloutCorrGRPOConfig(str(tmp_path), use_cpu=True, rollout_rs=rs, rollout_rs_threshold=threshold,
                                   rollout_is="token", rollout_is_threshold=2.0)
    cli = parse_train_args(["--model_name_or_path", "m", "--output_dir", str(tmp_path), "--use_cpu", "--rollout_rs",
                            rs, "--rollout_rs_threshold", threshold, "--rollout_is", "token",
                            "--rollout_is_threshold", "2.0"])[1]
    for args in (python, cli):
        got = args.rollout_correction
        assert (got.rollout_rs_criteria, got.rollout_rs_criteria_threshold) == (
            expected.rollout_rs_criteria, expected.rollout_rs_criteria_threshold)
    with pytest.raises(ValueError, match="rollout_token_veto_threshold='0.5_2': use a number or 'none'"):
        RolloutCorrGRPOConfig(str(tmp_path), use_cpu=True, rollout_token_veto_threshold="0.5_2")


def test_numbers_as_strings_and_bad_values_from_the_cli(tmp_path):
    base = ["--model_name_or_path", "m", "--output_dir", str(tmp_path), "--use_cpu", "--rollout_correction_preset",
            "decoupled_geo_rs"]
    args = parse_train_args(base + ["--rollout_token_veto_threshold", "1e-3"])[1]
    assert args.rollout_correction.rollout_token_veto_threshold == 1e-3 and args.rollout_token_veto_threshold == 1e-3
    with pytest.raises(ValueError, match="rollout_token_veto_threshold='tiny': use a number or 'none'"):
        parse_train_args(base + ["--rollout_token_veto_threshold", "tiny"])
    from trl_rollout_corr import RolloutCorrGRPOConfig

    python = RolloutCorrGRPOConfig(str(tmp_path), use_cpu=True, rollout_correction_preset="decoupled_geo_rs",
                                   rollout_token_veto_threshold="none")
    assert python.rollout_correction.rollout_token_veto_threshold is None
    unset = RolloutCorrGRPOConfig(str(tmp_path), use_cpu=True, rollout_correction_preset="decoupled_geo_rs",
                                  rollout_token_veto_threshold=None)
    assert unset.rollout_correction.rollout_token_veto_threshold == 1e-4  # None: the preset's


def test_help_lists_every_command(capsys):
    cli_main(["--help"])
    text = capsys.readouterr().out
    for command in ("demo", "train", "tensors", "vllm-serve"):
        assert f"trl-rollout-corr {command}" in text


def test_without_a_model_the_error_names_the_fix(tmp_path):
    with pytest.raises(ValueError, match="--model_name_or_path.*trl-rollout-corr demo"):
        train_main(["--dataset_name", "d", "--reward_funcs", "reverse_reward", "--output_dir", str(tmp_path),
                    "--use_cpu"])


def test_without_data_the_error_names_the_fix(tmp_path, workspace):
    with pytest.raises(ValueError, match="train needs data: --dataset_name"):
        train_main(["--model_name_or_path", str(workspace / "model"), "--reward_funcs", "reverse_reward",
                    "--output_dir", str(tmp_path), "--use_cpu"])


@pytest.mark.parametrize("reward, message", [
    ("no_such_module.reward", "--reward_funcs 'no_such_module.reward': module 'no_such_module' could not be imported"),
    ("my_rewards.missing", "module 'my_rewards' .* has no function 'missing'"),
    ("count_yes", "not a built-in reward .*accuracy_reward.*reverse_reward.* nor an import path"),
])
def test_a_reward_that_does_not_import_is_named(workspace, monkeypatch, reward, message):
    monkeypatch.chdir(workspace)
    monkeypatch.setattr(sys, "path", list(sys.path))
    script = parse_train_args(["--reward_funcs", reward, "--output_dir", str(workspace / "o"), "--use_cpu"])[0]
    with pytest.raises(ValueError, match=message):
        resolve_reward_funcs(script)


def test_no_reward_is_an_error(tmp_path):
    script = parse_train_args(["--output_dir", str(tmp_path), "--use_cpu"])[0]
    with pytest.raises(ValueError, match="train needs a reward"):
        resolve_reward_funcs(script)


def test_an_unknown_argument_is_named(tmp_path):
    with pytest.raises(ValueError,
                       match=r"not used by trl-rollout-corr train nor accelerate launch: \['--lora_rank'\]"):
        train_main(["--model_name_or_path", "m", "--lora_rank", "4", "--output_dir", str(tmp_path), "--use_cpu"])
