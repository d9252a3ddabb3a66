"""The verdict: what the evidence tells a user to do, one row per situation, with the regime it was measured in.

This module is the one record of the package's advice. The README's and docs/evidence.md's verdict tables are rendered
from ``VERDICTS`` (``markdown_table``; ``tests/repo/test_verdict.py`` fails when a page's table differs), the probe
places a run on a row (``place``), the demo trains the row its engine falls on, and the monitor's and the trainers'
messages quote the same numbers (``monitor/advice.py``, whose constants the experiments' tests recompute from the
committed results).

Every row states the regime it was measured in: the completion length T, the per-token KL(pi_rollout || pi_theta), their
product T·KL (the exponent that sets how far sequence-level weights degenerate) and the model size. Nothing here was
measured on a GPU or on a model above 465k parameters: a row is evidence for a regime like its own, not beyond it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.metric_names import metric

EVIDENCE_PAGE = "docs/evidence.md"


@dataclass(frozen=True)
class Verdict:
    """One row of the verdict table.

    Args:
        key: the row's anchor on the evidence page (``docs/evidence.md#<key>``) and its name in code.
        situation: when the row applies, in plain words.
        advice: what to do, in plain words.
        setting: the config line that does it (``""``: nothing to set, TRL's default correction).
        trainer: the trainer the row was measured in.
        T: the completion length(s) of the runs behind the row (tokens).
        per_token_kl: the per-token KL(pi_rollout || pi_theta) of the compared arms.
        t_kl: T·KL of the compared arms.
        model: the model size the runs trained.
        confirmation: how the row was confirmed (seeds, test, held-out seeds), plainly.
    """

    key: str
    situation: str
    advice: str
    setting: str
    trainer: str
    T: str
    per_token_kl: str
    t_kl: str
    model: str
    confirmation: str

    @property
    def evidence(self) -> str:
        """The link to the row's evidence on the docs' evidence page."""
        return f"{EVIDENCE_PAGE}#{self.key}"


MODEL = "465k parameters, CPU"

VERDICTS: tuple[Verdict, ...] = (
    Verdict(
        key="default",
        situation="anything not listed below, bf16 or FP8 vLLM at 1k-8k tokens included (not measured)",
        advice="keep TRL's default correction (sequence_mask, C = 3): nothing was confirmed better there",
        setting="",
        trainer="RolloutCorrGRPOTrainer",
        T="49–257", per_token_kl="1.4e-3–1.3e-2", t_kl="0.29–2.2", model=MODEL,
        confirmation="no correction confirmed above it in 13 paired experiments (10 seeds each; one of 30, one of "
                     "20) outside the stale-engine row",
    ),
    Verdict(
        key="truncating-sampler",
        situation="your training sampler truncates (top_p < 1, or min_p > 0)",
        advice="sample training rollouts at top_p = 1 and min_p = 0: no correction recovered what truncation cost",
        setting="top_p=1.0",
        trainer="RolloutCorrGRPOTrainer, vLLM colocate (bf16)",
        T="49", per_token_kl="8.1e-3–8.3e-3", t_kl="0.40–0.41", model=MODEL,
        confirmation="+0.055 [+0.017, +0.092] reward at top_p 1 (15 paired seeds, Holm p 0.0093); "
                     "held out on 5 seeds: +0.039, same sign",
    ),
    Verdict(
        key="stale-engine",
        situation="the engine's weights lag the policy (8 optimizer steps measured), no precision gap, "
                  "short completions (T·KL ≤ 0.52, the largest measured where it was confirmed)",
        advice="use dppo_kl_bypass or ppo_is_bypass (each confirmed, not compared); at T = 257 neither was "
               "confirmed: keep the default",
        setting="rollout_correction_preset=dppo_kl_bypass",
        trainer="RolloutCorrGRPOTrainer",
        T="49", per_token_kl="5.1e-3–1.1e-2", t_kl="0.25–0.52", model=MODEL,
        confirmation="ppo_is_bypass +0.065 [+0.032, +0.097] reward over TRL's default on 20 fresh paired seeds "
                     "(Holm p 0.00017); with dppo_kl_bypass (+0.076) in a family of 3, both held out on 10 fresh "
                     "seeds (+0.030, +0.035; one-sided p 0.027, 0.030)",
    ),
    Verdict(
        key="precision-gap",
        situation="the engine samples at another precision than the trainer (a noise-only gap of 2.05e-3 per token "
                  "or more), stale or not",
        advice="keep TRL's default; not ppo_is_bypass or token_truncate (both trained worse)",
        setting="",
        trainer="RolloutCorrGRPOTrainer",
        T="257", per_token_kl="1.6e-3–8.8e-3", t_kl="0.40–2.2", model=MODEL,
        confirmation="ppo_is_bypass −0.046 to −0.166, token_truncate −0.044 reward below TRL's default "
                     "(4 experiments, 10 paired seeds each, p ≤ 0.016); held out on 5 seeds each, same sign",
    ),
    Verdict(
        key="async-precision-gap",
        situation=f"TRL's AsyncGRPOTrainer whose engine also has a precision gap ({metric('lag_0/kl')} ≥ 2.05e-3; "
                  "measured at about 3.6e-3, not significant at 2.1e-3)",
        advice="RolloutCorrAsyncGRPOTrainer with TRL's default correction",
        setting="rollout_correction_preset=trl_default",
        trainer="RolloutCorrAsyncGRPOTrainer, vLLM server (CPU)",
        T="257", per_token_kl="3.1e-3–4.6e-3", t_kl="0.80–1.2", model=MODEL,
        confirmation="+0.110 [+0.046, +0.174] reward over TRL's trainer as is (above on all 10 paired seeds, "
                     "p 0.002); held out on 5 seeds: +0.067, same sign (its interval spans 0)",
    ),
    Verdict(
        key="async-default",
        situation=f"TRL's AsyncGRPOTrainer without such a gap ({metric('lag_0/kl')} below 2.05e-3)",
        advice="keep the asynchronous trainer's own loss (no preset: ppo_is_bypass, TRL's)",
        setting="",
        trainer="RolloutCorrAsyncGRPOTrainer",
        T="257", per_token_kl="3.0e-4–4.8e-4", t_kl="0.077–0.12", model=MODEL,
        confirmation="TRL's default there: −0.038 [−0.093, +0.016] (10 paired seeds), not shown to cost nothing "
                     "(not shown within ±0.02)",
    ),
)

# the experiments (experiments/regime_map.py's keys, anchors of docs/evidence.md) each row's regime is taken from:
# tests/repo/test_verdict.py recomputes T, per-token KL and T·KL of a row as the range over its experiments
ROW_EXPERIMENTS: dict[str, tuple[str, ...]] = {
    "default": ("s2", "experiment-p", "s3v", "experiment-x", "experiment-y", "experiment-z", "experiment-q",
                "experiment-d", "experiment-a", "experiment-b", "experiment-e", "experiment-f", "experiment-g-257"),
    "truncating-sampler": ("s3v",),
    "stale-engine": ("experiment-c", "experiment-g"),
    "precision-gap": ("experiment-d", "experiment-a", "experiment-b", "experiment-e"),
    "async-precision-gap": ("s4",),
    "async-default": ("pre-registration-18",),
}


def verdict(key: str) -> Verdict:
    """The row named ``key`` (a ``KeyError`` naming the rows for any other)."""
    for row in VERDICTS:
        if row.key == key:
            return row
    raise KeyError(f"no verdict row {key!r}; the rows are {[row.key for row in VERDICTS]}")


def markdown_table(link_prefix: str = "") -> str:
    """The verdict table in Markdown, as the README and the evidence page show it.

    Args:
        link_prefix: what goes before ``evidence.md`` in each row's link (``"docs/"`` from the README, ``""`` from a
            page inside docs/).

    Returns:
        The table's lines joined by newlines (no trailing newline).
    """
    lines = ["| your situation | what to do | regime measured (T; per-token KL; T·KL; model) | how it was confirmed |",
             "|---|---|---|---|"]
    for row in VERDICTS:
        setting = f" (`{row.setting}`)" if row.setting else ""
        regime = f"T {row.T}; {row.per_token_kl}; {row.t_kl}; {row.model}"
        link = f"{row.confirmation} ([evidence]({link_prefix}evidence.md#{row.key}))"
        lines.append(f"| {row.situation} | {row.advice}{setting} | {regime} | {link} |")
    return "\n".join(lines)


# ---- placing a probed run on the table (trl-rollout-corr probe) ----

#: the stale-engine row holds for T·KL below this: the largest T·KL of the arms where it was confirmed
#: (experiment C, T = 49); above it the row was not confirmed (T = 257) or not measured
STALE_T_KL_BOUND = 0.52
#: the two-sided 95% normal quantile: a boundary is decided when estimate +- Z * SE lies on one side of it
Z = 1.959963984540054


@dataclass(frozen=True)
class Boundary:
    """One boundary of the table a placement tests: ``quantity`` (``per_token_kl`` or ``t_kl``) against ``bound``.

    ``side`` is ``"below"``/``"above"`` when the interval ``estimate +- z * se`` lies entirely below ``bound`` /
    at or above it, ``None`` when it straddles it (the sample cannot decide). ``sample_factor``: how many times the
    current sample a decision needs, (z * se / |estimate - bound|)^2 (the SE falls like one over the square root of
    the sample), None when decided, ``inf`` when the estimate sits on the bound, NaN when the SE is unknown.
    """

    quantity: str
    bound: float
    estimate: float
    se: float
    side: str | None
    sample_factor: float | None

    @property
    def interval(self) -> tuple[float, float]:
        """The 95% interval ``estimate +- Z * se`` (NaN when the SE is unknown)."""
        return self.estimate - Z * self.se, self.estimate + Z * self.se


@dataclass(frozen=True)
class Placement:
    """Where a probed run falls on ``VERDICTS``.

    ``rows``: the rows that apply when ``decided`` (the truncating-sampler row first when the sampler truncates,
    then the row for the engine), else every row the sample leaves possible; ``decided`` is True when the rows left
    give one advice (two rows that both say "keep TRL's default" decide). ``boundaries``: each boundary tested, with
    its side or None (:class:`Boundary`). ``sample_factor``: the largest factor among the undecided boundaries (how
    many times the current sample would decide them all), None when decided.
    """

    rows: tuple[Verdict, ...]
    decided: bool
    boundaries: tuple[Boundary, ...]
    sample_factor: float | None


def _boundary(quantity: str, bound: float, estimate: float, se: float) -> Boundary:
    """``estimate`` +- Z * ``se`` against ``bound`` (below: the interval's top < bound; above: its bottom >= bound)."""
    import math

    if not math.isfinite(estimate):
        raise ValueError(f"place(): {quantity}={estimate!r} must be a finite number (the probe's estimate).")
    if se != se or se < 0:  # NaN (fewer than 2 sequences) or invalid: the sample cannot say how far it is off
        return Boundary(quantity, bound, estimate, float("nan"), None, float("nan"))
    lower, upper = estimate - Z * se, estimate + Z * se
    if upper < bound:
        return Boundary(quantity, bound, estimate, se, "below", None)
    if lower >= bound:
        return Boundary(quantity, bound, estimate, se, "above", None)
    gap = abs(estimate - bound)
    factor = float("inf") if gap == 0 else (Z * se / gap) ** 2
    return Boundary(quantity, bound, estimate, se, None, factor)


def place(T: float, per_token_kl: float, per_token_kl_se: float, t_kl: float, t_kl_se: float, *,
          truncates: bool = False, stale: bool = False, asynchronous: bool = False) -> Placement:
    """The ``VERDICTS`` row(s) a probed run falls on, and whether its sample decides between rows.

    The probe measures at lag 0 (the engine synced to the policy), so its per-token KL is the engine's own gap
    without staleness, the quantity the monitor compares with ``LAG0_CAUTION_KL`` (monitor/advice.py: 2.05e-3, the
    smallest lag-0 gap at which ppo_is_bypass trained significantly worse than TRL's default and stayed worse on
    held-out seeds; pre-registration 16, experiment E). The rows:

    - ``truncating-sampler`` whenever ``truncates`` (the sampler's top_p < 1 or min_p > 0), next to the engine's row;
    - ``asynchronous`` (TRL's AsyncGRPOTrainer): ``async-precision-gap`` when per-token KL >= ``LAG0_CAUTION_KL``,
      else ``async-default``;
    - ``stale`` (weights synced every k > 1 optimizer steps): ``precision-gap`` when per-token KL >=
      ``LAG0_CAUTION_KL`` (ppo_is_bypass trained worse there), else ``stale-engine`` when T·KL <
      ``STALE_T_KL_BOUND`` and ``default`` when not. A stale run's T·KL grows with the lag beyond the probe's lag-0
      value: watch ``rollout_corr/k3_kl`` during training (docs/monitor.md);
    - otherwise (a synchronous engine): ``precision-gap`` when per-token KL >= ``LAG0_CAUTION_KL``, else
      ``default``; both say to keep TRL's default, so a straddling interval still decides the advice.

    A boundary is decided when the 95% interval ``estimate +- Z * se`` lies on one side of it (:class:`Boundary`).
    ``T`` is not a boundary of any row (the rows' T ranges are where each was measured); it is checked only to be a
    positive number.

    Args:
        T: the mean completion length (tokens).
        per_token_kl, per_token_kl_se: the probe's per-token KL(pi_rollout || pi_theta) (k3) and its standard error.
        t_kl, t_kl_se: the mean per-sequence T·KL (sum of k3 over a sequence's tokens) and its standard error.
        truncates: the training sampler truncates (top_p < 1 or min_p > 0).
        stale: the engine's weights lag the policy (``vllm_sync_interval`` > 1, a stale sampler).
        asynchronous: the run uses TRL's AsyncGRPOTrainer (rows measured in RolloutCorrAsyncGRPOTrainer).

    Returns:
        A :class:`Placement`.
    """
    import math

    from .advice import LAG0_CAUTION_KL  # the lag-0 bound the monitor uses (pre-registration 16, experiment E)

    if not (isinstance(T, (int, float)) and math.isfinite(T) and T > 0):
        raise ValueError(f"place(): T={T!r} must be a positive mean completion length (tokens).")
    gap = _boundary("per_token_kl", LAG0_CAUTION_KL, per_token_kl, per_token_kl_se)
    boundaries = [gap]
    if asynchronous:
        options = {"above": ["async-precision-gap"], "below": ["async-default"]}[gap.side] if gap.side else \
            ["async-precision-gap", "async-default"]
    elif stale:
        if gap.side == "above":
            options = ["precision-gap"]
        else:
            length = _boundary("t_kl", STALE_T_KL_BOUND, t_kl, t_kl_se)
            boundaries.append(length)
            options = {"below": ["stale-engine"], "above": ["default"], None: ["stale-engine", "default"]}[
                length.side]
            if gap.side is None:
                options = [*options, "precision-gap"]
    else:
        options = {"above": ["precision-gap"], "below": ["default"], None: ["precision-gap", "default"]}[gap.side]
    rows = tuple(verdict(key) for key in (["truncating-sampler"] if truncates else []) + options)
    engine_rows = rows[1:] if truncates else rows
    decided = len({(row.setting, row.trainer) for row in engine_rows}) == 1
    open_factors = [b.sample_factor for b in boundaries if b.side is None and b.sample_factor is not None]
    # NaN (an SE unknown) wins: no multiple of the sample can be named then
    factor = None if decided else max(open_factors, key=lambda f: math.inf if f != f else f)
    return Placement(rows, decided, tuple(boundaries), factor)
