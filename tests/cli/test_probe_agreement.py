"""Issue 37, item 3: the probe's per-method prediction on a generation batch equals what the trainer then logs when it
trains one step on exactly that batch (the engine's output of the probe's batch is replayed into training).

The reference is the trainer itself: its ``rollout_corr/*`` metrics and the weights its loss applies, from its own
forward in training mode, its own correction path (in the loss, or at generation with a pi_old forward) and its own
cross-micro-batch reduction. Observed exact on a 2-core CPU; asserted to float32 rounding (rel 1e-6)."""

from __future__ import annotations

import copy

import pytest
import torch

from trl_rollout_corr.cli.probe import THIS_RUN, analyse, collect
from trl_rollout_corr.rollout.emulated import EmulatedRolloutEngine
from trl_rollout_corr.trl_hooks import grpo as trl_grpo

from tests.support.trainer_utils import make_trainer

#: what the probe predicts and the trainer logs under the same name (rollout_corr/<name>)
COMPARED = ("rollout_is_eff_sample_size", "rollout_is_min", "rollout_is_max", "rollout_is_seq_min",
            "rollout_is_seq_max", "rollout_is_ratio_fraction_high", "rollout_is_masked_fraction",
            "rollout_is_seq_masked_fraction", "rejected_token_fraction", "rollout_rs_seq_masked_fraction",
            "rollout_m2_masked_fraction")


def probe_then_train(tmp_path, monkeypatch, preset, **overrides):
    """(the probe's report on one generation batch, the trainer's first log after one optimizer step on that batch,
    the (is_weights, kept token mask) pairs the trainer's corrections returned)."""
    trainer, logs = make_trainer(tmp_path, preset=preset, rollout_sampler=EmulatedRolloutEngine("wq2"), max_steps=1,
                                 max_completion_length=12, top_p=0.9, **overrides)
    generate = trl_grpo.generate
    recorded = []

    def record(trainer_, owner, prompts):
        out = generate(trainer_, owner, prompts)
        recorded.append((list(prompts), copy.deepcopy(out)))
        return out

    def replay(trainer_, owner, prompts):
        saved_prompts, out = recorded[0]
        assert list(prompts) == saved_prompts  # the same dataloader order: the same prompts
        return copy.deepcopy(out)

    monkeypatch.setattr(trl_grpo, "generate", record)
    torch.manual_seed(0)
    report = analyse(collect(trainer, 1), (preset or "trl_default",))
    assert len(recorded) == 1
    monkeypatch.setattr(trl_grpo, "generate", replay)
    corrections = []
    correction = trainer._correction

    def spy(train_logps, batch, loss_mask, support, mode):
        out = correction(train_logps, batch, loss_mask, support, mode)
        corrections.append((out.is_weights, (loss_mask * out.keep).bool()))
        return out

    monkeypatch.setattr(trainer, "_correction", spy)
    trainer.train()
    logged = {k.removeprefix("rollout_corr/"): v for k, v in logs.logs[0].items() if k.startswith("rollout_corr/")}
    return report, logged, corrections


@pytest.mark.parametrize("preset,overrides,where", [
    (None, {}, "loss"),  # TRL's default sequence_mask (C=3), one micro-batch, truncation renormalized
    ("decoupled_seq_is_rs", {"rollout_rs_threshold_lower": 0.9, "gradient_accumulation_steps": 2}, "generation"),
    ("decoupled_token_is", {"truncated_support_correction": False}, "loss"),
    ("m2po", {"rollout_m2_threshold": 0.002}, None),  # the trust region reads A: the probe passes TRL's
], ids=["trl_default", "seq_is_rs_overridden_two_micro_batches", "no_renormalization", "m2po_advantages"])
def test_the_probe_predicts_what_the_trainer_logs_on_the_same_batch(tmp_path, monkeypatch, preset, overrides, where):
    report, logged, corrections = probe_then_train(tmp_path, monkeypatch, preset, **overrides)
    predicted = report["methods"][THIS_RUN]
    compared = [k for k in COMPARED if k in predicted]
    assert "rejected_token_fraction" in compared
    for name in compared:
        assert predicted[name] == pytest.approx(logged[name], rel=1e-6, abs=1e-9), name
    # the per-token KL the probe reports is the trainer's rollout_corr/k3_kl (float32 accumulation in the trainer)
    assert report["tokens"]["k3"] == pytest.approx(logged["k3_kl"], rel=1e-5)
    assert report["truncation"]["kept_mass_mean"] == pytest.approx(logged["kept_mass_mean"], rel=1e-6)
    # the range of the weights the trainer's loss applies on the tokens it keeps
    weights = [w[kept] for w, kept in corrections if w is not None]  # (N,) each
    assert ("weight_min" in predicted) == bool(weights)
    if weights:
        assert predicted["weight_min"] == pytest.approx(float(torch.cat(weights).min()), rel=1e-6)
        assert predicted["weight_max"] == pytest.approx(float(torch.cat(weights).max()), rel=1e-6)
    if where is not None:
        assert len(corrections) == (1 if where == "generation" else overrides.get("gradient_accumulation_steps", 1))
    if preset == "m2po":
        assert predicted["rollout_m2_masked_fraction"] > 0  # the second-moment mask acts on this batch
    if preset == "decoupled_seq_is_rs":  # the override acts: rejection happens, and the bare preset predicts less
        assert predicted["rollout_rs_seq_masked_fraction"] > 0
        assert report["methods"][preset]["rejected_token_fraction"] < predicted["rejected_token_fraction"]
    if not overrides.get("truncated_support_correction", True):  # the trainer's ratio is not renormalized
        assert report["truncation"]["applied_by_trainer"] is False
        assert report["tokens"]["k3"] == pytest.approx(report["truncation"]["before_renormalization"]["k3"])
