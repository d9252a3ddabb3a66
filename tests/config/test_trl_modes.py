"""TRL's own correction, spelled with TRL's fields, trains with TRL 1.16's own gradient.

TRL's ``GRPOTrainer`` applies its ``vllm_importance_sampling_*`` correction only on its vLLM path. Its side of each
comparison therefore runs TRL's unchanged code with the vLLM switch on and the engine replaced by the test's
``rollout_func`` (TRL calls only the engine's weight sync there, stubbed), so TRL computes pi_old, its IS ratio,
its mask and its loss itself. This package's side spells the same settings with the same fields. Each case compares
the loss and every gradient of one micro-batch (forward + backward, with pi_theta moved away from pi_old as after an
optimizer step), with TRL's ratio checked to really truncate / zero weights in the batch.
"""

from __future__ import annotations

import math

import pytest
import torch
from trl import GRPOTrainer

from datasets import Dataset

from tests.grpo.test_trl_equivalence import ROWS, TOK, common_args, loss_grads_metrics, reward, rollout_func_factory
from trl_rollout_corr import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer, RolloutCorrectionConfig
from trl_rollout_corr.config.compat import translate_trl_correction
from trl_rollout_corr.testing.toy_task import build_model

# mode, clip_min, clip_max (None: TRL's default) -> cases that make the bound bite on the test batch's ratios
MODE_CASES = {
    "sequence_mask_default": dict(vllm_importance_sampling_correction=True),  # TRL's switch alone: its default
    "sequence_mask_two_sided": dict(vllm_importance_sampling_mode="sequence_mask",
                                    vllm_importance_sampling_clip_min=0.3, vllm_importance_sampling_clip_max=3.0),
    "sequence_truncate": dict(vllm_importance_sampling_mode="sequence_truncate",
                              vllm_importance_sampling_clip_min=0.3, vllm_importance_sampling_clip_max=2.0),
    "token_mask": dict(vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=0.5,
                       vllm_importance_sampling_clip_max=2.0),
    "token_truncate": dict(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_min=0.5,
                           vllm_importance_sampling_clip_max=2.0),
    "token_truncate_cap": dict(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_cap=2.0),
}


class _NoEngine:
    """TRL's rollout_func path calls only the engine's weight sync."""

    def sync_weights(self):
        pass


def near_policy_rollout_func(prompts, trainer):
    """The equivalence tests' completions with log-probs around the untrained model's (log 1/20 ~ -3.0 +- 1.2), so
    that sequence ratios fall on both sides of TRL's bounds."""
    out = rollout_func_factory()(prompts, trainer)
    out["logprobs"] = [[-3.0 + 0.8 * (lp + 1.8) for lp in row] for row in out["logprobs"]]
    return out


def _build(trainer_cls, config_cls, output_dir, loss_type, **fields):
    args = config_cls(**{**common_args(output_dir, loss_type=loss_type, num_iterations=2,
                                       gradient_accumulation_steps=2), **fields})
    return trainer_cls(model=build_model(hidden_size=32), reward_funcs=reward, args=args,
                       train_dataset=Dataset.from_list(ROWS), processing_class=TOK,
                       rollout_func=near_policy_rollout_func)


def trl_with_its_correction(tmp_path, loss_type, trl_fields):
    """TRL's own trainer with its vLLM IS switched on, generation by the test's rollout_func."""
    from trl import GRPOConfig

    fields = {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "sequence_mask",
              "vllm_importance_sampling_clip_max": 3.0, **trl_fields}
    theirs = _build(GRPOTrainer, GRPOConfig, tmp_path / "trl", loss_type, **fields)
    theirs.use_vllm, theirs.vllm_generation, theirs._last_loaded_step = True, _NoEngine(), -1
    return theirs


def ours_with_trl_fields(tmp_path, loss_type, trl_fields):
    """This package's trainer with TRL's spelling alone (its fields; TRL's switch alone for its default)."""
    return _build(RolloutCorrGRPOTrainer, RolloutCorrGRPOConfig, tmp_path / "ours", loss_type,
                  **{"vllm_importance_sampling_correction": None, **trl_fields})


@pytest.mark.parametrize("case,loss_type", [(case, loss_type) for case in MODE_CASES for loss_type in ("dapo", "grpo")
                                             if not (case.endswith("_cap") and loss_type == "grpo")])
def test_trl_mode_has_trls_gradient(tmp_path, case, loss_type):
    fields = MODE_CASES[case]
    theirs = trl_with_its_correction(tmp_path, loss_type, fields)
    with pytest.warns(FutureWarning, match="deprecated") if "cap" in case else _nothing():
        ours = ours_with_trl_fields(tmp_path, loss_type, fields)
    rows = ROWS[:16]
    t_batch, t_loss, t_grads, _ = loss_grads_metrics(theirs, rows)
    o_batch, o_loss, o_grads, _ = loss_grads_metrics(ours, rows)
    torch.testing.assert_close(o_batch["completion_ids"], t_batch["completion_ids"], rtol=0, atol=0)
    ratio = t_batch["importance_sampling_ratio"]  # TRL's weights: the bound must bite, both ways where it has two
    mode = fields.get("vllm_importance_sampling_mode", "sequence_mask")
    lower = fields.get("vllm_importance_sampling_clip_min")
    upper = fields.get("vllm_importance_sampling_clip_max", fields.get("vllm_importance_sampling_cap", 3.0))
    if mode.endswith("mask"):
        assert (ratio == 0).any() and (ratio > 0).any()
    else:
        assert (ratio == upper).any() and (lower is None or (ratio == lower).any())
    # the same number of tokens in the loss's divisor: masked tokens stay (weight 0), as in TRL
    assert o_batch["num_items_in_batch"] == t_batch["num_items_in_batch"]
    assert t_loss.item() != 0.0
    torch.testing.assert_close(o_loss, t_loss, rtol=1e-6, atol=1e-7)
    assert o_grads.keys() == t_grads.keys() and t_grads
    for name, grad in t_grads.items():
        torch.testing.assert_close(o_grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)
    cfg = ours.rollout_correction  # saved and logged as what runs: this package's fields, TRL's switched off
    level, bound = mode.split("_")
    assert (cfg.rollout_is, cfg.rollout_is_bound, cfg.rollout_is_threshold) == (level, bound, upper)
    assert cfg.rollout_is_threshold_lower == lower and not cfg.bypass_mode
    assert ours.args.vllm_importance_sampling_correction is False and ours.args.vllm_importance_sampling_mode is None
    assert ours.args.to_dict()["rollout_is_bound"] == bound


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_no_preset_is_trls_own_default_for_every_loss_type_and_level(tmp_path):
    """The class swap with no preset: TRL 1.16's own default, sequence_mask (C=3), for every loss type and level,
    but VESPO, for which TRL refuses its sequence modes: there TRL's token_truncate mode (C=3)."""
    from trl import GRPOConfig

    from tests.grpo.test_trl_equivalence import LOSS_TYPES

    trl = GRPOConfig(output_dir=str(tmp_path), use_cpu=True)  # TRL's own defaults, read from TRL
    assert (trl.vllm_importance_sampling_correction, trl.vllm_importance_sampling_mode,
            trl.vllm_importance_sampling_clip_max) == (True, "sequence_mask", 3.0)
    token_truncate = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=3.0)
    for loss_type in LOSS_TYPES:
        for level in ("token", "sequence"):
            args = RolloutCorrGRPOConfig(output_dir=str(tmp_path), use_cpu=True, loss_type=loss_type,
                                         importance_sampling_level=level)
            expected = token_truncate if loss_type == "vespo" else RolloutCorrectionConfig.trl_default()
            assert args.rollout_correction == expected, (loss_type, level)
    assert RolloutCorrectionConfig.trl_default() == RolloutCorrectionConfig(
        rollout_is="sequence", rollout_is_bound="mask", rollout_is_threshold=3.0)
    assert token_truncate == RolloutCorrectionConfig(**translate_trl_correction(True, "token_truncate"))


@pytest.mark.parametrize("loss_type,level", [("luspo", "sequence"), ("grpo", "sequence"), ("vespo", "token"),
                                             ("sapo", "token")])
def test_no_preset_trains(tmp_path, loss_type, level):
    from tests.support.trainer_utils import make_trainer

    trainer, collector = make_trainer(tmp_path, max_steps=2, loss_type=loss_type, importance_sampling_level=level)
    # TRL's default, sequence_mask, but for VESPO (TRL's token_truncate)
    assert trainer.rollout_correction.rollout_is == ("token" if loss_type == "vespo" else "sequence")
    trainer.train()
    logs = [log for log in collector.logs if "loss" in log]
    assert len(logs) == 2 and all(math.isfinite(log["loss"]) for log in logs)
    if loss_type != "vespo":  # TRL's sequence mask: its metrics are logged
        assert all("rollout_corr/rollout_is_masked_fraction" in log for log in logs)


def test_trl_spelling_errors_name_the_field():
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode='token_clip'.*TRL's modes are"):
        RolloutCorrGRPOConfig(output_dir="x", use_cpu=True, vllm_importance_sampling_mode="token_clip")
    with pytest.raises(ValueError, match=r"clip_min \(3.0\) must be less than .*clip_max \(2.0\)"):
        RolloutCorrGRPOConfig(output_dir="x", use_cpu=True, vllm_importance_sampling_clip_min=3.0,
                              vllm_importance_sampling_clip_max=2.0)
    with pytest.raises(ValueError, match="name one correction"):
        RolloutCorrGRPOConfig(output_dir="x", use_cpu=True, vllm_importance_sampling_mode="token_mask",
                              rollout_correction_preset="ppo_is_bypass")
    args = RolloutCorrGRPOConfig(output_dir="x", use_cpu=True)
    with pytest.raises(ValueError, match="after construction.*update_rollout_correction"):
        args.vllm_importance_sampling_mode = "token_mask"


def test_trl_off_is_no_correction_unless_one_is_named():
    off = RolloutCorrGRPOConfig(output_dir="x", use_cpu=True, vllm_importance_sampling_correction=False)
    assert off.rollout_correction == RolloutCorrectionConfig.disabled()
    named = RolloutCorrGRPOConfig(output_dir="x", use_cpu=True, vllm_importance_sampling_correction=False,
                                  rollout_correction_preset="ppo_is_bypass")
    assert named.rollout_correction == RolloutCorrectionConfig.ppo_is_bypass()
    # TRL's clip_max=None (no upper bound) is inf here; the saved config round-trips it
    unbounded = RolloutCorrGRPOConfig(output_dir="x", use_cpu=True, vllm_importance_sampling_mode="token_mask",
                                      vllm_importance_sampling_clip_max=math.inf, vllm_importance_sampling_clip_min=0.1)
    cfg = unbounded.rollout_correction
    assert cfg.rollout_is_threshold == math.inf and cfg.rollout_is_threshold_lower == 0.1
    assert RolloutCorrectionConfig.from_json_string(cfg.to_json_string()) == cfg
    assert RolloutCorrectionConfig.from_yaml(cfg.to_yaml()) == cfg
