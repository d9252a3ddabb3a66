"""A correction method is one file (#39): each criterion of ``core/criteria.py`` declares its fields, statistics and
metrics once, and the configs, the pipeline, the plan and the metric registry ask the list instead of repeating it."""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any

import pytest
import torch

from trl_rollout_corr import RolloutCorrectionConfig
from trl_rollout_corr.core import CorrectionParams, compute_rollout_correction_stats, finalize_stats
from trl_rollout_corr.core import criteria as criteria_module
from trl_rollout_corr.core import metrics as metrics_module
from trl_rollout_corr.core import pipeline as pipeline_module
from trl_rollout_corr.core.criteria import CRITERIA, correction_fields
from trl_rollout_corr.core.criterion import (CorrectionField, CorrectionState, Criterion, StatFloats,
                                             declared_stat_keys, stat_key, with_fields)
from trl_rollout_corr.core.metric_names import METRIC_NAMES
from trl_rollout_corr.core.stats import METRIC_PREFIX, SUM, count
from trl_rollout_corr.config.correction import MODE_FIELDS
from trl_rollout_corr.config.fields import RolloutCorrectionFields
from trl_rollout_corr.config.plan import batch_scope_statistics

EVERYTHING = dict(rollout_is="token", rollout_is_bound="mask", rollout_is_threshold_lower=0.5, rollout_rs="token",
                  rollout_rs_threshold=5.0, rollout_token_veto_threshold=1e-4,
                  rollout_rs_criteria="token_k1,seq_max_k2", rollout_rs_criteria_threshold="0.2_5,1.0",
                  rollout_m2_threshold=0.04)
"""Every criterion on (the M2 mask's all-token scope, the masked IS bound)."""


def sample(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(5, 8, generator=g) * 2 - 0.05  # (B, T)
    rollout = (old + 0.5 * torch.randn(5, 8, generator=g)).clamp(max=-1e-3)  # (B, T)
    mask = (torch.arange(8)[None] < torch.tensor([[8], [5], [3], [8], [1]])).float()  # (B, T)
    return old, rollout, mask


def runs() -> list[Any]:
    """The pipeline with every criterion on, in its two IS forms, M2PO's trust-region scope and DPPO."""
    old, rollout, mask = sample()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0])  # (B,)
    return [compute_rollout_correction_stats(old, rollout, mask, **EVERYTHING, advantages=adv),
            compute_rollout_correction_stats(old, rollout, mask, rollout_is="sequence", rollout_is_batch_normalize=True,
                                             rollout_rs="geometric", rollout_rs_threshold=1.1),
            compute_rollout_correction_stats(old, rollout, mask, rollout_m2_threshold=0.01,
                                             rollout_m2_scope="trust_region", advantages=adv),
            compute_rollout_correction_stats(old, rollout, mask, rollout_dppo="binary_kl", advantages=adv)]


# ---------------------------------------------------------------- fields: declared once, every config derived
def test_every_criterion_field_is_a_field_of_every_config_with_its_declared_default():
    config = {f.name: f for f in dataclasses.fields(RolloutCorrectionConfig)}
    params = {f.name: f for f in dataclasses.fields(CorrectionParams)}
    flat = {f.name: f for f in dataclasses.fields(RolloutCorrectionFields)}
    declared = correction_fields()
    assert len(declared) == sum(len(c.fields) for c in CRITERIA) == len({f.name for f in declared})
    assert list(params) == [f.name for f in declared]  # CorrectionParams is exactly the criteria's fields
    for f in declared:  # (annotations, not Field.type: transformers' HfArgumentParser rewrites the latter in place)
        assert config[f.name].default == f.default, f.name
        assert RolloutCorrectionConfig.__annotations__[f.name] == f.type, f.name
        assert flat[f.name].default is None and flat[f.name].metadata["help"] == f.help, f.name
        assert RolloutCorrectionFields.__annotations__[f.name] == f.flat_type, f.name
    # the one field with two defaults: a config's default correction has token IS, the core's keywords none
    assert config["rollout_is"].default == "token" and params["rollout_is"].default is None
    assert [f.name for f in declared if params[f.name].default != config[f.name].default] == ["rollout_is"]
    # the fields that are no criterion's (the mode) are declared once too, and reach both configs the same way
    assert set(config) - {f.name for f in declared} == {f.name for f in MODE_FIELDS} == {
        "rollout_rs_exclude_from_baseline", "bypass_mode", "use_policy_gradient"}
    for f in MODE_FIELDS:
        assert config[f.name].default == f.default and RolloutCorrectionConfig.__annotations__[f.name] == f.type
        assert flat[f.name].default is None and flat[f.name].metadata["help"] == f.help, f.name
        assert RolloutCorrectionFields.__annotations__[f.name] == f.flat_type, f.name


def test_a_config_that_declares_a_correction_field_itself_is_refused():
    field = CorrectionField("rollout_x", "float | None", None, "X.", "float | str | None")

    class Own:
        __annotations__ = {"rollout_x": "float"}

    with pytest.raises(TypeError, match=r"declares \['rollout_x'\] itself: a correction field is declared once"):
        with_fields((field,), "config")(Own)
    with pytest.raises(ValueError, match="form must be one of"):
        with_fields((field,), "flat_form")


def test_config_validation_asks_each_criterion(monkeypatch):
    """``RolloutCorrectionConfig.validate`` runs every criterion's ``check``, in the list's order."""
    seen = []
    for criterion in CRITERIA:
        monkeypatch.setattr(criterion, "check", lambda cfg, name=criterion.name: seen.append(name))
    RolloutCorrectionConfig()
    assert seen == [c.name for c in CRITERIA] and len(set(seen)) == len(CRITERIA)


def test_masks_tokens_zeroes_advantages_and_batch_scope_ask_the_criteria():
    """The hand-derived answers for one configuration per criterion (what the config's properties and the plan's
    generation-batch statistics were before they asked the list)."""
    cases = {  # preset or fields: (masks_tokens, zeroes_advantages, batch scope)
        "decoupled_token_is": (False, False, ()),
        "decoupled_geo_rs": (True, False, ()),  # geometric RS and the veto
        "m2po": (False, True, ("the second-moment mask's threshold (rollout_m2_threshold)",)),
    }
    for name, (masks, zeroes, scope) in cases.items():
        cfg = RolloutCorrectionConfig.from_preset(name)
        assert (cfg.masks_tokens, cfg.zeroes_advantages) == (masks, zeroes), name
        assert batch_scope_statistics(cfg, "grpo", ("dapo",)) == scope, name
    for fields in (dict(rollout_token_veto_threshold=1e-4), dict(rollout_rs_criteria="token_k2",
                                                                 rollout_rs_criteria_threshold="0.1"),
                   dict(rollout_m2_threshold=0.04)):
        assert RolloutCorrectionConfig(rollout_is=None, **fields).masks_tokens, fields
    normalized = RolloutCorrectionConfig(rollout_is_batch_normalize=True, rollout_m2_threshold=0.04)
    assert batch_scope_statistics(normalized, "dapo", ("dapo",)) == (
        "rollout_is_batch_normalize", "the second-moment mask's threshold (rollout_m2_threshold)",
        "the kept-token count dapo divides by (RS/veto reject tokens)")


# ---------------------------------------------------------------- statistics: declared once, read by name
def test_every_statistic_the_pipeline_writes_is_declared():
    """A statistic the pipeline (or a criterion) writes under an undeclared name would be invisible to the finalize
    step; the off-policy, length and gradient-share families are the diagnostics' (not a criterion's)."""
    diagnostics = ("offpolicy.", "len.", "tkl.", "share.")
    declared = declared_stat_keys()
    for result in runs():
        written = [name for group in (result.stats.sums, result.stats.maxes, result.stats.mins) for name in group]
        undeclared = [name for name in written if name not in declared and not name.startswith(diagnostics)]
        assert not undeclared, undeclared


def test_a_misspelled_statistic_raises_instead_of_reading_zero():
    f = StatFloats({SUM + "mask.m2_masked_tok_n": 3.0, SUM + "mask.tok_n": 6.0})
    assert f.sum("mask.m2_masked_tok_n") == 3.0 and f.has("mask.tok_n") and not f.has("mask.kept_tok_n")
    assert f.sum("mask.kept_tok_n", 0.0) == 0.0  # declared, absent: the default
    for typo in ("mask.m2_maskd_tok_n", "m2_masked_tok_n", "mask.tok_n "):
        with pytest.raises(KeyError, match=repr(typo).replace(".", r"\.")):
            f.sum(typo, 0.0)
        with pytest.raises(KeyError):
            f.has(typo)
    with pytest.raises(KeyError):
        f.max("rollout_is.mx")
    with pytest.raises(ValueError, match="declared by trl_rollout_corr.core.second_moment and again by elsewhere"):
        stat_key("mask.m2_masked_tok_n", "elsewhere")


def test_every_criterion_metric_is_registered_and_emitted_by_its_criterion():
    """Each criterion's ``metrics`` is what its finalize step emits (with every criterion on), and the registry holds
    them all; no two criteria claim a name."""
    emitted = set()
    for result in runs():
        floats = StatFloats(result.stats.to_floats())
        for criterion in CRITERIA:
            names = {key.removeprefix(METRIC_PREFIX) for key in criterion.finalize(floats)}
            assert names <= set(criterion.metrics), (criterion.name, names - set(criterion.metrics))
            emitted |= names
    claimed = [name for criterion in CRITERIA for name in criterion.metrics]
    assert len(claimed) == len(set(claimed)) and set(claimed) <= METRIC_NAMES
    divergence = {f"rollout_rs_{c}_{m}" for c in ("token_k1", "seq_max_k2")
                  for m in ("mean", "max", "masked_fraction", "seq_masked_fraction")}
    unconfigured = {n for n in claimed if n.startswith("rollout_rs_") and n.endswith(("_mean", "_max", "_fraction"))
                    and any(f"_k{k}_" in n for k in (1, 2, 3))} - divergence
    assert set(claimed) - unconfigured == emitted


# ---------------------------------------------------------------- the recipe: one file, one line in the list
class EveryOtherToken(Criterion):
    """A toy criterion of the recipe's shape: reject the odd positions, count them."""

    name = "every_other_token"
    metrics = ("toy_rejected_fraction",)
    REJECTED = stat_key("mask.toy_rejected_tok_n", "tests.core.test_criteria")

    def apply(self, params: Any, state: CorrectionState) -> None:
        odd = (torch.arange(state.valid.shape[1]) % 2 == 1).expand_as(state.valid)  # (B, T)
        state.stats.sums[self.REJECTED] = count(state.valid & odd)
        state.reject(odd)  # (B, T)

    def finalize(self, f: StatFloats) -> dict[str, float]:
        if not f.has(self.REJECTED):
            return {}
        return {METRIC_PREFIX + "toy_rejected_fraction": f.sum(self.REJECTED) / f.sum("mask.tok_n")}


def test_a_criterion_added_to_the_list_is_applied_and_finalized(monkeypatch):
    """One line in the list is all the pipeline and the finalize step need: the toy's mask is ANDed with the
    others' and its metric appears; the hand count: 5 rows of lengths 8, 5, 3, 8, 1 have 4 + 2 + 1 + 4 + 0 = 11 odd
    positions among 25 tokens."""
    extended = (*CRITERIA, EveryOtherToken())
    for module in (criteria_module, pipeline_module, metrics_module):
        monkeypatch.setattr(module, "CRITERIA", extended)
    old, rollout, mask = sample()
    result = compute_rollout_correction_stats(old, rollout, mask, rollout_is="token")
    expected = mask.clone()  # (B, T)
    expected[:, 1::2] = 0
    assert torch.equal(result.modified_response_mask, expected)
    metrics = finalize_stats(result.stats)
    assert metrics[METRIC_PREFIX + "toy_rejected_fraction"] == pytest.approx(11 / 25, abs=1e-15)
    assert metrics[METRIC_PREFIX + "rejected_token_fraction"] == pytest.approx(11 / 25, abs=1e-15)
    assert math.isfinite(metrics[METRIC_PREFIX + "rollout_is_mean"])



class Marks(Criterion):
    """A toy criterion that rejects and zeroes advantages at fixed (row, column) positions."""

    def __init__(self, name: str, rejected: list[tuple[int, int]], zeroed: list[tuple[int, int]]) -> None:
        self.name, self.rejected, self.zeroed = name, rejected, zeroed

    @staticmethod
    def _mask(like: torch.Tensor, at: list[tuple[int, int]]) -> torch.Tensor:
        mask = torch.zeros_like(like, dtype=torch.bool)  # (B, T)
        for row, col in at:
            mask[row, col] = True
        return mask

    def apply(self, params: Any, state: CorrectionState) -> None:
        state.reject(self._mask(state.valid, self.rejected))  # (B, T)
        state.zero_advantages(self._mask(state.valid, self.zeroed))  # (B, T)


def test_two_criteria_that_reject_and_zero_advantages_combine_and_neither_overwrites_the_other(monkeypatch):
    """Two methods that both reject and both zero advantages: the kept mask is the AND of the two rejections and the
    advantage mask the AND of the two "not zeroed" masks (a method that assigned its mask would drop the other's).
    Hand-derived, on rows of lengths 8, 5, 3, 8, 1 (``sample``): A rejects (0, 1), (2, 0), B rejects (0, 1), (3, 7),
    (4, 3) (padding: changes nothing); A zeroes the advantage of (1, 2), (3, 0), B of (1, 4), (3, 0)."""
    first = Marks("first", rejected=[(0, 1), (2, 0)], zeroed=[(1, 2), (3, 0)])
    second = Marks("second", rejected=[(0, 1), (3, 7), (4, 3)], zeroed=[(1, 4), (3, 0)])
    monkeypatch.setattr(pipeline_module, "CRITERIA", (*CRITERIA, first, second))
    old, rollout, mask = sample()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0])  # (B,)
    result = compute_rollout_correction_stats(old, rollout, mask, advantages=adv)  # no IS, nothing else on
    lengths = [8, 5, 3, 8, 1]
    kept = [[1.0 if t < n else 0.0 for t in range(8)] for n in lengths]  # the hand-written mask
    for row, col in ((0, 1), (2, 0), (3, 7)):
        kept[row][col] = 0.0
    kept_zeroed = [[1.0] * 8 for _ in lengths]
    for row, col in ((1, 2), (3, 0), (1, 4)):
        kept_zeroed[row][col] = 0.0
    assert result.modified_response_mask.tolist() == kept
    assert result.advantage_mask.tolist() == kept_zeroed
    assert result.advantage_mask.dtype == mask.dtype
    # the share of |A| the correction dropped: rejected or zeroed, over the 25 valid tokens
    dropped = {(0, 1), (2, 0), (3, 7), (1, 2), (3, 0), (1, 4)}
    want = sum(abs(float(adv[r])) for r, _ in dropped) / sum(abs(float(adv[r])) * n for r, n in enumerate(lengths))
    assert finalize_stats(result.stats)[METRIC_PREFIX + "grad_share_masked"] == pytest.approx(want, abs=1e-6)


def test_the_state_carries_both_log_probs_and_combines_weights():
    """A probability-difference method reads exp(log pi_train) - exp(log pi_rollout) from the state; weights
    multiply, pinned and zeroed weights OR (hand values)."""
    train = torch.tensor([[-0.5, -1.0, 0.0]])  # (1, 3)
    rollout = torch.tensor([[-0.7, -1.0, -2.0]])  # (1, 3)
    valid = torch.tensor([[True, True, False]])  # (1, 3)
    state = CorrectionState(train_log_prob=train, rollout_log_prob=rollout, valid=valid, stats=None,
                            mask_dtype=torch.float32)
    assert state.log_ratio[0].tolist() == pytest.approx([0.2, 0.0, 2.0], abs=1e-6)
    assert torch.equal(state.keep, valid) and state.advantage_mask is None and state.is_weights is None
    diff = (state.train_log_prob.exp() - state.rollout_log_prob.exp()).abs()  # (1, 3)
    assert diff[0].tolist() == pytest.approx([math.exp(-0.5) - math.exp(-0.7), 0.0, 1 - math.exp(-2.0)], abs=1e-6)
    state.multiply_weights(torch.tensor([[2.0, 0.5, 1.0]]))
    state.multiply_weights(torch.tensor([[3.0, 4.0, 0.0]]))
    assert state.is_weights.tolist() == [[6.0, 2.0, 0.0]]
    state.pin(torch.tensor([[True, False, False]]))
    state.pin(torch.tensor([[False, True, False]]))
    state.zero_weights(torch.tensor([[False, False, True]]))
    state.zero_weights(torch.tensor([[False, False, False]]))
    assert state.pinned.tolist() == [[True, True, False]] and state.weight_zeroed.tolist() == [[False, False, True]]


# ---------------------------------------------------------------- verl's entry point: the fields from the list
def test_verl_entry_point_takes_the_fields_of_the_list_as_keywords():
    """Its signature spells out every field of the list (keyword-only, the core's defaults), verl's own arguments
    keep verl's defaults, and a keyword that is no field is refused naming it."""
    from trl_rollout_corr.core.pipeline import compute_rollout_correction_and_rejection_mask as verl_entry

    parameters = inspect.signature(verl_entry).parameters
    assert list(parameters)[:3] == ["old_log_prob", "rollout_log_prob", "response_mask"]
    fields = {name: p for name, p in parameters.items() if name not in ("old_log_prob", "rollout_log_prob",
                                                                          "response_mask", "rollout_seen",
                                                                          "advantages")}
    assert list(fields) == [f.name for f in correction_fields()]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in fields.values())
    verl_defaults = dict(rollout_is=None, rollout_is_threshold=2.0, rollout_rs=None, rollout_rs_threshold=None,
                         rollout_rs_threshold_lower=None, rollout_token_veto_threshold=None,
                         rollout_is_batch_normalize=False)  # verl's rollout_corr_helper signature
    assert {name: fields[name].default for name in verl_defaults} == verl_defaults
    old, rollout, mask = sample()
    with pytest.raises(TypeError, match=r"got \['rollout_is_treshold'\], which are no correction fields"):
        verl_entry(old, rollout, mask, rollout_is_treshold=2.0)
    with pytest.raises(TypeError):
        verl_entry(old, rollout, mask, "token")  # fields are keywords, as verl passes them
    with pytest.raises(ValueError, match="rollout_rs_threshold is required when rollout_rs is set"):
        verl_entry(old, rollout, mask, rollout_rs="token")


def test_verl_entry_point_computes_what_its_fields_say():
    """Token TIS (C = 1.5) with token RS in [0.5, 2]: the weights and the mask against a float64 re-derivation."""
    from trl_rollout_corr.core.pipeline import compute_rollout_correction_and_rejection_mask as verl_entry

    old, rollout, mask = sample()
    weights, kept, metrics = verl_entry(old, rollout, mask, rollout_is="token", rollout_is_threshold=1.5,
                                        rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.5)
    rho = (old.double() - rollout.double()).exp()  # (B, T)
    want_kept = mask.double() * ((rho >= 0.5) & (rho <= 2.0)).double()  # (B, T)
    want_w = rho.clamp(max=1.5) * mask.double()  # (B, T): IS weights stay on every valid token
    assert kept.tolist() == want_kept.float().tolist()
    torch.testing.assert_close(weights.double(), want_w, atol=1e-6, rtol=1e-6)
    assert metrics[METRIC_PREFIX + "rollout_rs_masked_fraction"] == pytest.approx(
        float(mask.sum() - want_kept.sum()) / float(mask.sum()), abs=1e-12)


# ---------------------------------------------------------------- switching a method off over a preset
@pytest.mark.parametrize(("preset", "switch", "expected"), [
    ("icepop", "rollout_is", dict(rollout_is=None, rollout_is_bound="truncate", rollout_is_threshold_lower=None)),
    ("decoupled_seq_is_rs", "rollout_rs", dict(rollout_rs=None, rollout_rs_threshold=None,
                                               rollout_rs_threshold_lower=None)),
    ("decoupled_k3_rs_token_tis", "rollout_rs_criteria", dict(rollout_rs_criteria=None,
                                                              rollout_rs_criteria_threshold=None)),
    ("m2po", "rollout_m2_threshold", dict(rollout_m2_threshold=None, rollout_m2_scope="all")),
])
def test_a_flat_field_switching_a_criterion_off_resets_the_fields_its_criterion_names(tmp_path, preset, switch,
                                                                                      expected):
    """``Criterion.switches``: "none" on a trainer's flat field switches the preset's method off and its dependent
    fields go back to their defaults (the preset's values would otherwise be refused, or silently kept)."""
    from trl_rollout_corr import RolloutCorrGRPOConfig

    assert any(switch in c.switches for c in CRITERIA)
    args = RolloutCorrGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                                 per_device_train_batch_size=4, num_generations=4,
                                 rollout_correction_preset=preset, **{switch: "none"})
    assert {k: getattr(args.rollout_correction, k) for k in expected} == expected


def test_every_switch_and_what_it_resets_are_its_criterion_s_own_fields():
    for criterion in CRITERIA:
        own = {f.name for f in criterion.fields}
        for switch, dependents in criterion.switches.items():
            assert {switch, *dependents} <= own, criterion.name
