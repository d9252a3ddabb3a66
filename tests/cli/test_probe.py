"""``trl-rollout-corr probe``: the mismatch report against hand computations and independent float64 re-scoring,
truncation separated from precision, clear errors, and the command end to end on a local model."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from trl_rollout_corr.core.mismatch import method_predictions, mismatch_summary
from trl_rollout_corr.cli.probe import analyse, collect, correction_params, format_report, probe, write_report
from trl_rollout_corr.rollout.emulated import EmulatedRolloutEngine

from tests.support.trainer_utils import make_trainer


def test_summary_by_hand():
    # two sequences: lengths 3 and 1 (padding 0); log rho = train - rollout
    train = torch.tensor([[-1.0, -2.0, -8.0], [-0.5, 0.0, 0.0]])
    rollout = torch.tensor([[-1.1, -1.8, -7.0], [-0.5, 9.0, 9.0]])  # padding values must not matter
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    r = mismatch_summary(train, rollout, mask, buckets=(2,), low_prob=1e-3)
    d = [0.1, -0.2, -1.0, 0.0]  # log rho of the 4 tokens
    k3 = [math.expm1(x) - x for x in d]
    assert r["tokens"]["count"] == 4
    assert r["tokens"]["k1"] == pytest.approx(-sum(d) / 4)
    assert r["tokens"]["k3"] == pytest.approx(sum(k3) / 4)
    assert r["tokens"]["max_abs_log_rho"] == pytest.approx(1.0)
    # pi_train < 1e-3 <=> log pi_train < -6.91: only the third token (-8)
    assert r["tokens"]["low_prob_token_fraction"] == pytest.approx(0.25)
    assert r["tokens"]["low_prob_share_of_k3"] == pytest.approx(k3[2] / sum(k3))
    seq = r["sequences"]
    t_kl = [k3[0] + k3[1] + k3[2], k3[3]]
    assert seq["t_kl_mean"] == pytest.approx(sum(t_kl) / 2)
    logw = [0.1 - 0.2 - 1.0, 0.0]
    w = [math.exp(x) for x in logw]
    assert seq["seq_ess"] == pytest.approx(sum(w) ** 2 / (2 * sum(x * x for x in w)))
    mean = sum(logw) / 2
    var = sum((x - mean) ** 2 for x in logw) / 1
    assert seq["seq_log_rho_var"] == pytest.approx(var)
    assert seq["seq_ess_lognormal"] == pytest.approx(math.exp(-var))
    assert set(r["by_length"]) == {"0-1", ">=2"}
    assert r["by_length"][">=2"]["k3"] == pytest.approx(sum(k3[:3]) / 3)
    assert r["by_length"]["0-1"]["count"] == 1


def test_a_row_with_a_non_finite_log_prob_is_left_out_and_counted():
    train = torch.tensor([[-1.0, -1.0], [-1.0, float("nan")]])
    rollout = torch.tensor([[-1.5, -1.0], [-1.0, -1.0]])
    r = mismatch_summary(train, rollout, torch.ones(2, 2))
    assert r["invalid_sequences"] == 1
    assert r["tokens"]["count"] == 2
    assert r["tokens"]["k1"] == pytest.approx(-0.25)


def test_method_predictions_by_hand():
    # one sequence, two tokens with rho = e^{1.5} and e^{-0.2}: token TIS (C=2) clips the first to 2; TRL's
    # sequence_mask (C=3) masks the sequence when e^{1.3} = 3.67 > 3
    train = torch.tensor([[-0.5, -1.2], [-1.0, -1.0]])
    rollout = torch.tensor([[-2.0, -1.0], [-1.0, -1.0]])
    mask = torch.ones(2, 2)
    out = method_predictions(train, rollout, mask, {
        "token": correction_params("decoupled_token_is"), "seq_mask": correction_params("trl_default")})
    assert out["token"]["weight_max"] == pytest.approx(2.0)
    assert out["token"]["weight_min"] == pytest.approx(math.exp(-0.2), rel=1e-6)
    assert out["token"]["rollout_is_max"] == pytest.approx(math.exp(1.5), rel=1e-6)  # rho before truncation
    assert out["token"]["rollout_is_ratio_fraction_high"] == pytest.approx(0.25)  # 1 of 4 tokens pinned at C
    assert out["seq_mask"]["rollout_is_seq_masked_fraction"] == pytest.approx(0.5)
    assert out["seq_mask"]["weight_zero_fraction"] == pytest.approx(0.5)  # the masked sequence's 2 tokens of 4


@pytest.fixture
def trainer_with(tmp_path):
    def build(engine, **overrides):
        trainer, _ = make_trainer(tmp_path, rollout_sampler=EmulatedRolloutEngine(engine),
                                  max_completion_length=12, **overrides)
        return trainer
    return build


def _float64_logps(model, input_ids, attention_mask, completion_width):
    """log p(a_t) of every completion token by a float64 copy of ``model`` (independent of TRL's forward)."""
    import copy

    m = copy.deepcopy(model).double().eval()
    for module in m.modules():  # drop instance-level forwards patched by the trainer
        module.__dict__.pop("forward", None)
    with torch.no_grad():
        logits = m(input_ids=input_ids, attention_mask=attention_mask).logits[:, -completion_width - 1:-1]
    return torch.log_softmax(logits, -1).gather(-1, input_ids[:, -completion_width:, None]).squeeze(-1)  # (B, T)


def test_the_probe_recovers_an_injected_engine_mismatch(trainer_with):
    """wq4: the engine is the policy with 4-bit weights. Both sides re-scored in float64 by independent forwards of
    the policy and of the engine's model: the probe's per-token k1 and k3 must match."""
    trainer = trainer_with("wq4")
    torch.manual_seed(0)
    data = collect(trainer, 1)
    report = analyse(data, ("decoupled_token_is",))
    width = data["mask"].size(1)
    batch = data["batches"][0]
    policy = trainer.accelerator.unwrap_model(trainer.model)
    train64 = _float64_logps(policy, batch["input_ids"], batch["attention_mask"], width)  # (B, T)
    rollout64 = _float64_logps(trainer.rollout_sampler._engine, batch["input_ids"], batch["attention_mask"], width)
    m = data["mask"].bool()
    d = (train64 - rollout64)[m]
    assert report["tokens"]["k3"] > 1e-5  # an injected mismatch (k1 of a small sample can have either sign)
    assert report["tokens"]["k1"] == pytest.approx(float(-d.mean()), rel=1e-3, abs=1e-7)
    assert report["tokens"]["k3"] == pytest.approx(float((torch.expm1(d) - d).mean()), rel=1e-3, abs=1e-8)


def test_truncation_is_separated_from_precision(trainer_with):
    """Same weights (engine 'none') with top_p=0.8: all of the raw mismatch is the truncation; after the trainer
    renormalizes over the sampler's kept set nothing is left (fp32 on both sides)."""
    report = analyse(collect(trainer_with("none", top_p=0.8), 1), ())
    raw, left = report["truncation"]["before_renormalization"]["k1"], report["tokens"]["k1"]
    assert report["truncation"]["kept_mass_mean"] < 0.99
    # on the kept set log pi_rollout = log p - log M: the raw k1 is -E[log M] > 0
    assert raw > 1e-2
    assert abs(left) < 1e-5 and report["tokens"]["max_abs_log_rho"] < 1e-4


def test_errors_name_the_cause(trainer_with, tmp_path):
    trainer = trainer_with("none")
    with pytest.raises(ValueError, match="probe_batches"):
        collect(trainer, 0)
    data = collect(trainer, 1)
    data["rollout_seen"] = torch.zeros_like(data["rollout_seen"])
    with pytest.raises(ValueError, match="no log-probs"):
        analyse(data)
    trainer.train_dataset = trainer.train_dataset.select([])
    with pytest.raises(ValueError, match="dataset is empty"):
        collect(trainer, 1)


def test_report_files_and_table(trainer_with, tmp_path):
    report = probe(trainer_with("wq4", top_k=20), 1, ("trl_default", "decoupled_token_is", "icepop"))
    text = format_report(report)
    assert "per-token KL" in text and "trl_default" in text and "Your regime" in text
    paths = write_report(report, str(tmp_path / "out"))
    saved = json.load(open(paths[0]))
    assert saved["tokens"]["k3"] == pytest.approx(report["tokens"]["k3"])
    assert set(saved["methods"]) == {"this_run", "trl_default", "decoupled_token_is", "icepop"}  # + the trainer's own
    assert any(p.endswith(".png") and os.path.getsize(p) > 0 for p in paths)


def test_probe_command_end_to_end(tmp_path, capsys):
    """``trl-rollout-corr probe`` with train's arguments on a local model and data directory."""
    from trl_rollout_corr.cli.main import main
    from trl_rollout_corr.testing.toy_task import build_model, build_tokenizer, reverse_prompts

    build_model(hidden_size=32).save_pretrained(tmp_path / "model")
    build_tokenizer().save_pretrained(tmp_path / "model")
    (tmp_path / "data").mkdir()
    with open(tmp_path / "data" / "train.jsonl", "w") as f:
        for prompt in reverse_prompts(16, n_digits=4):
            f.write(json.dumps({"prompt": prompt}) + "\n")
    main(["probe", "--model_name_or_path", str(tmp_path / "model"), "--dataset_name", str(tmp_path / "data"),
          "--reward_funcs", "reverse_reward", "--output_dir", str(tmp_path / "out"), "--use_cpu", "true",
          "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "8",
          "--rollout_engine", "wq4", "--report_to", "none", "--probe_samples", "8"])
    out = capsys.readouterr().out
    assert "per-token KL" in out and "Verdict" in out
    saved = json.load(open(tmp_path / "out" / "probe" / "probe.json"))
    assert saved["tokens"]["count"] > 0 and saved["tokens"]["k3"] > 0 and saved["samples"] == 8
    assert saved["placement"]["rows"] and saved["regime"]["T_times_kl_se"] >= 0


def test_the_setup_notes_name_a_sampler_setting_the_trainer_cannot_reproduce(trainer_with):
    from trl_rollout_corr.cli.probe import configuration_notes

    trainer = trainer_with("none", repetition_penalty=1.3)
    notes = configuration_notes(trainer)
    assert any(note.startswith("repetition_penalty=1.3") for note in notes), notes
    assert not any("changes pi_rollout" in note for note in configuration_notes(trainer_with("none")))


def test_the_nearest_estimator_map_cell(tmp_path):
    """Nearest by |log T - log T_u| + |log T*KL - log T*KL_u| over a two-cell map written here."""
    from trl_rollout_corr.cli.probe import format_map_cell, nearest_map_cell

    path = tmp_path / "map.csv"
    header = "T,source,level,method,kl_k3,t_kl,mse,bias2,bias2_se,relvar,ess_token,masked_seq\n"
    rows = ["64,heavy,a,none,0.01,0.64,1.2,0.5,0.2,0.7,1,0\n", "64,heavy,a,trl_sequence_mask,0.01,0.64,0.3,0.1,0.1,"
            "0.2,0.9,0.4\n", "256,stale,b,none,0.02,5.1,9,8,1,1,1,0\n"]
    path.write_text(header + "".join(rows))
    # T 100, T*KL 1: cell 1 is |log(64/100)| + |log(0.64/1)| = 0.45 + 0.45 = 0.89 away, cell 2 1.25 + 1.63
    cell = nearest_map_cell({"T": 100, "T_times_kl": 1.0}, str(path))
    assert (cell["T"], cell["source"]) == (64, "heavy") and set(cell["methods"]) == {"none", "trl_sequence_mask"}
    text = "\n".join(format_map_cell(cell))
    assert text.index("trl_sequence_mask") < text.index("none ")  # ranked by MSE
    assert "bias resolved (>= 2 s.e.) for: none." in text  # the method `none`: 0.5 >= 2 x 0.2; 0.1 < 2 x 0.1
    cell["methods"]["none"]["bias2"] = 0.3
    assert "bias resolved (>= 2 s.e.) for: no method." in "\n".join(format_map_cell(cell))
    assert nearest_map_cell({"T": 100, "T_times_kl": 1.0}, str(tmp_path / "absent.csv")) is None
    assert "not in this installation" in format_map_cell(None)[0]


def test_a_checkout_finds_the_committed_estimator_map():
    """In a checkout the probe finds the map's committed CSV by default (the layer move put probe.py one folder deeper
    and the default path silently pointed into the package, so every probe printed "not in this installation")."""
    from pathlib import Path

    from trl_rollout_corr.cli.probe import MAP_CSV, nearest_map_cell

    root = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
    committed = root / "experiments" / "results" / "estimator_map" / "estimator_map.csv"
    assert committed.is_file() and Path(MAP_CSV).resolve() == committed
    cell = nearest_map_cell({"T": 49, "T_times_kl": 0.4})
    assert cell is not None and cell["csv"] == MAP_CSV and cell["methods"]


def test_the_default_sample_is_counted_in_completions_and_the_report_places_the_run(trainer_with):
    """batches=None: whole generation batches (8 completions here) until ``samples`` are scored; the report carries
    the standard errors and the verdict placement, and the table prints the row's text from VERDICTS."""
    from trl_rollout_corr.monitor.verdict import verdict

    trainer = trainer_with("wq4", top_p=0.9)
    data = collect(trainer, None, split=False, samples=20)
    assert len(data["batches"]) == 3 and data["mask"].size(0) == 24  # 8 + 8 + 8 >= 20
    report = probe(trainer, None, ("trl_default",), split=False, samples=16)
    assert report["samples"] == 16
    regime = report["regime"]
    assert regime["per_token_kl_se"] == report["tokens"]["k3_se"] > 0
    assert regime["T_times_kl_se"] == report["sequences"]["t_kl_se"] > 0
    place = report["placement"]
    assert place["truncates"] and not place["stale"] and place["batches"] == 2
    assert place["rows"][0] == "truncating-sampler" and place["decided"]  # a synchronous engine: keep the default
    text = format_report(report)
    assert "Verdict" in text and verdict("truncating-sampler").advice in text
    assert "+-" in text.split("per-token KL(pi_rollout")[1].split("\n")[0]
    with pytest.raises(ValueError, match="probe_samples"):
        collect(trainer, None, samples=0)
    stale_trainer, _ = make_trainer(trainer.args.output_dir, rollout_sampler=EmulatedRolloutEngine("stale", lag=2))
    stale = probe(stale_trainer, 1, ("trl_default",), split=False)["placement"]
    assert stale["stale"] and not stale["truncates"] and [b["quantity"] for b in stale["boundaries"]] == [
        "per_token_kl", "t_kl"]


def test_an_undecided_placement_says_how_many_more_batches_would_decide():
    from trl_rollout_corr.cli.probe import format_placement, placement
    from trl_rollout_corr.monitor.verdict import verdict

    # a stale engine at T*KL 0.45 +- 0.05 after 2 batches: [0.352, 0.548] straddles 0.52; (1.96 * 0.05 / 0.07)^2 =
    # 1.96 times the sample, ceil(2 * 1.96) = 4 batches, 2 more
    report = {"regime": {"T": 50.0, "per_token_kl": 1e-3, "per_token_kl_se": 1e-4, "T_times_kl": 0.45,
                         "T_times_kl_se": 0.05}}
    place = placement(report, 2, truncates=False, stale=True)
    assert not place["decided"] and place["rows"] == ["stale-engine", "default"] and place["more_batches"] == 2
    text = "\n".join(format_placement(place))
    assert "cannot decide" in text and "T*KL straddles 0.52" in text and "--probe_batches 4 (2 more" in text
    assert verdict("stale-engine").advice in text and "keep TRL's default correction" in text
    # the stale-engine row names both equally confirmed settings (experiment G), dppo_kl_bypass first
    assert ("(rollout_correction_preset=dppo_kl_bypass or rollout_correction_preset=ppo_is_bypass)" in text)
    decided = placement({"regime": {**report["regime"], "T_times_kl": 0.3}}, 2, False, True)
    assert decided["decided"] and decided["more_batches"] is None
    assert "cannot decide" not in "\n".join(format_placement(decided))
