"""How far the engine is from the trainer, measured on sampled tokens: the pre-flight probe's numbers.

Notation as in the rest of the core: for sequence i and token t sampled by the engine,
``log rho_t = log pi_train(a_t) - log pi_rollout(a_t)`` (pi_train: the trainer's forward on the same tokens).
The tokens are drawn from pi_rollout, so

* k1_t = -log rho_t and k3_t = rho_t - 1 - log rho_t are the usual unbiased (k1) and non-negative (k3) per-token
  estimators of KL(pi_rollout || pi_train) (Schulman, "Approximating KL divergence", 2020);
* a sequence's log-weight is sum_t log rho_t; with T tokens at per-token KL kappa it is roughly normal with variance
  ~2 T kappa under a small mismatch, so the effective sample size of sequence-level weights falls like
  exp(-2 T kappa) (Kong 1992's ESS of log-normal weights): T*KL, not KL alone, decides whether sequence-level
  corrections still see a batch (see docs/evidence.md, "Estimator map").

Uncertainty: the sequences are the independent units (the tokens of one sequence share its prompt and its prefix, so
they are not independent). With K_i = sum_t k_t and T_i the token count of sequence i (i = 1..S), the per-token KL is
the ratio of means R = sum_i K_i / sum_i T_i, and its standard error the delta method's for a ratio of means,
SE(R) = sqrt(sum_i (K_i - R T_i)^2 / (S (S - 1))) / mean_i T_i (:func:`ratio_se`); T*KL is the mean of K_i (the same
ratio with every T_i taken as 1), SE = sd_i(K_i) / sqrt(S). Both are large-sample (S >= ~30) approximations;
tests/cli/test_probe_uncertainty.py checks them against repeated draws from an engine whose exact KL is known.

Everything here is a pure function of (B, T) tensors and returns Python floats: it runs once per probe, not in the
training step, so the host syncs it makes do not matter.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .impact import LENGTH_BUCKETS  # the report's buckets are the training metrics' (re-exported)
from .pipeline import compute_rollout_correction_stats
from .metrics import finalize_stats
from .params import CorrectionParams
from .stats import safe_div

#: a token with pi_train below this is "low-probability" (the tail where Liu et al. locate most of the mismatch)
LOW_PROB = 1e-3
_QUANTILES = (0.001, 0.01, 0.1, 0.5, 0.9, 0.99, 0.999)
#: what the report keeps of each method's metrics (the rest is in the trainer's logs)
METHOD_METRICS = ("rollout_is_eff_sample_size", "rollout_is_seq_min", "rollout_is_seq_max", "rollout_is_min",
                  "rollout_is_max", "rollout_is_ratio_fraction_high", "rollout_is_masked_fraction",
                  "rollout_is_seq_masked_fraction", "rejected_token_fraction", "rollout_rs_seq_masked_fraction",
                  "rollout_m2_masked_fraction")


def _quantiles(x: torch.Tensor) -> dict[str, float]:
    if x.numel() == 0:
        return {f"q{q:g}": float("nan") for q in _QUANTILES}
    qs = torch.quantile(x.double(), torch.tensor(_QUANTILES, dtype=torch.float64))  # (Q,)
    return {f"q{q:g}": float(v) for q, v in zip(_QUANTILES, qs.tolist())}


def ratio_se(numerators: torch.Tensor, denominators: torch.Tensor) -> float:
    """The delta-method standard error of R = sum_i x_i / sum_i y_i over independent units i (here: sequences).

    SE(R) = sqrt(sum_i (x_i - R y_i)^2 / (S (S - 1))) / mean_i(y_i), S the number of units (Cochran, "Sampling
    Techniques", 1977, section 6.4, without the finite-population factor). NaN with fewer than 2 units.

    Args:
        numerators: (S,) x_i, e.g. sum_t k3_t of sequence i.
        denominators: (S,) y_i > 0 in total, e.g. the token count T_i of sequence i.
    """
    s = int(numerators.numel())
    if s < 2 or float(denominators.sum()) <= 0:
        return float("nan")
    x, y = numerators.double(), denominators.double()  # (S,), (S,)
    r = x.sum() / y.sum()
    residual = x - r * y  # (S,)
    return float(torch.sqrt((residual**2).sum() / (s * (s - 1))) / y.mean())


def bucket_label(lower: int, upper: int | None) -> str:
    return f"{lower}-{upper - 1}" if upper is not None else f">={lower}"


def mismatch_summary(train_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor,
                     buckets: Iterable[int] = LENGTH_BUCKETS, low_prob: float = LOW_PROB) -> dict[str, Any]:
    """Per-token and per-sequence mismatch of pi_rollout against pi_train on the sampled tokens.

    Args:
        train_logps: (B, T) log pi_train(a_t), the trainer's forward.
        rollout_logps: (B, T) log pi_rollout(a_t), the engine's processed log-probs.
        mask: (B, T) 1 on completion tokens (padding and tool output 0). Rows with a non-finite log-prob on one of
            their tokens are left out and counted in ``invalid_sequences``.
        buckets: the completion-length bucket edges.
        low_prob: the pi_train below which a token counts as low-probability.

    Returns:
        ``tokens``: count, mean log rho, k1 and k3 (per-token KL estimates) and their standard errors ``k1_se``,
        ``k3_se`` (sequences as units, :func:`ratio_se`), max |log rho|, quantiles of log rho,
        ``low_prob_share_of_k3`` and ``low_prob_token_fraction``; ``sequences``: count, mean length T, mean
        (``t_kl_mean``, its standard error ``t_kl_se``) and quantiles of T*KL (sum_t k3_t per sequence), the per-token
        k3 of these sequences and its standard error, variance of sum_t log rho_t, the measured effective sample size
        of sequence weights rho_seq = exp(sum_t log rho_t) and its log-normal prediction exp(-Var(sum log rho));
        ``by_length``: the same per length bucket.
    """
    if train_logps.shape != rollout_logps.shape or train_logps.shape != mask.shape:
        raise ValueError(f"train_logps {tuple(train_logps.shape)}, rollout_logps {tuple(rollout_logps.shape)} and "
                         f"mask {tuple(mask.shape)} must have the same (B, T) shape.")
    train = train_logps.detach().double()  # (B, T)
    rollout = rollout_logps.detach().double()  # (B, T)
    m = mask.bool()  # (B, T)
    finite = torch.isfinite(train) & torch.isfinite(rollout)  # (B, T)
    valid_rows = ~(m & ~finite).any(1) & m.any(1)  # (B,)
    m = m & valid_rows[:, None]  # (B, T)
    log_rho = torch.where(m, train - rollout, torch.zeros_like(train))  # (B, T)
    k3 = torch.where(m, torch.expm1(log_rho) - log_rho, torch.zeros_like(train))  # (B, T)
    lengths = m.sum(1)  # (B,)
    report: dict[str, Any] = {
        "invalid_sequences": int((mask.bool().any(1) & ~valid_rows).sum()),
        "tokens": _token_summary(log_rho, k3, train, m, low_prob, valid_rows),
        "sequences": _sequence_summary(log_rho[valid_rows], k3[valid_rows], lengths[valid_rows]),
        "by_length": {},
    }
    edges = [0, *buckets]
    for lower, upper in zip(edges, [*edges[1:], None]):
        rows = valid_rows & (lengths >= lower) & (lengths < upper if upper is not None else True)  # (B,)
        if rows.any():
            summary = _sequence_summary(log_rho[rows], k3[rows], lengths[rows])
            summary["k3"] = summary.pop("k3_per_token")
            summary["k3_se"] = summary.pop("k3_per_token_se")
            report["by_length"][bucket_label(lower, upper)] = summary
    return report


def _token_summary(log_rho, k3, train, m, low_prob, rows) -> dict[str, Any]:
    """log_rho, k3, train, m: (B, T), zero off the mask; rows: (B,) the valid sequences (the SEs' units)."""
    n = int(m.sum())
    lengths = m[rows].sum(1)  # (S,) T_i
    values = log_rho[m]  # (N,)
    low = m & (train < math.log(low_prob))  # (B, T)
    k3_total = float(k3.sum())
    return {
        "count": n,
        "mean_log_rho": float(values.mean()) if n else float("nan"),
        "k1": float(-values.mean()) if n else float("nan"),
        "k3": safe_div(k3_total, n, float("nan")),
        "k1_se": ratio_se(-log_rho[rows].sum(1), lengths),  # sum_t k1_t = -sum_t log rho_t per sequence
        "k3_se": ratio_se(k3[rows].sum(1), lengths),
        "max_abs_log_rho": float(values.abs().max()) if n else float("nan"),
        "log_rho_quantiles": _quantiles(values),
        "low_prob_token_fraction": safe_div(float(low.sum()), n, float("nan")),
        "low_prob_share_of_k3": safe_div(float(k3[low].sum()), k3_total),
    }


def _sequence_summary(log_rho: torch.Tensor, k3: torch.Tensor, lengths: torch.Tensor) -> dict[str, Any]:
    """log_rho, k3: (S, T) of valid rows, zero off the mask; lengths: (S,)."""
    s = int(lengths.numel())
    if s == 0:
        return {"count": 0}
    seq_log_w = log_rho.sum(1)  # (S,) log rho_seq
    t_kl = k3.sum(1)  # (S,) T*KL per sequence
    w = torch.exp(seq_log_w - seq_log_w.max())  # (S,) rho_seq up to a constant (ESS is scale-free)
    ess = float(w.sum() ** 2 / (s * (w**2).sum()))
    var = float(seq_log_w.var(unbiased=True)) if s > 1 else 0.0
    return {
        "count": s,
        "mean_length": float(lengths.double().mean()),
        "k3_per_token": float(k3.sum() / lengths.sum()),
        "k3_per_token_se": ratio_se(t_kl, lengths),
        "t_kl_mean": float(t_kl.mean()),
        "t_kl_se": float(t_kl.std(unbiased=True) / math.sqrt(s)) if s > 1 else float("nan"),
        "t_kl_quantiles": _quantiles(t_kl),
        "seq_log_rho_var": var,
        "seq_ess": ess,
        "seq_ess_lognormal": math.exp(-var),
    }


def method_predictions(train_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor,
                       corrections: Mapping[str, CorrectionParams],
                       advantages: torch.Tensor | None = None) -> dict[str, dict[str, float]]:
    """Each correction's weights, masks and ESS on these very samples (the core run on the probe's tensors).

    pi_train here is the policy the samples were scored with, so a decoupled correction sees what its first
    optimizer step would see, and a bypass one what its loss would see before the policy moves. ``advantages``
    (B,) or (B, T): the group advantages A the trainer passes too (M2PO's trust region, ``rollout_m2_scope=
    'trust_region'``, keeps tokens by the sign of A; a correction that reads them cannot be predicted without).

    Returns:
        ``{name: {metric: value}}`` with the metrics of :data:`METHOD_METRICS` the correction emits (without the
        ``rollout_corr/`` prefix; ``rollout_is_min``/``max`` are of rho before truncation), plus ``weight_min``,
        ``weight_max`` and ``weight_zero_fraction`` of the weights the loss applies on the tokens it keeps.
    """
    out = {}
    for name, params in corrections.items():
        result = compute_rollout_correction_stats(train_logps.detach().float(), rollout_logps.detach().float(),
                                                  mask, params, advantages=advantages)
        metrics = finalize_stats(result.stats)
        short = {k.split("/", 1)[1]: v for k, v in metrics.items()}
        out[name] = {k: short[k] for k in METHOD_METRICS if k in short}
        kept = mask.bool() & result.modified_response_mask.bool()  # (B, T)
        if result.is_weights is not None and kept.any():  # the weights the loss applies, on the tokens it keeps
            applied = result.is_weights[kept]  # (N,)
            out[name]["weight_min"], out[name]["weight_max"] = float(applied.min()), float(applied.max())
            out[name]["weight_zero_fraction"] = float((applied == 0).double().mean())
    return out


def mismatch_by_source(train_logps: torch.Tensor, ratio_logps: torch.Tensor, rollout_logps: torch.Tensor,
                       mask: torch.Tensor, engine_dtype_logps: torch.Tensor | None = None,
                       reshaped_logps: torch.Tensor | None = None) -> dict[str, Any]:
    """The mismatch after truncation, split by the source re-scoring can isolate (the probe's ``sources``).

    With log rho = log pi_train^C - log pi_rollout (``ratio_logps``: pi_train renormalized over a truncating
    sampler's kept set C where the trainer does so) on tokens sampled from pi_rollout, each part is the k3 of a
    per-token log-ratio on the same tokens:

    * precision: delta_p = log pi_train - log pi_train@dtype, pi_train@dtype the trainer's forward re-run in the
      engine's dtype (``engine_dtype_logps``): the mismatch the dtype alone explains;
    * batch shape: delta_b = log pi_train - log pi_train@shape, the same samples re-scored by the trainer in another
      batch composition (``reshaped_logps``);
    * remainder: log rho - delta_p = log pi_train@dtype^C - log pi_rollout, what a trainer computing in the engine's
      dtype would still see (kernels, the engine's own batch composition, quantization, staleness, ...).

    k3 = rho - 1 - log rho (Schulman 2020) is ~(log rho)^2 / 2 for a small mismatch, so the k3 of independent small
    parts add approximately: the shares need not sum to 1 exactly. A part whose re-scoring is absent is None.

    Args:
        train_logps: (B, T) log pi_train, the trainer's forward (before any renormalization).
        ratio_logps: (B, T) what the trainer's ratio uses (``train_logps`` renormalized, or itself).
        rollout_logps: (B, T) log pi_rollout.
        mask: (B, T) completion tokens of samples with engine log-probs.
        engine_dtype_logps, reshaped_logps: (B, T) the re-scorings, or None.

    Returns:
        ``total``, ``precision``, ``batch_shape``, ``remainder``: each ``{"k3", "k1", "max_abs_log_rho",
        "share_of_k3"}`` (k3 over the total k3 of log rho), or None.
    """
    def part(first: torch.Tensor, second: torch.Tensor, total_k3: float | None) -> dict[str, float]:
        tokens = mismatch_summary(first, second, mask)["tokens"]
        out = {k: tokens[k] for k in ("k3", "k1", "max_abs_log_rho")}
        if total_k3 is not None:
            out["share_of_k3"] = safe_div(out["k3"], total_k3, float("nan"))
        return out

    total = part(ratio_logps, rollout_logps, None)
    total["share_of_k3"] = 1.0
    report: dict[str, Any] = {"total": total, "precision": None, "batch_shape": None, "remainder": None}
    if engine_dtype_logps is not None:
        report["precision"] = part(train_logps, engine_dtype_logps, total["k3"])
        delta_p = train_logps.double() - engine_dtype_logps.double()  # (B, T)
        report["remainder"] = part(ratio_logps.double() - delta_p, rollout_logps, total["k3"])  # (B, T)
    if reshaped_logps is not None:
        report["batch_shape"] = part(train_logps, reshaped_logps, total["k3"])
    return report
