"""IcePop as the field defines it (Ling Team, Ring-1T, arXiv:2510.18855; verl-project/verl 1dda039, PR #5722).

The token IS weight is w_t = rho_t * 1[C_lower <= rho_t <= C] with rho_t = pi_train / pi_rollout, C_lower = 0.5 and
C = 5 by default: a token outside the band gets weight 0 and STAYS in the response mask (the loss's token count);
verl's ``rollout_is_threshold="lower_upper"`` string spells the same thing. The references below are hand-computed.
"""

from __future__ import annotations

import math

import pytest
import torch

from trl_rollout_corr import RolloutCorrectionConfig as Cfg
from trl_rollout_corr import compute_rollout_correction_and_rejection_mask as correct
from trl_rollout_corr.config.fields import _explicit_value

# rho per token: 1, 6 (> 5), 0.4 (< 0.5), 4.5, 0.55, and one padding position
RHO = [[1.0, 6.0, 0.4], [4.5, 0.55, 1.0]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


def inputs():
    rollout = torch.full((2, 3), -1.0, dtype=torch.float64)  # (B, T)
    train = rollout + torch.log(torch.tensor(RHO, dtype=torch.float64))  # (B, T)
    return train, rollout, torch.tensor(MASK, dtype=torch.float64)


@pytest.mark.parametrize("spelling", [
    dict(preset="icepop"), dict(preset="decoupled_token_icepop"),
    dict(rollout_is="token", rollout_is_threshold="0.5_5"),
    dict(rollout_is="token", rollout_is_threshold="0.5_5.0", bypass_mode=True, use_policy_gradient=True),
    dict(preset="bypass_pg_token_icepop"),
])
def test_icepop_zeroes_the_weight_outside_the_band_and_keeps_the_token(spelling):
    spelling = dict(spelling)
    preset = spelling.pop("preset", None)
    cfg = Cfg.from_preset(preset, **spelling) if preset else Cfg(**spelling)
    assert (cfg.rollout_is, cfg.rollout_is_bound, cfg.rollout_is_threshold_lower, cfg.rollout_is_threshold) == (
        "token", "mask", 0.5, 5.0)
    train, rollout, mask = inputs()
    w, m, met = correct(train, rollout, mask, **cfg.pipeline_kwargs())
    # hand-computed: 6 > 5 and 0.4 < 0.5 get 0; 1, 4.5, 0.55 keep their rho; padding 0
    assert w.double().flatten().tolist() == pytest.approx([1.0, 0.0, 0.0, 4.5, 0.55, 0.0], rel=1e-6)
    assert m.tolist() == MASK  # nothing rejected: the zeroed tokens stay in the loss's token count
    assert met["rollout_corr/rejected_token_fraction"] == 0.0
    assert met["rollout_corr/rollout_is_masked_fraction"] == pytest.approx(2 / 5)  # 2 of the 5 tokens zeroed
    assert met["rollout_corr/rollout_is_seq_masked_fraction"] == pytest.approx(1 / 2)  # one sequence has a zero
    assert met["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)
    assert met["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(1 / 5)


def test_the_old_icepop_is_token_rejection_under_an_honest_name():
    """decoupled_token_band_rs: rho outside [0.5, 2] leaves the loss AND its count (a rejection, not IcePop)."""
    train, rollout, mask = inputs()
    w, m, met = correct(train, rollout, mask, **Cfg.decoupled_token_band_rs().pipeline_kwargs())
    assert w is None
    assert m.tolist() == [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]  # 6, 0.4 and 4.5 are outside [0.5, 2]
    assert met["rollout_corr/rejected_token_fraction"] == pytest.approx(3 / 5)


def test_icepop_in_the_loss_divides_by_every_token():
    """A DAPO-style token-mean loss sum_t m_t w_t A / sum_t m_t: the zeroed tokens count in the denominator
    (hand-computed with A = 1: (1 + 4.5 + 0.55) / 5), where the band rejection divides by the kept tokens only."""
    train, rollout, mask = inputs()
    w, m, _ = correct(train, rollout, mask, **Cfg.icepop().pipeline_kwargs())
    assert (w.double() * m).sum().item() / m.sum().item() == pytest.approx((1 + 4.5 + 0.55) / 5, rel=1e-6)
    _, m_rs, _ = correct(train, rollout, mask, **Cfg.decoupled_token_band_rs().pipeline_kwargs())
    assert m_rs.sum().item() == 2  # the rejection's denominator: 2 kept tokens


def test_verl_lower_upper_strings():
    c = Cfg(rollout_is="sequence", rollout_is_threshold="0.25_4")
    assert (c.rollout_is_threshold, c.rollout_is_threshold_lower, c.rollout_is_bound) == (4.0, 0.25, "mask")
    c = Cfg(rollout_is_threshold="3.0")  # a number as a string: TIS, as in verl
    assert (c.rollout_is_threshold, c.rollout_is_threshold_lower, c.rollout_is_bound) == (3.0, None, "truncate")
    assert Cfg.from_dict(c.to_dict()) == c and isinstance(Cfg(rollout_is_threshold=" 0.5_5 ").rollout_is_threshold,
                                                            float)
    with pytest.raises(ValueError, match="rollout_is_threshold='0.5_x'.*'lower_upper'"):
        Cfg(rollout_is_threshold="0.5_x")
    with pytest.raises(ValueError, match="one spelling"):
        Cfg(rollout_is_threshold="0.5_5", rollout_is_threshold_lower=0.4)
    with pytest.raises(ValueError, match="rollout_is_threshold_lower \\(5.0\\) must be < rollout_is_threshold"):
        Cfg(rollout_is_threshold="5_2")
    with pytest.raises(ValueError, match="rollout_is_threshold must be a number > 0"):
        Cfg(rollout_is_threshold="0_-1")
    with pytest.raises(ValueError, match="bypass PPO applies no IS weight"):  # IcePop needs the weight applied
        Cfg(rollout_is="token", rollout_is_threshold="0.5_5", bypass_mode=True)
    # the trainer's flat field keeps the band for the config to parse; other strings must be numbers
    assert _explicit_value("rollout_is_threshold", "0.5_5") == "0.5_5"
    assert _explicit_value("rollout_is_threshold", "2") == 2.0
    assert verl_factory_arguments_reach_the_fields()


def verl_factory_arguments_reach_the_fields():
    c = Cfg.from_preset("decoupled_token_icepop", threshold=4.0, threshold_lower=0.25)
    return (c.rollout_is_threshold, c.rollout_is_threshold_lower, c.rollout_is_bound) == (4.0, 0.25, "mask")


def test_the_trainer_config_reads_verl_bands(tmp_path):
    from trl_rollout_corr import RolloutCorrGRPOConfig

    args = RolloutCorrGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                 rollout_correction_preset="icepop", rollout_is_threshold="0.25_8")
    rc = args.rollout_correction
    assert (rc.rollout_is_threshold, rc.rollout_is_threshold_lower, rc.rollout_is_bound) == (8.0, 0.25, "mask")
    args = RolloutCorrGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                 rollout_correction_preset="decoupled_token_is", rollout_is_threshold="0.5_5")
    assert args.rollout_correction == Cfg.icepop()
    assert math.isclose(args.rollout_is_threshold, 5.0)  # written back in this package's spelling
