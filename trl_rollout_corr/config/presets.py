"""The named presets as data: :data:`PRESETS` maps each name to its arguments and the fields they set.

Adding a preset is one entry here (its summary with the formula and the paper, its arguments with their defaults,
and the fields it sets from them): ``RolloutCorrectionConfig.from_preset(name, ...)``, the factory
``RolloutCorrectionConfig.<name>(...)``, the CLI's ``--rollout_correction_preset`` and the flat trainer field read
it. verl's preset names are ``VERL_PRESETS`` in :mod:`trl_rollout_corr.config.compat`.

Notation: rho_t = pi_old(y_t) / pi_rollout(y_t) (decoupled mode) or pi_theta / pi_rollout (bypass mode), C the upper
bound of the IS weight.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .compat import ICEPOP, TRL_DEFAULT


@dataclass(frozen=True)
class Preset:
    """One named preset.

    Args:
        summary: what it computes (formula, paper): the factory's docstring.
        arguments: the factory's arguments (name -> default), in order; they can be given positionally.
        fields: the arguments -> the fields the preset sets (the others keep ``RolloutCorrectionConfig``'s
            defaults).
    """

    summary: str
    arguments: dict[str, float]
    fields: Callable[..., dict[str, Any]]


def _geo_band(rs_threshold: float) -> float:
    """The lower bound of the geometric band [2 - rs_threshold, rs_threshold] (rounded: 2 - 1.001 = 0.999)."""
    return round(2.0 - rs_threshold, 12)


PRESETS: dict[str, Preset] = {
    "decoupled_token_is": Preset(
        "Decoupled PPO (3 policies) with token-level TIS, w_t = min(pi_old/pi_rollout, C).\n\n"
        "Decoupled PPO: Hilton, Cobbe & Schulman, arXiv:2110.00641; TIS: Yao et al. (2025 blog), the truncated "
        "weight of IMPALA (arXiv:1802.01561). ``threshold``: C.",
        dict(threshold=2.0),
        lambda threshold: dict(rollout_is="token", rollout_is_threshold=threshold)),
    "decoupled_seq_is": Preset(
        "Decoupled PPO with sequence-level TIS, w = min(prod_t rho_t, C). ``threshold``: C.",
        dict(threshold=2.0),
        lambda threshold: dict(rollout_is="sequence", rollout_is_threshold=threshold)),
    "decoupled_seq_is_rs": Preset(
        "Decoupled PPO with sequence TIS plus sequence rejection in [1/rs_threshold, rs_threshold]. "
        "``is_threshold``: C of the IS weight; ``rs_threshold``: the upper RS bound, the lower is its inverse.",
        dict(is_threshold=2.0, rs_threshold=2.0),
        lambda is_threshold, rs_threshold: dict(
            rollout_is="sequence", rollout_is_threshold=is_threshold, rollout_rs="sequence",
            rollout_rs_threshold=rs_threshold, rollout_rs_threshold_lower=1.0 / rs_threshold)),
    "decoupled_geo_rs": Preset(
        "Decoupled PPO, no IS weights, geometric-mean rejection in [2 - rs_threshold, rs_threshold] + veto.\n\n"
        "Geometric rejection (Geo-RS): Liu, Li et al., \"When Speed Kills Stability\" (2025 blog), as in verl. "
        "``rs_threshold``: the upper bound of the geometric mean of rho_t; ``veto_threshold``: C_veto.",
        dict(rs_threshold=1.001, veto_threshold=1e-4),
        lambda rs_threshold, veto_threshold: dict(
            rollout_is=None, rollout_rs="geometric", rollout_rs_threshold=rs_threshold,
            rollout_rs_threshold_lower=_geo_band(rs_threshold), rollout_token_veto_threshold=veto_threshold)),
    "ppo_is_bypass": Preset(
        "Bypass PPO: pi_old := pi_rollout, PPO-clip on pi_theta/pi_rollout; token IS feeds metrics only. "
        "``threshold``: C (of the weights the metrics report).",
        dict(threshold=2.0),
        lambda threshold: dict(rollout_is="token", rollout_is_threshold=threshold, bypass_mode=True)),
    "pg_is": Preset(
        "Bypass REINFORCE with sequence TIS: -stopgrad(min(prod pi_theta/pi_rollout, C)) log pi_theta A. "
        "``threshold``: C.",
        dict(threshold=2.0),
        lambda threshold: dict(rollout_is="sequence", rollout_is_threshold=threshold, bypass_mode=True,
                               use_policy_gradient=True)),
    "pg_rs": Preset(
        "Bypass REINFORCE, no IS weights, geometric rejection + veto. ``rs_threshold``: the upper bound of the "
        "geometric mean of rho_t, the lower is 2 - rs_threshold; ``veto_threshold``: C_veto.",
        dict(rs_threshold=1.001, veto_threshold=1e-4),
        lambda rs_threshold, veto_threshold: dict(
            rollout_is=None, rollout_rs="geometric", rollout_rs_threshold=rs_threshold,
            rollout_rs_threshold_lower=_geo_band(rs_threshold), rollout_token_veto_threshold=veto_threshold,
            bypass_mode=True, use_policy_gradient=True)),
    "disabled": Preset(
        "No correction at all; the off-policy diagnostics are still logged.",
        {},
        lambda: dict(rollout_is=None)),
    "icepop": Preset(
        "IcePop (Ling Team, Ring-1T, arXiv:2510.18855; verl's ``decoupled_token_icepop``): decoupled PPO with the "
        "token weight w_t = rho_t * 1[lower <= rho_t <= upper], rho_t = pi_old / pi_rollout. A token outside the "
        "band gets weight 0 and stays in the loss's token count (a weight, not a rejection). ``lower``: C_lower; "
        "``upper``: C.",
        dict(lower=0.5, upper=5.0),
        lambda lower, upper: {**ICEPOP, "rollout_is_threshold": upper, "rollout_is_threshold_lower": lower}),
    "decoupled_token_band_rs": Preset(
        "Two-sided token rejection (this package's ``icepop`` before IcePop meant the field's IcePop): decoupled "
        "PPO, no IS weight, a token with rho_t = pi_old / pi_rollout outside [lower, upper] leaves the loss and its "
        "token count. ``lower`` / ``upper``: the RS bounds.",
        dict(lower=0.5, upper=2.0),
        lambda lower, upper: dict(rollout_is=None, rollout_rs="token", rollout_rs_threshold=upper,
                                  rollout_rs_threshold_lower=lower)),
    "m2po": Preset(
        "M2PO's final algorithm (Zheng, Zhao & Chen, arXiv:2510.01161, ICLR 2026, Algorithm 1): decoupled PPO, no "
        "IS weight; among the tokens on the active side of PPO's trust region (A > 0 with rho > 1, A < 0 with "
        "rho < 1; rho = pi_old / pi_rollout) the largest (log rho)^2 get advantage 0 until the mean (log rho)^2 of "
        "the rest of them is <= tau; they stay in the loss's token count (the original denominator). ``tau``: the "
        "bound on the mean (log rho)^2.",
        dict(tau=0.04),
        lambda tau: dict(rollout_is=None, rollout_m2_threshold=tau, rollout_m2_scope="trust_region")),
    "dppo_tv_bypass": Preset(
        "DPPO-Binary-TV (Qi et al., arXiv:2602.04879; verl's ``dppo_tv`` loss with pi_old := pi_rollout): bypass "
        "policy gradient -stopgrad(min(pi_theta/pi_rollout, C)) A log pi_theta, with A set to 0 where A > 0 and "
        "pi_theta(a) - pi_rollout(a) > delta, or A < 0 and it is < -delta (the token kept in the count). "
        "``delta``: both bounds (0.15, verl's DPPO example); ``threshold``: C (1e4 there: no truncation).",
        dict(delta=0.15, threshold=1e4),
        lambda delta, threshold: dict(rollout_is="token", rollout_is_threshold=threshold, bypass_mode=True,
                                      use_policy_gradient=True, rollout_dppo="binary_tv",
                                      rollout_dppo_mask_low=delta, rollout_dppo_mask_high=delta)),
    "dppo_kl_bypass": Preset(
        "DPPO-Binary-KL (arXiv:2602.04879; verl's ``dppo_kl`` loss with pi_old := pi_rollout): as ``dppo_tv_bypass`` "
        "with D = KL(Bern(pi_rollout(a)) || Bern(pi_theta(a))) > delta masking A > 0 tokens whose probability rose "
        "and A < 0 tokens whose probability fell. ``delta``: both bounds (0.05, verl's DPPO example); "
        "``threshold``: C (1e4: no truncation).",
        dict(delta=0.05, threshold=1e4),
        lambda delta, threshold: dict(rollout_is="token", rollout_is_threshold=threshold, bypass_mode=True,
                                      use_policy_gradient=True, rollout_dppo="binary_kl",
                                      rollout_dppo_mask_low=delta, rollout_dppo_mask_high=delta)),
    "dppo_tv_prime_rl": Preset(
        "prime-rl's default loss's mask (DPPO-Binary-TV against the inference log-probs, ``dppo_mask_low`` = "
        "``dppo_mask_high`` = 0.2, no truncation): bypass policy gradient -(pi_theta/pi_rollout) A grad log "
        "pi_theta with A set to 0 where the probability moved past the bound in the advantage's direction. Without "
        "prime-rl's kl_tau (log ratio)^2 term (not in this package's loss). ``low`` / ``high``: the bounds.",
        dict(low=0.2, high=0.2),
        lambda low, high: dict(rollout_is="token", rollout_is_threshold=math.inf, bypass_mode=True,
                               use_policy_gradient=True, rollout_dppo="binary_tv", rollout_dppo_mask_low=low,
                               rollout_dppo_mask_high=high)),
    "decoupled_dppo_tv": Preset(
        "DPPO-Binary-TV as the policy loss between pi_theta and pi_old (verl's ``dppo_tv`` loss mode, arXiv:2602.04879)"
        " with token TIS on pi_old vs pi_rollout on top: -A (1 - masked) sg(min(pi_theta/pi_old, C_dppo)) "
        "sg(min(pi_old/pi_rollout, C)) log pi_theta, masked where A > 0 and pi_theta(a) - pi_old(a) > delta, or A < 0 "
        "and it is < -delta. ``delta``: both bounds (0.15, verl's DPPO example); ``threshold``: C of the IS weight "
        "(2.0, as ``decoupled_token_is``); ``clip_ratio_c``: C_dppo (1e4, verl's DPPO example).",
        dict(delta=0.15, threshold=2.0, clip_ratio_c=1e4),
        lambda delta, threshold, clip_ratio_c: dict(
            rollout_is="token", rollout_is_threshold=threshold, rollout_dppo="binary_tv", rollout_dppo_mask_low=delta,
            rollout_dppo_mask_high=delta, rollout_dppo_clip_ratio_c=clip_ratio_c)),
    "decoupled_dppo_kl": Preset(
        "DPPO-Binary-KL as the policy loss between pi_theta and pi_old (verl's ``dppo_kl`` loss mode) with token TIS "
        "on pi_old vs pi_rollout on top: as ``decoupled_dppo_tv`` with D = KL(Bern(pi_old(a)) || Bern(pi_theta(a))) "
        "> delta masking A > 0 tokens whose probability rose and A < 0 tokens whose probability fell. ``delta``: "
        "both bounds (0.05, verl's DPPO example); ``threshold``: C (2.0); ``clip_ratio_c``: C_dppo (1e4).",
        dict(delta=0.05, threshold=2.0, clip_ratio_c=1e4),
        lambda delta, threshold, clip_ratio_c: dict(
            rollout_is="token", rollout_is_threshold=threshold, rollout_dppo="binary_kl", rollout_dppo_mask_low=delta,
            rollout_dppo_mask_high=delta, rollout_dppo_clip_ratio_c=clip_ratio_c)),
    "trl_default": Preset(
        "TRL 1.16's own default correction (``vllm_importance_sampling_mode=\"sequence_mask\"``, ``clip_max=3``): "
        "decoupled PPO, w = prod_t rho_t * 1[prod_t rho_t <= C]; a sequence above C keeps its tokens in the "
        "loss's token count with weight 0. ``threshold``: C.",
        dict(threshold=3.0),
        lambda threshold: {**TRL_DEFAULT, "rollout_is_threshold": threshold}),
}
"""This package's presets, in the order ``preset_names()`` lists them (verl's follow)."""


def preset_fields(name: str, **arguments_and_overrides: Any) -> dict[str, Any]:
    """The fields of preset ``name``: its arguments (defaults where not given) turned into fields, then every other
    keyword as a field override.

    Args:
        name: a key of :data:`PRESETS`.
        **arguments_and_overrides: the preset's arguments and field overrides, e.g. ``threshold=3.0`` or
            ``rollout_is_batch_normalize=True``.

    Returns:
        The keyword arguments of ``RolloutCorrectionConfig``.
    """
    preset = PRESETS[name]
    arguments = {k: arguments_and_overrides.pop(k) for k in list(arguments_and_overrides) if k in preset.arguments}
    return {**preset.fields(**{**preset.arguments, **arguments}), **arguments_and_overrides}
