"""Independent float64 re-derivation of the correction's formulas, one sequence at a time, in plain Python.

Written from the formulas of the rollout-correction math document, not from the package code: loops and lists, no torch.
"""

import math

B = 20.0  # safety bound


def _clamp(x, lo, hi):
    return max(lo, min(hi, x))


def _mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def _pop_std(xs):
    if len(xs) <= 1:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def _unbiased_std(xs):
    if len(xs) <= 1:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def reference(old, rollout, mask, rollout_is=None, C=2.0, rollout_rs=None, rs_upper=None, rs_lower=None,
              veto=None, batch_normalize=False, seen=None, is_lower=None, is_bound="truncate"):
    """Return (weights or None, modified mask, metrics) as nested lists / dict of floats.

    IS bound: "truncate" w = clamp(rho, is_lower, C) (no lower clip when is_lower is None); "mask" w = rho if
    is_lower <= rho <= C else 0 (the token stays in the mask; counted in rollout_is_masked_fraction).

    ``seen[i]`` False: row i has no pi_rollout; it is left uncorrected (weight 1, kept) and out of every statistic.
    """
    n_rows, n_cols = len(old), len(old[0])
    seen = [True] * n_rows if seen is None else list(seen)
    rows = []  # per valid sequence: list of (t, log_ratio, lt, lr)
    invalid_toks = 0
    input_toks = sum(1 for i in range(n_rows) for t in range(n_cols) if mask[i][t])
    valid = [[False] * n_cols for _ in range(n_rows)]
    for i in range(n_rows):
        toks = [t for t in range(n_cols) if mask[i][t]]
        if not seen[i]:
            continue
        bad = [t for t in toks if not (math.isfinite(old[i][t]) and math.isfinite(rollout[i][t]))]
        invalid_toks += len(bad)
        if bad:
            continue
        for t in toks:
            valid[i][t] = True
    seqs = [i for i in range(n_rows) if any(valid[i])]
    lr_ = lambda i, t: old[i][t] - rollout[i][t]  # noqa: E731
    toks_of = {i: [t for t in range(n_cols) if valid[i][t]] for i in range(n_rows)}
    metrics = {}

    def family(prefix, level, value, seq_log, lower, upper):
        # value(i, t): safety-bounded statistic; seq_log(i): unclamped log statistic (sequence levels)
        all_vals = [value(i, t) for i in seqs for t in toks_of[i]]
        clamped = [_clamp(v, lower, upper) for v in all_vals]
        seq_means = [_mean([value(i, t) for t in toks_of[i]]) for i in seqs]
        m = {}
        m["mean"] = _mean(all_vals)
        m["std"] = _pop_std(clamped)
        if level == "token":
            m["min"] = min(all_vals) if all_vals else 0.0
            m["max"] = max(all_vals) if all_vals else 0.0
            m["ratio_fraction_high"] = _mean([1.0 if v > upper else 0.0 for v in all_vals])
            m["ratio_fraction_low"] = _mean([1.0 if v < lower else 0.0 for v in all_vals])
        else:
            logs = [seq_log(i) for i in seqs]
            m["min"] = math.exp(min(min(logs), B)) if logs else 0.0
            m["max"] = math.exp(min(max(logs), B)) if logs else 0.0
            m["ratio_fraction_high"] = _mean([1.0 if x > math.log(upper) else 0.0 for x in logs])
            m["ratio_fraction_low"] = _mean([1.0 if x < math.log(lower) else 0.0 for x in logs])
        mc = _mean(clamped)
        m["eff_sample_size"] = 1.0 / _mean([(c / (mc + 1e-8)) ** 2 for c in clamped]) if clamped else 0.0
        m["seq_mean"] = _mean(seq_means)
        m["seq_std"] = _unbiased_std(seq_means)
        m["seq_min"] = min(seq_means) if seq_means else 0.0
        m["seq_max"] = max(seq_means) if seq_means else 0.0
        m["seq_max_deviation"] = max(abs(s - 1) for s in seq_means) if seq_means else 0.0
        m["seq_fraction_high"] = _mean([1.0 if s > upper else 0.0 for s in seq_means])
        m["seq_fraction_low"] = _mean([1.0 if s < lower else 0.0 for s in seq_means])
        metrics.update({f"rollout_corr/{prefix}_{k}": v for k, v in m.items()})

    seq_sum = lambda i: sum(lr_(i, t) for t in toks_of[i])  # noqa: E731
    weights = None
    if rollout_is is not None:
        if rollout_is == "token":
            safe = lambda i, t: math.exp(_clamp(lr_(i, t), -B, B))  # noqa: E731
        else:
            safe = lambda i, t: math.exp(_clamp(seq_sum(i), -B, B))  # noqa: E731
        family("rollout_is", rollout_is, safe, seq_sum, 1.0 / C if is_lower is None else is_lower, C)
        low = 0.0 if is_lower is None else is_lower

        def bounded(v):
            if is_bound == "mask":
                return v if low <= v <= C else 0.0
            return min(max(v, low), C)

        weights = [[bounded(safe(i, t)) if valid[i][t] else 0.0 for t in range(n_cols)] for i in range(n_rows)]
        if is_bound == "mask":
            zeroed = [[valid[i][t] and weights[i][t] == 0.0 for t in range(n_cols)] for i in range(n_rows)]
            n_valid = sum(len(toks_of[i]) for i in seqs)
            metrics["rollout_corr/rollout_is_masked_fraction"] = (
                sum(map(sum, zeroed)) / n_valid if n_valid else 0.0)
            metrics["rollout_corr/rollout_is_seq_masked_fraction"] = (
                sum(any(row) for row in zeroed) / len(seqs) if seqs else 0.0)
        if batch_normalize:
            if rollout_is == "token":
                mean = _mean([weights[i][t] for i in seqs for t in toks_of[i]])
            else:
                mean = _mean([_mean([weights[i][t] for t in toks_of[i]]) for i in seqs])
            metrics["rollout_corr/rollout_is_batch_norm_factor"] = mean
            if mean > 1e-8:
                weights = [[w / mean for w in row] for row in weights]
        for i in range(n_rows):  # samples without pi_rollout: weight 1
            if not seen[i]:
                weights[i] = [1.0 if mask[i][t] else 0.0 for t in range(n_cols)]

    keep = [row[:] for row in valid]
    if rollout_rs is not None:
        lower = rs_lower if rs_lower is not None else 1.0 / rs_upper
        if rollout_rs == "token":
            log_stat = lambda i, t: lr_(i, t)  # noqa: E731
        elif rollout_rs == "sequence":
            log_stat = lambda i, t: seq_sum(i)  # noqa: E731
        else:
            log_stat = lambda i, t: seq_sum(i) / len(toks_of[i])  # noqa: E731
        value = lambda i, t: math.exp(_clamp(log_stat(i, t), -B, B))  # noqa: E731
        family("rollout_rs", rollout_rs, value, lambda i: log_stat(i, toks_of[i][0]), lower, rs_upper)
        rejected_toks, rejected_seqs = 0, 0
        for i in seqs:
            any_rej = False
            for t in toks_of[i]:
                if not (lower <= value(i, t) <= rs_upper):
                    keep[i][t] = False
                    rejected_toks += 1
                    any_rej = True
            rejected_seqs += any_rej
        n_tok = sum(len(toks_of[i]) for i in seqs)
        metrics["rollout_corr/rollout_rs_masked_fraction"] = rejected_toks / n_tok if n_tok else 0.0
        metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = rejected_seqs / len(seqs) if seqs else 0.0
    cat_toks, vetoed = 0, 0
    if veto is not None:
        for i in seqs:
            bad = [t for t in toks_of[i] if lr_(i, t) < math.log(veto)]
            cat_toks += len(bad)
            if bad:
                vetoed += 1
                keep[i] = [False] * n_cols
    n_tok = sum(len(toks_of[i]) for i in seqs)
    metrics["rollout_corr/rollout_is_veto_fraction"] = vetoed / len(seqs) if seqs else 0.0
    metrics["rollout_corr/rollout_is_catastrophic_token_fraction"] = cat_toks / n_tok if n_tok else 0.0
    metrics["rollout_corr/invalid_logprob_fraction"] = invalid_toks / input_toks if input_toks else 0.0
    for i in range(n_rows):  # samples without pi_rollout: nothing rejected
        if not seen[i]:
            keep[i] = [bool(mask[i][t]) for t in range(n_cols)]
    kept = sum(1 for i in range(n_rows) for t in range(n_cols) if keep[i][t])
    metrics["rollout_corr/rejected_token_fraction"] = (input_toks - kept) / input_toks if input_toks else 0.0
    rows = [i for i in range(n_rows) if any(mask[i])]
    metrics["rollout_corr/missing_rollout_logprobs_fraction"] = _mean([0.0 if seen[i] else 1.0 for i in rows])

    # off-policy diagnostics
    per_seq = []
    for i in seqs:
        lt = [old[i][t] for t in toks_of[i]]
        lr = [rollout[i][t] for t in toks_of[i]]
        per_seq.append((_mean(lt), _mean(lr), seq_sum(i),
                        [abs(math.exp(a) - math.exp(b)) for a, b in zip(lr, lt)]))
    tok_r = [lr_(i, t) for i in seqs for t in toks_of[i]]
    d = [mr - mt for mt, mr, _, _ in per_seq]
    o = {
        "training_ppl": _mean([math.exp(-mt) for mt, _, _, _ in per_seq]),
        "rollout_ppl": _mean([math.exp(-mr) for _, mr, _, _ in per_seq]),
        "training_log_ppl": _mean([-mt for mt, _, _, _ in per_seq]),
        "rollout_log_ppl": _mean([-mr for _, mr, _, _ in per_seq]),
        "log_ppl_diff": _mean(d),
        "log_ppl_abs_diff": _mean([abs(x) for x in d]),
        "log_ppl_diff_max": max(d) if d else 0.0,
        "log_ppl_diff_min": min(d) if d else 0.0,
        "ppl_ratio": _mean([math.exp(x) for x in d]),
        "kl": _mean([-r for r in tok_r]),
        "k3_kl": _mean([math.exp(_clamp(r, -B, B)) - _clamp(r, -B, B) - 1 for r in tok_r]),
        "chi2_token": _mean([math.exp(2 * _clamp(r, -B, B)) - 1 for r in tok_r]),
        "chi2_seq": _mean([math.exp(2 * _clamp(s, -B, B)) - 1 for _, _, s, _ in per_seq]),
        "max_prob_diff": _mean([max(p) for *_, p in per_seq]),
        "max_prob_diff_max": max([max(p) for *_, p in per_seq]) if per_seq else 0.0,
        "mean_prob_diff": _mean([_mean(p) for *_, p in per_seq]),
    }
    metrics.update({f"rollout_corr/{k}": v for k, v in o.items()})

    # "does it hurt?": T*KL = sum of k3 over a sequence's valid tokens; k3 per completion-length bucket (T = its valid
    # tokens; a bucket without a sequence is not reported)
    t_kl = [sum(math.exp(_clamp(lr_(i, t), -B, B)) - _clamp(lr_(i, t), -B, B) - 1 for t in toks_of[i]) for i in seqs]
    metrics["rollout_corr/t_kl_mean"] = _mean(t_kl)
    metrics["rollout_corr/t_kl_max"] = max(t_kl) if t_kl else 0.0
    metrics["rollout_corr/t_kl_above_1_fraction"] = _mean([1.0 if x > 1 else 0.0 for x in t_kl])
    for lo, hi, name in ((0, 63, "0_63"), (64, 255, "64_255"), (256, 1023, "256_1023"), (1024, 4095, "1024_4095"),
                         (4096, math.inf, "ge_4096")):
        members = [j for j, i in enumerate(seqs) if lo <= len(toks_of[i]) <= hi]
        tokens = sum(len(toks_of[seqs[j]]) for j in members)
        if tokens:
            metrics[f"rollout_corr/k3_kl_len_{name}"] = sum(t_kl[j] for j in members) / tokens
    return weights, [[1.0 if k else 0.0 for k in row] for row in keep], metrics
