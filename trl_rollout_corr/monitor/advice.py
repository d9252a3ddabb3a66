"""What the monitor advises after a policy collapse: only remedies a benchmark's confirmed analysis supports.

A remedy is listed in ``REMEDIES`` only where a pre-registered, paired, Holm-corrected analysis confirms it above TRL's
default for that kind's scenario (``SCENARIOS``) of ``experiments/mismatch_train.py`` (docs/evidence.md, "Training
in the regime of real runs"); ``tests/experiments/test_mismatch_benchmark.py`` checks that ``REMEDIES`` is exactly what
its ``confirmed_methods()`` returns from the committed results (``experiments/results/mismatch_train*_results.csv``).

- A stale engine (``rollout_lag`` > 0): ``dppo_kl_bypass`` or ``ppo_is_bypass``, each confirmed better than TRL's
  default in scenario S2 (``DPPO_STALE_FOUND``: experiment G, ``experiments/dppo_stale.py``, pre-registration 25, 20
  paired seeds, Holm over 3, then 10 held-out seeds: dppo_kl_bypass +0.076 [+0.040, +0.112], held out +0.035,
  one-sided p 0.030; ppo_is_bypass +0.079 [+0.044, +0.114], held out +0.030, one-sided p 0.027; dppo_tv_bypass not
  confirmed held out). ``dppo_kl_bypass`` is named first for its larger held-out difference; the two were not compared
  with each other, so there is no preference beyond that order, and a run on either is on the remedy
  (``Remedy.alternatives``). ``ppo_is_bypass`` was confirmed before by experiment C on 20 fresh paired seeds: +0.065
  [+0.032, +0.097] held-out reward over TRL's default, Holm p 0.00017 (a family of 2), gap closed 0.88.
  Its regime: an engine 8 optimizer steps stale, T = 49 tokens, per-token KL(engine || policy) 6e-3-1.1e-2, T * KL
  0.3-0.5 (C; G's arms: 5.1e-3-8.3e-3, T * KL 0.25-0.41), a 465k-parameter model, 2 optimizer steps per generation,
  30 steps, on a CPU. At long completions neither is confirmed: in experiment G at T = 257 with the engine 16 steps
  stale (``DPPO_STALE_257_FOUND``) all three bypass presets were above TRL's default on 20 seeds (Holm p 0.048), TRL's
  default collapsing on 4 of them, but none was confirmed on the held-out seeds; at T = 257 (S2X, experiments X, Y
  and Z: engines 8 and 16 steps stale, uncorrected T * KL 1.4-2.2 at a per-token KL of 5.6e-3-8.7e-3)
  ppo_is_bypass was not significantly above TRL's default (+0.025, p 0.28; +0.132, Holm p 0.80; -0.004 [-0.024,
  +0.016] on 30 more seeds), and TRL's default collapsed on 2 of Y's 10 seeds at the 16-step
  lag and on none of Z's 30; at T = 129
  (S2L) the stale engine's cost was not significant. With a precision gap on top of the staleness (S2D, experiment A:
  an engine 4 steps stale sampling with dense logit noise at T = 257, per-token KL 5e-3-1.2e-2, T * KL 1.3-3.1, the
  kind of mismatch an asynchronous bf16 run has) ``ppo_is_bypass`` trained significantly WORSE than TRL's default
  (-0.100 [-0.145, -0.054], Holm p 0.0059; held out -0.087), and with smaller gaps too (S2B, experiment B: per-token
  KL 2.8e-3-7.6e-3, T * KL 0.7-1.9: -0.081, held out -0.043; S2E, experiment E: per-token KL 1.2e-3-5.0e-3, T * KL
  0.3-1.3: -0.046, held out -0.025); ``dppo_kl_bypass`` was not measured with a precision gap, and it is bypass
  (pi_old := pi_rollout) as well; the message says both. Not measured on a GPU.
- A persistent precision gap (``rollout_lag`` = 0: quantized / low precision): none. In S1 (a heavy-tailed,
  precision-like gap, T = 49, per-token KL 7.7e-2-9.9e-2, T * KL 3.7-4.8) the mismatch cost nothing (on-policy minus
  no correction +0.003 [-0.026, +0.032], 10 seeds), so no correction could be compared; the same gap at T = 257
  (S1X, experiment Q: per-token KL 8.3e-3-8.5e-3, T * KL 2.1) cost nothing measurable either (+0.012 [-0.011,
  +0.035], 10 seeds) and no correction differed from TRL's default (Holm p 0.73); with a dense gap at T = 257 (S1D,
  experiment D: per-token KL 4.3e-3-7.5e-3, T * KL 1.1-1.8, no cost either) ``ppo_is_bypass`` and TRL's
  ``token_truncate`` trained significantly worse than TRL's default (-0.166 [-0.300, -0.031] and -0.044 [-0.066,
  -0.022], Holm p 0.0059; held out: -0.099, -0.065), so the message says to keep TRL's default there; the old benchmark
  (``experiments/mismatch_bench.py``: T <= 9, per-token KL 0.14-0.30, 5 seeds) singles none out either.

The gap that is not staleness (issue 37, pre-registration 16 of ``experiments/mismatch_train.py``): a run that logs
``rollout_corr/lag_0/kl`` (the asynchronous trainer's per-lag metrics: the per-token KL(pi_rollout || pi_theta) of the
samples the current policy drew, i.e. the engine's own gap without staleness) has that gap measured. At or above
``LAG0_CAUTION_KL`` -- the smallest step-0 noise-only per-token KL at which ``ppo_is_bypass`` trained significantly
worse than TRL's default and stayed worse on held-out seeds (``lag0_caution_kl()`` of the committed results) -- the
stale remedy is NOT advised (a run already on it is told ``ppo_is_bypass`` trained worse there and ``dppo_kl_bypass``,
bypass as well, was not measured there); below it, the remedy is said with the
run's lag-0 KL, that bound and what the smallest gap measured found (experiment F: 8.7e-4, not significant).
Without the metric the message is as above. A run on bypass at or above the bound (the asynchronous trainer's
default) is also told what TRL's asynchronous trainer itself measured (``ASYNC_S4_FOUND``: S4 of
``experiments/async_mismatch.py``, pre-registration 17): TRL's default correction (``trl_default``) trained better
than TRL's own loss there, held out (at the bound's own gap, sigma 0.8, not significantly: pre-registration 19).

For a kind without a remedy the advice names the metrics to watch and the benchmark page, no preset. The monitor
tells the kinds apart by what it is told about the engine (``rollout_lag``): a lag > 0 is a stale engine, 0 a
synchronous engine whose mismatch persists, ``None`` unknown (both kinds, the stale remedy named only as conditional
on a stale engine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.metric_names import metric
from ..core.stats import METRIC_PREFIX

# the kinds of mismatch the monitor tells apart: how a message says it, and the benchmark scenario that stands for it
KINDS = {"stale": "a stale engine", "persistent": "a persistent precision gap"}
SCENARIOS = {"stale": "S2", "persistent": "S1"}  # experiments/mismatch_train.py's scenarios
BENCHMARK = "experiments/mismatch_train.py"
BENCHMARK_PAGE = 'docs/evidence.md, "Training in the regime of real runs"'
# what the benchmark found for a kind without a remedy (the message says it, with its regime)
FOUND = {
    "stale": "no method was confirmed above TRL's default in its S2 scenario",
    "persistent": ("in its S1 scenario (a heavy-tailed, precision-like gap: T = 49 tokens, per-token KL 7.7e-2-9.9e-2, "
                   "T * KL 3.7-4.8) the mismatch cost nothing (on-policy minus no correction +0.003 [-0.026, +0.032] "
                   "reward, 10 seeds), so no correction could be compared; at T = 257 (S1X: per-token KL "
                   "8.3e-3-8.5e-3, T * KL 2.1) it cost nothing measurable either (+0.012 [-0.011, +0.035], 10 seeds) "
                   "and no correction differed from TRL's default (Holm p 0.73); with a dense gap at T = 257 (S1D: "
                   "per-token KL 4.3e-3-7.5e-3, T * KL 1.1-1.8; no cost either) ppo_is_bypass and TRL's token_truncate "
                   "trained significantly WORSE than TRL's default (-0.166 [-0.300, -0.031] and -0.044 [-0.066, "
                   "-0.022], Holm p 0.0059; on 5 held-out seeds -0.099 and -0.065): keep TRL's default for a "
                   "persistent gap; the old mismatch benchmark's wq3 rows "
                   "single none out after a paired, Holm-corrected analysis"),
}


@dataclass(frozen=True)
class Remedy:
    """What a benchmark confirmed for one kind of mismatch: the method, how to switch to it, and where it was shown.

    ``setting`` is the first confirmed setting (the one a message says first); ``alternatives`` the other settings
    confirmed for the same kind, equally (config lines such as ``rollout_correction_preset=ppo_is_bypass``): a run on
    any of them is on the remedy (:meth:`on`)."""

    kind: str  # the kind of mismatch, as the message says it
    method: str  # the method's name (the preset, or TRL's mode)
    setting: str  # how to ask for it in RolloutCorrGRPOConfig / YAML / CLI
    scenario: str  # the benchmark scenario (and experiment) whose confirmed analysis backs it
    evidence: str = ""  # the confirmed result, as the message says it
    regime: str = ""  # where it was measured (and where not), as the message says it
    caution: str = ""  # where the same benchmark measured it WORSE than TRL's default, as the message says it
    alternatives: tuple[str, ...] = ()  # the other confirmed settings (config lines), after ``setting``
    caution_method: str = ""  # the method the caution measured (default: ``method``)

    @property
    def settings(self) -> tuple[str, ...]:
        """Every confirmed setting, ``setting`` first."""
        return (self.setting, *self.alternatives)

    @property
    def methods(self) -> tuple[str, ...]:
        """The methods of :attr:`settings` (the value after ``=``), ``method`` first."""
        return (self.method, *(a.partition("=")[2] for a in self.alternatives))

    @property
    def names(self) -> str:
        """The methods as a message says them: ``dppo_kl_bypass`` or ``dppo_kl_bypass, ppo_is_bypass``."""
        return ", ".join(self.methods)

    @property
    def switch(self) -> str:
        """How a message asks for it: the first setting, then each alternative as equally confirmed."""
        if not self.alternatives:
            return self.setting
        return f"{self.setting} (or {' or '.join(self.alternatives)}, equally confirmed)"

    def config(self, setting: str | None = None) -> Any:
        """The resolved ``RolloutCorrectionConfig`` of ``setting`` (default: the first one), to tell whether a run
        already uses it."""
        from ..config.correction import RolloutCorrectionConfig
        from ..config.compat import TRL_MODES, translate_trl_correction

        key, _, value = (setting or self.setting).partition("=")
        if key == "vllm_importance_sampling_mode" and value in TRL_MODES:
            return RolloutCorrectionConfig(**translate_trl_correction(True, value))
        return RolloutCorrectionConfig.from_preset(value)

    def on(self, correction: Any) -> str | None:
        """The confirmed setting the run's resolved ``correction`` is (None: none of :attr:`settings`)."""
        if correction is None:
            return None
        return next((s for s in self.settings if correction == self.config(s)), None)


# experiment G (experiments/dppo_stale.py, pre-registration 25), scenario S2: what the stale remedy's evidence quotes
# for the DPPO presets beside ppo_is_bypass (each minus TRL's default by TRL's GRPOTrainer, sequence_mask C=3); the
# integrator's test recomputes it from experiments/results/dppo_stale_results.csv
DPPO_STALE_FOUND = (
    "in experiment G (experiments/dppo_stale.py, pre-registration 25, S2: an engine 8 optimizer steps stale, T = 49, "
    "per-token KL 5.1e-3-8.3e-3, T * KL 0.25-0.41, a 465k-parameter model, 2 optimizer steps per generation, 30 steps, "
    "on a CPU), each minus TRL's default on 20 paired seeds (Holm over 3), then on 10 held-out seeds (confirmed iff "
    "one-sided paired t and exact sign-flip p < 0.05): dppo_kl_bypass +0.076 [+0.040, +0.112], Holm p 0.00064 (t) / "
    "0.00024 (sign-flip), held out +0.035 [-0.002, +0.071], one-sided p 0.030 (t) and 0.030 (sign-flip): confirmed "
    "better; ppo_is_bypass +0.079 [+0.044, +0.114], Holm p 0.00042 / 0.000034, held out +0.030 [-0.001, +0.060], "
    "one-sided p 0.027 / 0.027: confirmed better; dppo_tv_bypass +0.073 [+0.034, +0.112], Holm p 0.00094, held out "
    "+0.029 [-0.012, +0.069], one-sided p 0.073: not confirmed")

# experiment G, scenario S2X (T = 257, engine 16 steps stale): the family passed Holm, the held-out seeds did not
# confirm it (tests/experiments/test_dppo_stale.py recomputes it from experiments/results/dppo_stale_results.csv)
DPPO_STALE_257_FOUND = (
    "in experiment G's S2X (T = 257, an engine 16 optimizer steps stale, per-token KL 1.9e-3-5.7e-3, T * KL "
    "0.49-1.46), each minus TRL's default on 20 paired seeds: dppo_tv_bypass +0.125 [+0.024, +0.226], dppo_kl_bypass "
    "+0.108 [+0.022, +0.194], ppo_is_bypass +0.116 [+0.009, +0.223], Holm p 0.048 each, TRL's default collapsing on "
    "4 of 20 and the others on none; on the held-out seeds, cut by the pre-registered deadline at 4 of 10 "
    "(310-313): +0.013, +0.013, -0.003 (one-sided p 0.18, 0.18, 0.64): none confirmed")

# kind -> Remedy, only where a benchmark's confirmed analysis supports one (experiments/mismatch_train.py's
# confirmed_methods() and experiments/dppo_stale.py's experiment G; the old benchmark's remedies did not survive Holm:
# ppo_is_bypass p 0.054 on stale4, TRL's token_truncate 0.23 on wq3)
REMEDIES: dict[str, Remedy] = {
    "stale": Remedy(
        KINDS["stale"], "dppo_kl_bypass", "rollout_correction_preset=dppo_kl_bypass",
        "mismatch_train S2, experiment C; the same scenario in experiments/dppo_stale.py, experiment G",
        evidence=("dppo_kl_bypass +0.076 [+0.040, +0.112] held-out reward over TRL's default on 20 paired seeds "
                  "(experiment G), Holm p 0.00064, and +0.035 [-0.002, +0.071] on 10 held-out seeds, one-sided "
                  "p 0.030; ppo_is_bypass +0.065 [+0.032, +0.097] on 20 fresh paired seeds (experiment C), "
                  "Holm p 0.00017, 0.88 of the stale engine's cost recovered, and in experiment G +0.079 [+0.044, "
                  "+0.114], Holm p 0.00042, +0.030 [-0.001, +0.060] on its 10 held-out seeds, one-sided p 0.027; "
                  "the two were not compared with each other (dppo_kl_bypass is named first for its larger "
                  "held-out difference, no preference beyond that order)"),
        regime=("an engine 8 optimizer steps stale, T = 49 tokens, per-token KL 6e-3-1.1e-2, T * KL 0.3-0.5 "
                "(experiment C; in experiment G per-token KL 5.1e-3-8.3e-3, T * KL 0.25-0.41), a 465k-parameter "
                "model, 2 optimizer steps per generation, 30 steps; ppo_is_bypass not confirmed at long completions "
                "(T = 257, engines 8 and 16 steps stale, uncorrected T * KL 1.4-2.2: +0.025, p 0.28, +0.132, "
                "Holm p 0.80 and, on 30 more seeds, -0.004 [-0.024, +0.016] over TRL's default, which collapsed on "
                "2 of 10 seeds at the 16-step lag and on none of the 30 more); in experiment G at T = 257, 16 steps "
                "stale, both above TRL's default on 20 seeds (Holm p 0.048; TRL's default collapsed on 4 of 20) but "
                "not confirmed on held-out seeds; not measured on a GPU"),
        caution=("where the engine ALSO samples at another precision (an engine 4 optimizer steps stale with dense "
                 "logit noise, T = 257, per-token KL 5e-3-1.2e-2, T * KL 1.3-3.1: the kind of mismatch an "
                 "asynchronous bf16 run has, measured in the synchronous trainer, mismatch_train S2D, experiment A) "
                 "ppo_is_bypass trained WORSE than TRL's default: -0.100 [-0.145, -0.054] held-out reward, Holm p "
                 "0.0059, on 5 held-out seeds -0.087 [-0.166, -0.009]; with a smaller gap (S2B, experiment B: "
                 "per-token KL 2.8e-3-7.6e-3, T * KL 0.7-1.9) too: -0.081 [-0.119, -0.043], p 0.0039, held out "
                 "-0.043 [-0.067, -0.018]; and with a smaller one still (S2E, experiment E: per-token KL "
                 "1.2e-3-5.0e-3, T * KL 0.3-1.3): -0.046 [-0.085, -0.006], p 0.016, held out -0.025 [-0.037, "
                 "-0.013]; dppo_kl_bypass was not measured with a precision gap, and it is bypass (pi_old := "
                 "pi_rollout) as well"),
        alternatives=("rollout_correction_preset=ppo_is_bypass",),
        caution_method="ppo_is_bypass"),
}


# pre-registration 16's decision (2): experiments/mismatch_train.py's lag0_caution_kl() of the committed results
# (experiments A: 8.85e-3, B: 4.41e-3 and E: 2.05e-3 survived; tests/experiments/test_mismatch_train.py holds them
# equal)
LAG0_CAUTION_KL = 2.05e-3
LAG0_KEY = metric("lag_0/kl")
# below the bound: what the smallest gap measured found (experiment F, not significant, so it does not move the bound)
LAG0_BELOW_FOUND = ("at 8.7e-4 (S2F, experiment F: per-token KL 1.0e-3-2.9e-3, T * KL 0.25-0.73) the difference was "
                    "not significant (-0.012 [-0.049, +0.025], p 0.48) and not shown equal either")


# in TRL's asynchronous trainer itself (experiments/async_mismatch.py, S4, pre-registration 17): what a run on its
# default (bypass) is told at or above the lag-0 bound; tests/experiments/test_async_mismatch.py recomputes the numbers
# from experiments/results/async_mismatch_s4_results.csv
ASYNC_S4_FOUND = ("in TRL's asynchronous trainer itself (experiments/async_mismatch.py, S4: T = 257, max_staleness 4, "
                  "N(0, 1) logit noise inside vLLM, a lag-0 gap of 1.3e-3-5.3e-3 per token, per-token KL 3.1e-3-6.7e-3 "
                  "under TRL's loss, 465k parameters, CPU float32) TRL's default correction trained better than TRL's "
                  "own loss: +0.110 [+0.046, +0.174] held-out reward on 10 paired seeds (above on all 10, sign-flip p "
                  "0.002), +0.067 on 5 held-out seeds (above on 4); at the gap of this bound (sigma 0.8, lag-0 gap "
                  "2.1e-3 on average) +0.038 [-0.007, +0.084], not significant, and without a gap -0.038 [-0.093, "
                  "+0.016], not shown to cost nothing (so it is not the default); to use it here while the gap "
                  "lasts: rollout_correction_preset=trl_default")


# Truncated sampling (top-k / top-p / min-p): experiment P of experiments/mismatch_train.py (scenario S3, a stand-in
# engine) found a cost of truncation on seeds 40-49 (on_policy - M0 +0.055, p 0.0022) that no correction recovered,
# but its held-out seeds 50-54 did not confirm it (-0.010 [-0.082, +0.061]). On the real vLLM engine
# (experiments/vllm_truncation.py, pre-registrations 20 and 21) the cost is confirmed on held-out seeds and is the
# truncation's, not the bf16 engine's; no correction recovered any of it. Pre-registration 21's rule 6: the trainer
# says TRUNCATION_FOUND once at start when its sampler truncates (tests/experiments/test_vllm_truncation.py holds the
# numbers to the committed CSVs).
TRUNCATION_FOUND = (
    "measured (experiments/vllm_truncation.py, docs/evidence.md S3V: vLLM bf16, T = 49, per-token KL of the "
    "truncation 7.5e-3-9.9e-3, T * KL 0.37-0.48, a 465k-parameter model, 30 steps on a CPU): training rollouts sampled "
    "at top_p 0.8 scored +0.055 [+0.017, +0.092] held-out reward below the same bf16 engine at top_p 1 (15 seeds, "
    "Holm p 0.0093; 5 held-out seeds: +0.039, the same sign), and +0.054 [+0.022, +0.086] below training on the full "
    "distribution (a float32 engine at top_p 1) when both policies are served at top_p 0.8; no correction (TRL's "
    "default, token_truncate, ppo_is_bypass, the truncated-support correction) recovered any of it")


# Top-k (pre-registration 23, the same task and engine at top_k 2, the strongest top-k that still samples there): no
# cost shown and no equivalence; TRL's default did not change it measurably. Its rule 6: the advice says this instead
# of "not measured".
TOP_K_FOUND = (
    "measured at top_k 2 (experiments/vllm_truncation.py, pre-registration 23: the same task, model and bf16 engine; "
    "per-token KL of the truncation 3.1e-3-3.2e-3, T * KL 0.15-0.16, about a third of top_p 0.8's there): training "
    "at top_k 2 scored 0.004 more held-out reward than the same engine at top_k 0 (its cost -0.004 [-0.031, +0.023], "
    "15 seeds): a cost not shown, and not shown equivalent within +-0.02 either (TOST p 0.12); TRL's default beside "
    "it +0.007 [-0.008, +0.023] (Holm p 0.62)")


# Min-p (pre-registration 24, min_p 0.2: calibrated to top_p 0.8's per-token KL): the cost is confirmed (Holm) and
# keeps its sign on held-out seeds, as large as top-p's; TRL's default equivalent to none. With top-k 2's null at a
# third of that KL, the advice keys on the truncation's strength (its rule 6).
MIN_P_FOUND = (
    "measured at min_p 0.2 (experiments/vllm_truncation.py, pre-registration 24: the same task, model and bf16 engine; "
    "per-token KL of the truncation 7.2e-3-9.0e-3, T * KL 0.35-0.44, as strong as top_p 0.8's there): +0.053 [+0.017, "
    "+0.089] held-out reward below the same engine without min_p (15 seeds, Holm p 0.017; 5 held-out seeds: +0.043, "
    "the same sign); TRL's default beside it +0.004 [-0.012, +0.021], equivalent to no correction within +-0.02 "
    "(TOST p 0.032)")


def truncation_advice(top_k: int, top_p: float, min_p: float | None) -> str | None:
    """The start-up advice for a sampler that truncates (``top_k`` > 0, ``top_p`` < 1 or ``min_p`` > 0), else None.

    What each truncation rule the sampler uses cost in training when measured (top-p 0.8 ``TRUNCATION_FOUND`` and
    min-p 0.2 ``MIN_P_FOUND``, both at per-token KL ~8e-3: a cost; top-k 2 ``TOP_K_FOUND`` at a third of it: none
    shown). With top-p or min-p: sample training rollouts in full, at any setting (conservative: each rule was measured
    at one strength). With top-k alone: sample in full where the run's truncation is as strong as the costly ones
    were (its per-token KL is about -log of the logged kept mass): pre-registration 24's rule 6 keys the advice on
    the strength, with which the measurements are consistent (top-k at that strength was not run)."""
    settings = [f"top_k={top_k}" if top_k and top_k > 0 else "", f"top_p={top_p:g}" if top_p < 1 else "",
                f"min_p={min_p:g}" if min_p else ""]
    settings = [x for x in settings if x]
    if not settings:
        return None
    lead = (f"The sampler truncates ({', '.join(settings)}): importance sampling cannot correct tokens the sampler "
            "never draws")
    measured = ([f"top-p was {TRUNCATION_FOUND}"] if top_p < 1 else []) + (
        [f"min-p was {MIN_P_FOUND}"] if min_p else []) + ([f"top-k was {TOP_K_FOUND}"] if top_k and top_k > 0 else [])
    if top_p < 1 or min_p:
        return (f"{lead}, and truncation cost reward in training here: {'; '.join(measured)}. Sample training rollouts "
                "at top_p=1, top_k=0 and without min_p (keep the truncation for evaluation or serving if you want it).")
    return (f"{lead}. Top-k was {TOP_K_FOUND}. Truncation about three times as strong cost reward there, by either "
            f"rule measured: top-p was {TRUNCATION_FOUND}; min-p was {MIN_P_FOUND}. Where this run's truncation is as "
            f"strong (per-token KL about -log of {metric('kept_mass_mean')}, near 8e-3), sample training rollouts at "
            "top_k=0.")


def kinds_for(rollout_lag: int | None) -> list[str]:
    """The kinds of mismatch what is known about the engine allows: stale (lag > 0), persistent (0) or both."""
    if rollout_lag is None:
        return ["stale", "persistent"]
    return ["stale" if rollout_lag > 0 else "persistent"]


def remedies_for(rollout_lag: int | None) -> list[Remedy]:
    """The supported remedies for what is known about the engine (possibly none)."""
    return [REMEDIES[kind] for kind in kinds_for(rollout_lag) if kind in REMEDIES]


def lag0_text(remedy: Remedy, lag0_kl: float | None) -> tuple[bool, str]:
    """(advised, what the run's own lag-0 gap says about the stale remedy): ``lag0_kl`` is the run's smoothed
    ``rollout_corr/lag_0/kl`` (None: not logged, nothing to say); not advised at or above ``LAG0_CAUTION_KL``."""
    if lag0_kl is None or remedy.kind != KINDS["stale"]:
        return True, ""
    said = (f"this run's engine differs from the trainer without staleness too: smoothed {LAG0_KEY} = {lag0_kl:.3g} "
            f"per token")
    measured = remedy.caution_method or remedy.method
    others = [m for m in remedy.methods if m != measured]
    # the other confirmed methods are bypass too, but were not measured with such a gap: say so beside the one that was
    unmeasured = (f" ({', '.join(others)}, bypass as well, {'was' if len(others) == 1 else 'were'} not measured with "
                  "such a gap)" if others else "")
    if lag0_kl >= LAG0_CAUTION_KL:
        return False, (f"{said}, at or above {LAG0_CAUTION_KL:.3g}, the smallest such gap at which {measured} "
                       f"trained significantly WORSE than TRL's default and stayed worse on held-out seeds{unmeasured}")
    return True, (f"{said}, below {LAG0_CAUTION_KL:.3g}, the smallest such gap at which {measured} was measured "
                  f"to train worse than TRL's default{unmeasured}; {LAG0_BELOW_FOUND}")


def collapse_advice(correction: Any, rollout_lag: int | None, corrected: bool | None, has_metrics: bool,
                    lag0_kl: float | None = None) -> str:
    """The advice after ``policy_collapse``: a remedy a benchmark confirmed for the kind of mismatch, with its regime
    (conditional on that kind when the lag is unknown), or, where the run already uses it (``correction``: the run's
    resolved config), what remains; for a kind without one, what the benchmark found, the metrics to watch and the
    benchmark page, no preset. ``lag0_kl``: the run's smoothed lag-0 KL where logged (:func:`lag0_text`)."""
    if not has_metrics:
        lead = f"No {METRIC_PREFIX}* metrics are logged: enable a rollout correction."
    elif corrected is False:
        lead = "No rollout correction is active (preset disabled)."
    elif rollout_lag is None:
        lead = "The engine's lag is unknown (pass rollout_lag to the monitor to narrow this down)."
    elif rollout_lag > 0:
        lead = f"The engine is known to lag {rollout_lag} optimizer step(s)."
    else:
        lead = "The engine is synchronous, so its mismatch persists (quantization / precision)."
    parts, unsupported = [], []
    for kind in kinds_for(rollout_lag):
        remedy = REMEDIES.get(kind)
        if remedy is None:
            unsupported.append(kind)
            continue
        where = f"{BENCHMARK} ({remedy.scenario}; {remedy.regime})"
        # with the lag unknown, the remedy holds only if the engine is of its kind
        head = f"If this is {remedy.kind}" if rollout_lag is None else f"For {remedy.kind}"
        caution = f" But {remedy.caution}." if remedy.caution else ""
        advised, measured = lag0_text(remedy, lag0_kl)
        on_remedy = remedy.on(correction)  # the confirmed setting this run is on, if any
        several = len(remedy.settings) > 1
        what = f"bypass ({remedy.names})" if several else remedy.method
        if not advised:
            parts.append(f"{head}: {measured}. There, {remedy.caution}. So {what} is not advised"
                         + (f", and this run uses it ({on_remedy}): TRL's default (vllm_importance_sampling_mode="
                            f"sequence_mask, the trl_default preset) is what it was measured against; {ASYNC_S4_FOUND}"
                            if on_remedy else "")
                         + "; what remains: a lower learning rate, or less mismatch at its source (a more precise "
                           "engine / sync more often).")
        elif on_remedy:
            parts.append(f"{head}, this run already uses what was confirmed to train better than TRL's "
                         f"default in {where}, {on_remedy}"
                         + (f" (confirmed as well: {', '.join(s for s in remedy.settings if s != on_remedy)}; the two "
                            "were not compared with each other)" if several else "")
                         + "; what remains: lower the learning rate, or reduce the mismatch at its "
                         f"source (sync more often / a more precise engine).{caution}"
                         + (f" Here {measured}." if measured else ""))
        else:
            confirmed = (f"{' and '.join(remedy.methods)} were each" if several else f"{remedy.method} was")
            parts.append(f"{head}, {confirmed} confirmed to train better than TRL's default in {where}: "
                         f"{remedy.evidence}. Switch to it: {remedy.switch}.{caution}"
                         + (f" Here {measured}." if measured else ""))
    if unsupported:
        parts.append(
            f"No correction is confirmed to help with {' or '.join(KINDS[k] for k in unsupported)}: in {BENCHMARK}, "
            f"{'; '.join(FOUND[k] for k in unsupported)}. Watch {metric('kl')} (the mismatch) "
            f"and {metric('rollout_is_eff_sample_size')}, see {BENCHMARK_PAGE} for your regime (T * per-token KL), "
            "and act on the cause: a lower learning rate, or less mismatch at its source (sync more often / a more "
            "precise engine).")
    return " ".join([lead, *parts])
