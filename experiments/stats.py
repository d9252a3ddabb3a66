"""Statistics of a paired benchmark: every method runs on the same seeds, so each seed gives one paired difference.

Used by ``experiments/mismatch_bench.py``, ``experiments/async_staleness.py`` and the new training benchmark. Tested
against hand-computed values in ``tests/experiments/test_stats.py``. All functions take plain sequences of floats (one
value per seed, the same seed order in every argument) and return plain floats, named tuples or dicts.

* :func:`paired_t`: mean paired difference, its t-interval and two-sided p.
* :func:`sign_flip_p`: the exact two-sided sign-flip permutation p-value (all ``2**n`` sign patterns for n <= 20;
  Monte Carlo with a stated seed beyond). With n seeds its smallest possible value is ``2 / 2**n`` (n = 5: 0.0625,
  so 5 seeds can never reach p < 0.05 with it).
* :func:`sign_flip_p_one_sided`: the exact one-sided sign-flip p (the held-out confirmations of pre-registration 25).
* :func:`holm`: Holm's step-down family-wise adjustment of a family of p-values.
* :func:`tost_paired`: two one-sided tests of equivalence within ``±margin`` and the matching 90% interval.
* :func:`fieller` / :func:`fieller_ratio`: Fieller's interval for the paired "gap closed" ratio
  ``(m - u) / (o - u)``, unbounded (``-inf, inf``, said in ``note``) when the denominator is not significant.
* :func:`bca_ratio`: a paired BCa bootstrap interval for the same ratio (seeds resampled jointly across rows).
* :func:`fisher_exact`: Fisher's exact test on a 2x2 table of counts (e.g. collapsed / not collapsed runs).
* :func:`clopper_pearson`: the exact interval of a proportion k / n (e.g. an alarm's sensitivity).
* :func:`compare_paired`: one comparison as a row dict (the benchmarks' tables); :func:`add_holm` adjusts a family
  of such rows.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from scipy import stats as _st

EXACT_MAX_N = 20  # sign_flip_p enumerates all 2**n sign patterns up to this many pairs
MC_DRAWS = 200_000  # sign_flip_p's Monte-Carlo draws beyond EXACT_MAX_N
MC_SEED = 20261126  # ... and their seed


def _array(x, name: str) -> np.ndarray:
    a = np.asarray(x, dtype=float).ravel()
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} has a non-finite value: {a.tolist()}")
    return a


def _pair(a, b) -> np.ndarray:
    a, b = _array(a, "a"), _array(b, "b")
    if a.shape != b.shape:
        raise ValueError(f"paired samples must have the same length (one value per seed): {a.size} vs {b.size}")
    return a - b


class PairedT(NamedTuple):
    """Result of :func:`paired_t` (differences ``a - b``)."""

    n: int
    mean: float  # mean of the differences
    sd: float  # their standard deviation (ddof 1)
    lo: float  # the ``conf`` t-interval of the mean difference
    hi: float
    t: float
    p: float  # two-sided


def paired_t(a, b, conf: float = 0.95) -> PairedT:
    """Paired t-test of ``a - b`` (``a[i]`` and ``b[i]`` from the same seed): mean difference, its two-sided ``conf``
    t-interval (``mean ± t_{n-1, (1+conf)/2} * sd / sqrt(n)``) and the two-sided p of ``mean == 0``.

    If every difference is equal (sd 0) the interval is the point and p is 1 when the mean is 0, else 0."""
    d = _pair(a, b)
    n = d.size
    if n < 2:
        raise ValueError(f"paired_t needs at least 2 pairs, got {n}")
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    se = sd / math.sqrt(n)
    if se == 0:
        return PairedT(n, mean, sd, mean, mean, math.copysign(math.inf, mean) if mean else 0.0,
                       1.0 if mean == 0 else 0.0)
    t = mean / se
    half = float(_st.t.ppf((1 + conf) / 2, n - 1)) * se
    return PairedT(n, mean, sd, mean - half, mean + half, t, float(2 * _st.t.sf(abs(t), n - 1)))


def sign_flip_p(diffs, n_mc: int = MC_DRAWS, seed: int = MC_SEED) -> float:
    """Two-sided sign-flip permutation p-value of paired differences: under "no difference" each difference's sign is
    a fair coin, so p = #{sign patterns s : |mean(s * d)| >= |mean(d)|} / 2**n, the observed pattern included.

    Exact (every pattern enumerated) for n <= ``EXACT_MAX_N`` (20); beyond, ``n_mc`` random patterns drawn with
    ``numpy.random.default_rng(seed)`` and p = (1 + #{|mean*| >= |mean|}) / (1 + n_mc). Ties are counted with a
    relative tolerance of 1e-9 (sums of the same numbers in another order)."""
    d = _array(diffs, "diffs")
    n = d.size
    if n == 0:
        raise ValueError("sign_flip_p needs at least one difference")
    observed = abs(float(d.sum()))
    tol = 1e-9 * float(np.abs(d).sum())
    if n <= EXACT_MAX_N:
        sums = np.zeros(1)
        for x in d:  # every signed sum: 2**n of them, built by doubling
            sums = np.concatenate((sums + x, sums - x))
        return float(np.count_nonzero(np.abs(sums) >= observed - tol)) / sums.size
    rng = np.random.default_rng(seed)
    hits = 0
    for start in range(0, n_mc, 10_000):
        signs = rng.choice((-1.0, 1.0), size=(min(10_000, n_mc - start), n))
        hits += int(np.count_nonzero(np.abs(signs @ d) >= observed - tol))
    return (1 + hits) / (1 + n_mc)


def sign_flip_p_one_sided(diffs) -> float:
    """One-sided exact sign-flip p of "mean(diffs) > 0": p = #{sign patterns s : sum(s * d) >= sum(d)} / 2**n, the
    observed pattern included (ties within a relative 1e-9). For n <= ``EXACT_MAX_N`` only (a held-out set is
    small); with 10 positive differences it is 1 / 1024."""
    d = _array(diffs, "diffs")
    n = d.size
    if n == 0 or n > EXACT_MAX_N:
        raise ValueError(f"sign_flip_p_one_sided enumerates 2**n patterns: 1 <= n <= {EXACT_MAX_N}, got {n}")
    observed = float(d.sum())
    tol = 1e-9 * float(np.abs(d).sum())
    sums = np.zeros(1)
    for x in d:
        sums = np.concatenate((sums + x, sums - x))
    return float(np.count_nonzero(sums >= observed - tol)) / sums.size


def holm(pvals) -> list[float]:
    """Holm's step-down adjusted p-values, in the input's order: sort ascending p_(1) <= ... <= p_(m); the adjusted
    p_(i) is max over j <= i of min(1, (m - j + 1) * p_(j)) (monotone, capped at 1). A hypothesis is rejected at
    family-wise level alpha when its adjusted p < alpha."""
    p = _array(pvals, "pvals")
    if np.any((p < 0) | (p > 1)):
        raise ValueError(f"p-values must lie in [0, 1]: {p.tolist()}")
    m = p.size
    order = np.argsort(p, kind="stable")
    adjusted = np.minimum(1.0, (m - np.arange(m)) * p[order])
    adjusted = np.maximum.accumulate(adjusted)
    out = np.empty(m)
    out[order] = adjusted
    return out.tolist()


class Tost(NamedTuple):
    """Result of :func:`tost_paired`: equivalent at level ``alpha`` iff ``p < alpha`` iff (lo, hi) is inside
    (-margin, margin)."""

    n: int
    mean: float
    p: float  # max of the two one-sided p's
    p_lower: float  # H0: mean <= -margin
    p_upper: float  # H0: mean >= +margin
    lo: float  # the 1 - 2 * alpha (default 90%) t-interval
    hi: float
    margin: float


def tost_paired(diffs, margin: float, alpha: float = 0.05) -> Tost:
    """Two one-sided paired t-tests of equivalence, |mean difference| < ``margin``: t_lower = (mean + margin) / se
    against H0 mean <= -margin (p_lower = P(T_{n-1} >= t_lower)), t_upper = (mean - margin) / se against H0
    mean >= margin (p_upper = P(T_{n-1} <= t_upper)); p = max(p_lower, p_upper). Returned with the ``1 - 2 alpha``
    t-interval (90% at alpha 0.05), which lies inside (-margin, margin) exactly when p < alpha."""
    if not margin > 0:
        raise ValueError(f"tost_paired's margin must be > 0, got {margin}")
    d = _array(diffs, "diffs")
    n = d.size
    if n < 2:
        raise ValueError(f"tost_paired needs at least 2 pairs, got {n}")
    mean, se = float(d.mean()), float(d.std(ddof=1)) / math.sqrt(n)
    if se == 0:
        inside = abs(mean) < margin
        p_lower, p_upper = (0.0 if mean > -margin else 1.0), (0.0 if mean < margin else 1.0)
        return Tost(n, mean, 0.0 if inside else 1.0, p_lower, p_upper, mean, mean, margin)
    p_lower = float(_st.t.sf((mean + margin) / se, n - 1))
    p_upper = float(_st.t.cdf((mean - margin) / se, n - 1))
    half = float(_st.t.ppf(1 - alpha, n - 1)) * se
    return Tost(n, mean, max(p_lower, p_upper), p_lower, p_upper, mean - half, mean + half, margin)


class Ratio(NamedTuple):
    """A ratio of two mean paired quantities and its interval; ``bounded`` False (lo -inf, hi inf) when the data do
    not bound it, with the reason in ``note``."""

    estimate: float
    lo: float
    hi: float
    bounded: bool
    note: str


UNBOUNDED = ("unbounded: the denominator (on-policy - uncorrected) is not significantly different from 0 "
             "at this level, so any ratio is consistent with the data")


def fieller_ratio(num, den, conf: float = 0.95) -> Ratio:
    """Fieller's interval for mean(num) / mean(den), ``num[i]`` and ``den[i]`` from the same seed (their covariance
    is used). With x, y the means, v11, v22, v12 the variances and covariance of the means (sample (co)variances / n)
    and t = t_{n-1, (1+conf)/2}, the interval is {R : (x - R y)^2 <= t^2 (v11 - 2 R v12 + R^2 v22)}, i.e. the roots
    of a R^2 + b R + c = 0 with a = y^2 - t^2 v22, b = -2 (x y - t^2 v12), c = x^2 - t^2 v11. It is a bounded
    interval only when a > 0, i.e. when the denominator is significant at ``conf`` (|y| / sqrt(v22) > t); otherwise
    the set is unbounded and (-inf, inf) is returned with ``bounded`` False."""
    x_, y_ = _array(num, "num"), _array(den, "den")
    if x_.shape != y_.shape:
        raise ValueError(f"num and den must be paired (same length): {x_.size} vs {y_.size}")
    n = x_.size
    if n < 2:
        raise ValueError(f"fieller needs at least 2 pairs, got {n}")
    x, y = float(x_.mean()), float(y_.mean())
    cov = np.cov(np.vstack((x_, y_)), ddof=1) / n
    v11, v22, v12 = float(cov[0, 0]), float(cov[1, 1]), float(cov[0, 1])
    t2 = float(_st.t.ppf((1 + conf) / 2, n - 1)) ** 2
    estimate = x / y if y != 0 else math.nan
    a = y * y - t2 * v22
    b = -2 * (x * y - t2 * v12)
    c = x * x - t2 * v11
    if a <= 0:
        return Ratio(estimate, -math.inf, math.inf, False, UNBOUNDED)
    disc = b * b - 4 * a * c
    root = math.sqrt(max(disc, 0.0))
    return Ratio(estimate, (-b - root) / (2 * a), (-b + root) / (2 * a), True, "")


def fieller(method, floor, ceiling, conf: float = 0.95) -> Ratio:
    """Fieller's ``conf`` interval of the paired gap closed (m - u) / (o - u): ``method`` m, ``floor`` u (no
    correction) and ``ceiling`` o (on-policy), one value per seed, same seed order. See :func:`fieller_ratio`."""
    m, u, o = _array(method, "method"), _array(floor, "floor"), _array(ceiling, "ceiling")
    if not m.shape == u.shape == o.shape:
        raise ValueError(f"method, floor and ceiling must be paired (same length): {m.size}, {u.size}, {o.size}")
    return fieller_ratio(m - u, o - u, conf)


def _gap_ratio(m: np.ndarray, u: np.ndarray, o: np.ndarray) -> float:
    den = float(o.mean() - u.mean())
    return float(m.mean() - u.mean()) / den if den != 0 else math.nan


def bca_ratio(method, floor, ceiling, conf: float = 0.95, n_boot: int = 4000, seed: int = 0) -> Ratio:
    """Paired BCa bootstrap interval of the gap closed (m - u) / (o - u): seeds are resampled jointly (one index set
    for all three rows), ``n_boot`` draws from ``numpy.random.default_rng(seed)``; the percentiles are moved by the
    bias correction z0 = Phi^-1(share of draws below the estimate) and the jackknife acceleration
    a = sum(d^3) / (6 sum(d^2)^1.5), d = mean(jackknife) - jackknife_i (Efron 1987). Draws with a zero denominator are
    dropped. With n seeds there are only C(2n-1, n) distinct resamples (126 at n = 5), and even BCa undercovers at
    such n: read it as a rough interval. Unbounded (with a note) when the denominator's own paired t-test is not
    significant at ``conf``, as :func:`fieller`."""
    m, u, o = _array(method, "method"), _array(floor, "floor"), _array(ceiling, "ceiling")
    if not m.shape == u.shape == o.shape:
        raise ValueError(f"method, floor and ceiling must be paired (same length): {m.size}, {u.size}, {o.size}")
    n = m.size
    if n < 3:
        raise ValueError(f"bca_ratio needs at least 3 seeds, got {n}")
    estimate = _gap_ratio(m, u, o)
    gap = paired_t(o, u, conf)
    if not (gap.lo > 0 or gap.hi < 0):
        return Ratio(estimate, -math.inf, math.inf, False, UNBOUNDED)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_boot, n))
    mm, uu, oo = m[idx].mean(axis=1), u[idx].mean(axis=1), o[idx].mean(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        draws = (mm - uu) / (oo - uu)
    draws = draws[np.isfinite(draws)]
    keep = np.ones(n, dtype=bool)
    jack = []
    for i in range(n):
        keep[:] = True
        keep[i] = False
        jack.append(_gap_ratio(m[keep], u[keep], o[keep]))
    jack = np.asarray(jack)
    d = jack.mean() - jack
    denom = 6 * float((d ** 2).sum()) ** 1.5
    accel = float((d ** 3).sum()) / denom if denom > 0 else 0.0
    below = (np.count_nonzero(draws < estimate) + 0.5 * np.count_nonzero(draws == estimate)) / draws.size
    z0 = float(_st.norm.ppf(min(max(below, 1 / (2 * draws.size)), 1 - 1 / (2 * draws.size))))
    ends = []
    for q in ((1 - conf) / 2, (1 + conf) / 2):
        z = float(_st.norm.ppf(q))
        ends.append(float(np.quantile(draws, _st.norm.cdf(z0 + (z0 + z) / (1 - accel * (z0 + z))))))
    return Ratio(estimate, ends[0], ends[1], True, f"paired BCa bootstrap, {draws.size} draws, seed {seed}")


class Fisher(NamedTuple):
    odds_ratio: float
    p: float


def fisher_exact(table, alternative: str = "two-sided") -> Fisher:
    """Fisher's exact test of a 2x2 table of counts ``[[a_yes, a_no], [b_yes, b_no]]`` (e.g. collapsed and healthy
    runs of method a and of method b): the sample odds ratio (a_yes * b_no) / (a_no * b_yes) and the p-value from the
    hypergeometric distribution of a_yes given the margins (two-sided: the sum of the probabilities of every table
    no more likely than the observed one). ``scipy.stats.fisher_exact``."""
    t = np.asarray(table)
    if t.shape != (2, 2) or np.any(t < 0) or np.any(t != np.round(t)):
        raise ValueError(f"fisher_exact needs a 2x2 table of non-negative counts, got {t.tolist()}")
    res = _st.fisher_exact(t.astype(int), alternative=alternative)
    return Fisher(float(res[0]), float(res[1]))


def clopper_pearson(k: int, n: int, conf: float = 0.95) -> tuple[float, float]:
    """The exact (Clopper-Pearson) ``conf`` interval of a binomial proportion k / n: the beta quantiles
    ``Beta(a/2; k, n - k + 1)`` and ``Beta(1 - a/2; k + 1, n - k)`` (0 and 1 at the ends), valid at any n
    (e.g. 0 of 10: [0, 1 - 0.025^(1/10)] = [0, 0.308])."""
    if not (isinstance(k, int) and isinstance(n, int)) or n < 1 or not 0 <= k <= n:
        raise ValueError(f"clopper_pearson needs integers 0 <= k <= n, n >= 1, got k={k!r}, n={n!r}")
    a = 1.0 - conf
    lo = 0.0 if k == 0 else float(_st.beta.ppf(a / 2, k, n - k + 1))
    hi = 1.0 if k == n else float(_st.beta.ppf(1 - a / 2, k + 1, n - k))
    return lo, hi


def compare_paired(x, ref, *, floor=None, ceiling=None, margin: float | None = None, conf: float = 0.95) -> dict:
    """One paired comparison of ``x`` against ``ref`` (one value per seed, same seeds), as a row dict:

    * ``n``, ``mean``, ``ref_mean``; ``diff`` = mean(x - ref), ``diff_lo`` / ``diff_hi`` its ``conf`` paired
      t-interval, ``p`` its paired-t p, ``p_sign_flip`` the exact sign-flip p (both unadjusted: :func:`add_holm`
      adjusts a family of rows);
    * with ``margin``: ``tost_p``, ``tost_lo``, ``tost_hi`` (equivalence within ±margin, 90% interval);
    * with ``floor`` (uncorrected) and ``ceiling`` (on-policy): ``gap`` = mean(ceiling - floor), ``gap_p`` its
      paired-t p, and the gap closed by ``x`` (m - u) / (o - u) with its Fieller interval ``gap_closed``,
      ``gap_closed_lo``, ``gap_closed_hi`` — all NaN when the gap is not significant at ``conf`` (then
      ``gap_closed_note`` says so), since the ratio is then undefined."""
    d = _pair(x, ref)
    t = paired_t(x, ref, conf)
    row = dict(n=t.n, mean=float(np.mean(x)), ref_mean=float(np.mean(ref)), diff=t.mean, diff_lo=t.lo,
               diff_hi=t.hi, p=t.p, p_sign_flip=sign_flip_p(d))
    if margin is not None:
        e = tost_paired(d, margin, alpha=(1 - conf))
        row.update(tost_p=e.p, tost_lo=e.lo, tost_hi=e.hi)
    if floor is not None and ceiling is not None:
        gap = paired_t(ceiling, floor, conf)
        row.update(gap=gap.mean, gap_p=gap.p)
        if gap.p < 1 - conf:
            r = fieller(x, floor, ceiling, conf)
            row.update(gap_closed=r.estimate, gap_closed_lo=r.lo, gap_closed_hi=r.hi, gap_closed_note=r.note)
        else:
            row.update(gap_closed=math.nan, gap_closed_lo=math.nan, gap_closed_hi=math.nan,
                       gap_closed_note=f"not computed: the gap on-policy - uncorrected is not significant "
                                       f"(paired p = {gap.p:.2g})")
    return row


def add_holm(rows: list[dict], p_key: str = "p", out_key: str | None = None) -> list[dict]:
    """Holm-adjust ``row[p_key]`` over ``rows`` (the whole family, one hypothesis per row), in place, into
    ``row[out_key]`` (default ``p_key + "_holm"``); rows whose ``p_key`` is NaN are outside the family and get NaN.
    Returns ``rows``."""
    out_key = out_key or f"{p_key}_holm"
    family = [r for r in rows if math.isfinite(r[p_key])]
    for r, adjusted in zip(family, holm([r[p_key] for r in family]) if family else []):
        r[out_key] = adjusted
    for r in rows:
        r.setdefault(out_key, math.nan)
    return rows
