"""verl's preset names and rollout_rs criteria strings mean here what they mean in verl (b178a3c).

The reference below is verl's rejection rule re-derived from ``verl/trainer/ppo/rollout_corr_helper.py`` at that
commit (lines 222-326): k1 = -log r, k2 = (log r)^2 / 2, k3 = exp(log r) - 1 - log r with log r clamped to
[-20, 20]; k1 keeps log(lower) <= stat <= log(upper), k2/k3 keep stat <= upper; seq_sum / seq_mean / seq_max over
the response tokens. Asymmetric k1 bands check the translation (verl's band bounds pi_rollout / pi_train).
"""

from __future__ import annotations

import math

import pytest
import torch

from trl_rollout_corr import RolloutCorrectionConfig as Cfg
from trl_rollout_corr import compute_rollout_correction_and_rejection_mask as correct
from trl_rollout_corr.config.compat import VERL_PRESETS


def verl_keep(log_ratio, mask, rollout_rs, threshold):
    """verl's keep mask for a comma-separated ``rollout_rs`` and its ``rollout_rs_threshold`` (float64 lists)."""
    names = rollout_rs.split(",")
    specs = str(threshold).split(",")
    specs = specs * len(names) if len(specs) == 1 else specs
    rows, cols = len(log_ratio), len(log_ratio[0])
    keep = [[bool(mask[i][t]) for t in range(cols)] for i in range(rows)]
    for name, spec in zip(names, specs):
        if name.endswith("k1"):
            lo, hi = (float(x) for x in spec.split("_")) if "_" in spec else (1 / float(spec), float(spec))
        else:
            lo, hi = None, float(spec)  # k2/k3: an upper bound only
        for i in range(rows):
            toks = [t for t in range(cols) if mask[i][t]]
            lr = [max(-20.0, min(20.0, log_ratio[i][t])) for t in toks]
            k = {"k1": [-x for x in lr], "k2": [0.5 * x * x for x in lr], "k3": [math.exp(x) - 1 - x for x in lr]}
            values = k[name[-2:]]

            def ok(stat, lo=lo, hi=hi, name=name):
                return math.log(lo) <= stat <= math.log(hi) if name.endswith("k1") else stat <= hi

            if name.startswith("token"):
                for t, v in zip(toks, values):
                    keep[i][t] = keep[i][t] and ok(v)
            else:
                agg = {"sum": sum, "mean": lambda v: sum(v) / len(v), "max": max}[name.split("_")[1]]
                if toks and not ok(agg(values)):
                    keep[i] = [False] * cols
    return keep


def batch(seed, spread=0.3):
    g = torch.Generator().manual_seed(seed)
    train = -torch.rand(6, 9, generator=g, dtype=torch.float64) * 2 - 0.1
    rollout = train + spread * torch.randn(6, 9, generator=g, dtype=torch.float64)
    lengths = torch.randint(2, 10, (6,), generator=g)
    mask = (torch.arange(9)[None] < lengths[:, None]).double()
    return train.float(), rollout.float(), mask


@pytest.mark.parametrize("rollout_rs,threshold", [
    ("token_k1", "0.7_1.1"), ("seq_sum_k1", "0.4_1.5"), ("seq_mean_k1", "0.9_1.02"), ("seq_mean_k1", 1.05),
    ("token_k2", 0.02), ("token_k3", 0.01), ("seq_sum_k3", 0.1), ("seq_mean_k2", 0.01), ("seq_max_k3", 0.05),
    ("token_k1,seq_max_k2", "0.8_1.3,0.06"), ("seq_mean_k1,token_k3", "1.05"),  # broadcast of one value
])
def test_verl_criteria_strings_keep_what_verl_keeps(rollout_rs, threshold):
    cfg = Cfg(rollout_is=None, rollout_rs=rollout_rs, rollout_rs_threshold=threshold)
    assert cfg.rollout_rs is None and cfg.rollout_rs_criteria == rollout_rs  # translated into this package's fields
    rejected = kept = 0
    for seed in range(4):
        train, rollout, mask = batch(seed, spread=0.15 if "k1" in rollout_rs else 0.3)
        _, m, _ = correct(train, rollout, mask, **{k: v for k, v in cfg.pipeline_kwargs().items()})
        want = verl_keep((train.double() - rollout.double()).tolist(), mask.tolist(), rollout_rs, threshold)
        assert m.bool().tolist() == want, (rollout_rs, threshold, seed)
        kept += sum(map(sum, want))
        rejected += int(mask.sum()) - sum(map(sum, want))
    assert kept > 0 and rejected > 0  # the band really cuts


def test_every_verl_preset_is_accepted_with_verl_meaning():
    # verl's 19 factories at verl-project/verl 1dda039: 14 here (2 IcePop ones) + 5 shared with this package's names
    assert len(VERL_PRESETS) + 5 == 19
    for name, fields in VERL_PRESETS.items():
        cfg = Cfg.from_preset(name)
        assert cfg.bypass_mode == fields.get("bypass_mode", False)
        assert cfg.use_policy_gradient == fields.get("use_policy_gradient", False)  # verl's loss_type="reinforce"
        assert cfg.rollout_is == fields["rollout_is"]
        if "rollout_rs" in fields:  # the verl criterion, translated
            assert cfg.rollout_rs_criteria == fields["rollout_rs"] and cfg.rollout_rs is None
        assert Cfg.from_dict(cfg.to_dict()) == cfg  # saved in this package's spelling, loaded back identically
    cfg = Cfg.from_preset("bypass_pg_geo_rs_token_tis", is_threshold=3.0, rs_threshold="0.9_1.1")
    assert cfg.rollout_is_threshold == 3.0
    assert Cfg.from_preset("decoupled_k3_rs", rs_threshold=0.05).rollout_rs_criteria_threshold == "0.05"
    # the shared names keep this package's meaning; decoupled_geo_rs also vetoes (verl's has no veto)
    assert Cfg.decoupled_geo_rs().rollout_token_veto_threshold == 1e-4


def test_verl_loss_type_and_icepop():
    assert Cfg.from_dict({"bypass_mode": True, "loss_type": "reinforce"}).use_policy_gradient
    assert not Cfg.from_dict({"bypass_mode": True, "loss_type": "ppo_clip"}).use_policy_gradient
    with pytest.raises(ValueError, match="loss_type='dapo'.*'ppo_clip' and 'reinforce'"):
        Cfg.from_dict({"loss_type": "dapo"})
    band = Cfg.from_preset("decoupled_token_band_rs")  # the old "icepop": token rejection in [0.5, 2]
    assert (band.rollout_is, band.rollout_rs, band.rs_threshold_lower, band.rollout_rs_threshold) == (
        None, "token", 0.5, 2.0)
    train, rollout = torch.tensor([[0.0, 0.0, 0.0]]), torch.log(torch.tensor([[1.0, 2.1, 0.45]]))  # (1, 3)
    mask = torch.ones(1, 3)
    _, m, _ = correct(train, rollout, mask, **band.pipeline_kwargs())
    assert m.tolist() == [[1, 0, 0]]  # rho = 1 kept; 1/2.1 and 1/0.45 outside [0.5, 2] rejected
    with pytest.raises(ValueError, match="one spelling"):
        Cfg(rollout_rs="token_k1", rollout_rs_threshold=2.0, rollout_rs_criteria="token_k2",
            rollout_rs_criteria_threshold="0.1")
    with pytest.raises(ValueError, match="2 criteria but rollout_rs_threshold"):
        Cfg(rollout_rs="token_k1,token_k2", rollout_rs_threshold="0.5_2,0.1,0.2")
    with pytest.raises(ValueError, match="needs rollout_rs_threshold"):
        Cfg(rollout_rs="seq_mean_k3")


@pytest.mark.parametrize("preset", ["decoupled_k3_rs_token_tis", "decoupled_geo_rs"])
def test_the_tensors_command_applies_every_field_of_the_preset(preset, capsys):
    """``trl-rollout-corr tensors`` prints what the pipeline computes from the whole config (verl's divergence
    criteria included; they were once dropped there, printing no rejection)."""
    import torch

    from trl_rollout_corr import RolloutCorrectionConfig
    from trl_rollout_corr.cli.main import main
    from trl_rollout_corr.core import compute_rollout_correction_and_rejection_mask

    main(["tensors", "--preset", preset])
    printed = dict(line.split()[:2] for line in capsys.readouterr().out.splitlines()
                   if line.startswith("rollout_corr/"))
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 8, generator=g) * 2 - 0.1  # (B, T) the command's sample log-probs
    rollout = (old + 0.3 * torch.randn(4, 8, generator=g)).clamp(max=-1e-3)  # (B, T)
    mask = (torch.arange(8)[None] < torch.tensor([[8], [5], [3], [8]])).float()  # (B, T)
    cfg = RolloutCorrectionConfig.from_preset(preset)
    assert cfg.rollout_rs_criteria is not None or cfg.rollout_rs is not None
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])  # (B,) the command's
    _, kept, metrics = compute_rollout_correction_and_rejection_mask(old, rollout, mask, **cfg.pipeline_kwargs(),
                                                                     advantages=advantages)
    assert 0 < float((mask - kept).sum())  # something is rejected on this data
    assert printed.keys() == metrics.keys()
    for name, value in metrics.items():
        assert float(printed[name]) == pytest.approx(value, rel=1e-5, abs=1e-6), name
