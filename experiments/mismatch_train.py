"""Training runs in the regime of real runs: long completions, a live PPO clip, TRL's default run by TRL's own code,
analysed as a pre-registered paired experiment (issue 36, items 2, 3 and 6).

One command, resumable (each finished run is one JSON file that a re-run skips), ``--jobs`` runs at a time:

    python experiments/mismatch_train.py --scenarios S1,S2,S0 --methods M0,M1,M2,M3,M4 --seeds 0-9 --steps 30 \\
        --out outputs/mismatch_train --jobs 2
    python experiments/mismatch_train.py --held_out --seeds 10-14 --steps 30 --out outputs/mismatch_train  # afterwards
    python experiments/mismatch_train.py --smoke --out /tmp/smoke          # the suite's seconds-long version

Pre-registration 2 (preregistrations/02-c-l-h.md; the first is 01-mismatch-family.md): experiment C (the S2 lead
on fresh seeds 10-29), L (S2L, a 129-token completion) and H (the "does it hurt?" metrics), run as

    python experiments/mismatch_train.py --experiment C --scenarios S2 --methods M1,M3,M2 --seeds 10-29 \
        --without_on_policy --out outputs/mismatch_train --jobs 2
    python experiments/mismatch_train.py --experiment C --scenarios S2 --methods M0 --seeds 10-29 \
        --out outputs/mismatch_train --jobs 2                       # + on_policy: the cost re-check, gap closed
    python experiments/mismatch_train.py --experiment H --scenarios S1 --methods M3,M1p --seeds 10-12 \
        --without_on_policy --out outputs/mismatch_train --jobs 1   # then S2 M1p and S0 M3, seeds 10-12
    python experiments/mismatch_train.py --experiment L --scenarios S2L --methods M0 --seeds 30-39 \
        --out outputs/mismatch_train --jobs 2                       # the cost check; M1,M3,M2 only if it counts

(``--report_only --experiment C|L|H|P --seeds ...`` rewrites ``analysis.md`` for one experiment.)

On a GPU, the same command with ``--size gpu`` (Qwen2.5-0.5B's shape, bf16 autocast, T = 512; ``--n_digits 1023``,
``2047`` or ``4095`` for T up to 4096; ``GPU_SIZE`` below; no run has finished on a GPU (a first try on an H200 built
the base model): tune ``--lr`` once on-policy first,
as ``LR_PILOT`` records for the CPU size):

    python experiments/mismatch_train.py --size gpu --scenarios S0 --methods M0 --seeds 99 --lr 1e-6 --jobs 1 \
        --out outputs/mismatch_train_gpu_lr1e-6         # the on-policy learning-rate pilot, one lr per folder
    python experiments/mismatch_train.py --size gpu --scenarios S2,S3 --methods M0,M1,M3 --seeds 40-49 --jobs 1 \
        --lr LR --out outputs/mismatch_train_gpu

It writes ``DIR/runs/*.json`` (one per run), ``DIR/results.csv`` (one row per run), ``DIR/analysis.md`` (the
pre-registered analysis) and ``DIR/mismatch_train.png``.

**Task** (``trl_rollout_corr/testing/psum_task.py``): running prefix sums mod 10 of 48 digits, a completion of 49
tokens with EOS; reward = length of the correct prefix / 48, so an early error ruins the rest, as in chain of
thought. The vocabulary has 240 tokens the task never uses (a low-probability tail).

**Model**: a Qwen2-style model (hidden 96, 3 layers, 4 heads, 465k parameters) built locally. It is pre-trained
once by supervised teacher forcing (``BASE_STEPS`` steps, one fixed seed: the "pretrained checkpoint" every run
starts from, as real RL runs start from one base model), then each seed runs its own short supervised warm-up
(``WARMUP_STEPS`` steps on its own data), so the seed fixes the warm-up, the prompt order and the sampling; the
initial weights are the shared base model's.

**GRPO**: 8 prompts x 8 completions per generation batch, ``steps_per_generation=2`` (two optimizer steps of 32
completions per generation batch: pi_old is the policy at generation, so the PPO clip against pi_old is live), dapo,
beta 0, epsilon 0.2, temperature 1, constant learning rate ``LR`` tuned ONCE on-policy (``LR_PILOT`` records the
candidates and the pilot's numbers), then fixed for every method.

**Engine**: one ``rollout_func`` (:class:`Engine`) samples every run's completions and returns the engine's
log-probs, for TRL's ``GRPOTrainer`` and for this package's trainer alike, so the only difference between methods is
the loss. It samples with its own model or logits, never TRL's generation:

* ``on_policy``: the current policy (the ceiling);
* ``S0``: no mismatch (the same sampler as ``on_policy``: S0's M0 *is* the on_policy run; the cost check);
* ``S1``: a heavy-tailed precision-like gap: the policy's logits plus dense Gaussian noise (sigma ``S1_SIGMA``) and,
  at a fraction ``S1_SPIKE_P`` of positions, a spike of ``+S1_SPIKE`` on one token the policy finds unlikely
  (p < ``S1_SPIKE_BELOW``): the engine samples tokens the trainer finds very unlikely (Liu et al.'s mechanism);
  calibrated on a warmed-up model to a per-token KL(engine || policy) of ~9e-2 (T*KL ~4, the top of the
  2e-2..8e-2 / 1-4 target). Disclosed: spikes at 5% of positions (~4e-2 per token, T*KL ~1.8 measured) were
  raised to 10% after one aborted 40-step attempt on seed 0 showed on_policy 0.777 vs uncorrected 0.768; no
  method's run had been seen;
* ``S2``: staleness: the engine is the policy of ``S2_LAG`` optimizer steps ago (a copy loaded from a snapshot).

Every generation logs the exact per-token KL(engine || policy) over the vocabulary (the policy's logits from a
no-grad forward), so each run records its T*KL.

**Methods** (the pre-registered family, fixed in code before the runs): M0 no correction (this package's trainer,
preset ``disabled``); M1 TRL's default, ``sequence_mask`` C=3, by TRL's unmodified ``GRPOTrainer`` (its vLLM IS path
switched on: ``use_vllm`` set on the instance, the weight sync a no-op, the samples and log-probs from the
``rollout_func``); M2 TRL's ``token_truncate`` (C=3) by TRL's code the same way; M3 this package's
``ppo_is_bypass``; M4 IcePop as the field defines it (token weight zeroed outside [0.5, 5], token kept in the
count: verl's ``decoupled_token_icepop``); ``on_policy`` the ceiling. Family for Holm: {M0, M2, M3, M4} vs M1 in
{S1, S2}; S0: TOST of each method vs M0 with margin ``TOST_MARGIN``. A scenario counts only where on_policy vs M0 is
significant there.

**Score**: the policy's own mean reward on ``N_EVAL`` fixed held-out prompts (T = 1, a fixed sampling seed, no
mismatch), averaged over the evaluations in the last ``TAIL`` of the steps. A run "collapses" when its last
evaluation is below ``COLLAPSE_FRACTION`` of its step-0 evaluation.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
if not __package__:  # run as a script (python experiments/x.py): this checkout's root first, for experiments.*
    sys.path.insert(0, os.path.dirname(HERE))

# -------------------- pre-registration 1: experiments/preregistrations/01-mismatch-family.md
SCENARIOS = {
    "S0": "no mismatch (the cost check): the engine is the policy",
    "S1": "heavy-tailed precision-like gap: dense logit noise + rare spikes on low-probability tokens",
    "S2": "staleness: the engine is the policy of S2_LAG optimizer steps ago",
    "S2L": "S2 at a long completion: n_digits S2L_DIGITS, the policy of S2L_LAG optimizer steps ago",
    "S3": "truncated sampling: the engine samples the policy at top_p S3_TOP_P, log-probs renormalized (vLLM's)",
    "S2X": "S2 in the target regime: n_digits X_DIGITS, the policy of X_LAG optimizer steps ago",
    "S1X": "S1's heavy-tailed precision-like gap in the target regime: n_digits X_DIGITS, noise Q_NOISE",
    "S1D": "a dense precision-like gap in the target regime: n_digits X_DIGITS, N(0, sigma^2) logit noise D_NOISE",
    "S2D": "staleness and a dense precision-like gap together (an asynchronous bf16 run's mismatch), in the target "
           "regime: the policy of A_LAG optimizer steps ago sampled with S1D's noise D_NOISE, n_digits X_DIGITS",
    "S2B": "S2D with a smaller dense gap: the policy of A_LAG optimizer steps ago sampled with B_NOISE, n_digits "
           "X_DIGITS",
    "S2E": "S2B with a smaller dense gap still: the policy of A_LAG optimizer steps ago sampled with E_NOISE",
    "S2F": "S2E with a smaller dense gap still: the policy of A_LAG optimizer steps ago sampled with F_NOISE",
}
# their own completion length, base model, on_policy
LONG_SCENARIOS = ("S2L", "S2X", "S1X", "S1D", "S2D", "S2B", "S2E", "S2F")
# the target regime's length, base (X_BASE_STEPS), lr (X_LR)
XL_SCENARIOS = ("S2X", "S1X", "S1D", "S2D", "S2B", "S2E", "S2F")
STALE_SCENARIOS = ("S2", "S2L", "S2X", "S2D", "S2B", "S2E", "S2F")  # the engine is an older copy of the policy
LONG_DIGITS_KEY = {"S2L": "long_digits", "S2X": "xl_digits", "S1X": "xl_digits", "S1D": "xl_digits",
                   "S2D": "xl_digits", "S2B": "xl_digits", "S2E": "xl_digits", "S2F": "xl_digits"}  # n_digits
METHODS = {
    # name: (trainer, settings)  trainer "trl" = TRL's unmodified GRPOTrainer on its vLLM IS path, "ours" = this
    # package's RolloutCorrGRPOTrainer (settings are RolloutCorrGRPOConfig fields)
    "on_policy": ("ours", dict(rollout_correction_preset="disabled")),
    "M0": ("ours", dict(rollout_correction_preset="disabled")),
    "M1": ("trl", dict(vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_clip_max=3.0)),
    "M2": ("trl", dict(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=3.0)),
    "M3": ("ours", dict(rollout_correction_preset="ppo_is_bypass")),
    # IcePop (Ling Team, Ring-1T, arXiv:2510.18855; verl's decoupled_token_icepop): w = pi_old / pi_rollout per
    # token, zeroed outside [0.5, 5], the token kept in the loss's count
    "M4": ("ours", dict(rollout_correction_preset="icepop")),
    # TRL's default (sequence_mask, C=3) by this package's trainer (preset trl_default): package == TRL in training
    "M1p": ("ours", dict(rollout_correction_preset="trl_default")),
}
METHOD_TEXT = {
    "on_policy": "on-policy (the ceiling: the policy samples itself)",
    "M0": "no correction",
    "M1": "TRL's default: sequence_mask C=3 (TRL's GRPOTrainer)",
    "M2": "TRL's token_truncate C=3 (TRL's GRPOTrainer)",
    "M3": "ppo_is_bypass (this package)",
    "M4": "IcePop token mask [0.5, 5], kept in the count (this package)",
    "M1p": "TRL's default (sequence_mask C=3) by this package's trainer (preset trl_default)",
}
REFERENCE = "M1"  # TRL's default: every family comparison is against it
FAMILY_SCENARIOS = ("S1", "S2")
FAMILY_METHODS = ("M0", "M2", "M3", "M4")
FAMILY = tuple((s, m) for s in FAMILY_SCENARIOS for m in FAMILY_METHODS)  # Holm over these, each vs M1
COST_SCENARIO = "S0"
TOST_MARGIN = 0.02  # reward units: "no cost" in S0 = each method within +-0.02 of M0 (TOST, 90% interval)
ALPHA = 0.05
COLLAPSE_FRACTION = 0.5
HELD_OUT_SEEDS = tuple(range(10, 15))  # run only after the analysis of seeds 0-9 picked a candidate

# -------------------- pre-registration 2: experiments/preregistrations/02-c-l-h.md
CONFIRM_SEEDS = tuple(range(10, 30))
CONFIRM_FAMILY_ARMS = ("M1", "M3", "M2")  # run first, seed by seed (a partial run leaves whole paired seeds)
CONFIRM_ARMS = ("on_policy", "M0")  # run after the family arms: the cost re-check and the gap closed
CONFIRM_FAMILY = (("S2", "M3"), ("S2", "M2"))  # each - M1 (REFERENCE), Holm over these 2
C_GAP_SEEDS_0_9 = dict(diff=0.122, p=0.00025, p_sign_flip=0.0020)
S2L_DIGITS = 128
S2L_STEPS = 30
S2L_PILOT = {(8, "on_policy"): (0.0, 0.0, 0.372, 104.3, 275), (8, "M0"): (3.9e-3, 0.40, 0.393, 101.1, 231),
             (12, "M0"): (5.5e-3, 0.55, 0.390, 99.9, 395), (16, "M0"): (8.0e-3, 0.79, 0.385, 97.7, 397)}
S2L_LAG = 16  # the closest the pilot came to the target regime (outside the pre-registered 8 -> 12 rule)
LONG_SEEDS = tuple(range(30, 40))  # fresh seeds, never run in any scenario
LONG_ARMS_COST = ("on_policy", "M0")
LONG_ARMS = ("M1", "M3", "M2")  # only if the cost check counts
LONG_FAMILY = (("S2L", "M3"), ("S2L", "M2"))  # each - M1, Holm over these 2
HURT_SEEDS = tuple(range(10, 13))  # cut to 3 seeds by the budget, before any run
HURT_CELLS = (("S1", "M3"), ("S1", "M1p"), ("S2", "M1p"), ("S0", "M3"))  # run in this order
HURT_METRICS = ("grad_share_pinned", "grad_share_masked", "t_kl_mean", "t_kl_max", "t_kl_above_1_fraction",
                "k3_kl_len_0_63", "k3_kl_len_64_255")
HEALTHY_SCENARIOS, COSTLY_SCENARIOS = ("S0", "S1"), ("S2", "S2L")

# -------------------- pre-registration 3: experiments/preregistrations/03-p-truncated-sampling.md
S3_TOP_P = 0.8
S3_STEPS = 30
# (top_p, method): (per-token KL run mean, T*KL run mean, score, mean length, seconds)
S3_PILOT = {(0.9, "M0"): (7.56e-3, 0.37, 0.756, 49.0, 30), (0.8, "M0"): (8.68e-3, 0.43, 0.733, 49.0, 22)}
P_SEEDS = tuple(range(40, 50))
P_HELD_OUT = tuple(range(50, 55))
P_ARMS_COST = ("on_policy", "M0")
P_ARMS = ("M1", "M1p", "M3", "M2")
P_FAMILY = (("S3", "M1p"), ("S3", "M3"), ("S3", "M2"), ("S3", "M0"))  # each - M1, Holm over these 4
# -------------------- pre-registration 4: experiments/preregistrations/04-p-held-out.md
P_HELD_OUT_ARMS = ("on_policy", "M0")

# -------------------- pre-registration 5: experiments/preregistrations/05-x-target-regime.md
X_DIGITS = 256
X_BASE_STEPS = 400
X_BASE_STEPS_MAX = 800
X_STEPS = 30
X_LR_CANDIDATES = (1e-4, 3e-4)
X_PILOT = {(200, 1e-4, 0, "on_policy"): (0.0, 0.0, 0.061, 0.076, 188.4, 103),
           (200, 3e-4, 0, "on_policy"): (0.0, 0.0, 0.038, 0.076, 198.9, 103),
           (400, 1e-4, 0, "on_policy"): (0.0, 0.0, 0.903, 0.800, 254.8, 100),
           (400, 3e-4, 0, "on_policy"): (0.0, 0.0, 0.700, 0.800, 255.2, 100),
           (400, 1e-4, 8, "M0"): (4.03e-3, 1.03, 0.739, 0.800, 254.8, 75),
           (400, 1e-4, 12, "M0"): (4.68e-3, 1.19, 0.666, 0.800, 253.7, 77)}
X_LR = 1e-4  # set by the pilot (item 1)
X_LAG = 8  # set by the pilot (item 2)
X_SEEDS = tuple(range(60, 70))
X_HELD_OUT = tuple(range(70, 75))
X_ARMS_COST = ("on_policy", "M0")
X_ARMS = ("M1", "M3")
X_FAMILY = (("S2X", "M3"),)  # M3 - M1, Holm over this one

# -------------------- pre-registration 6: experiments/preregistrations/06-y-lag-16.md
Y_LAG = 16
Y_SEEDS = tuple(range(75, 85))
Y_HELD_OUT = tuple(range(85, 90))
Y_ARMS_COST = ("on_policy", "M0")
Y_ARMS = ("M1", "M3", "M2")
Y_FAMILY = (("S2X", "M3"), ("S2X", "M2"))  # each - M1, Holm over these 2

# -------------------- pre-registration 7: experiments/preregistrations/07-z-thirty-seeds.md
Y_GAP_SEEDS_75_84 = dict(diff=0.2623, p=0.00173, p_sign_flip=0.00195)  # Y's cost check (on_policy - M0), committed
Z_SEEDS = tuple(range(90, 120))
Z_HELD_OUT = tuple(range(120, 125))
Z_ARMS = ("M1", "M3", "M2")
Z_FAMILY = (("S2X", "M3"), ("S2X", "M2"))  # each - M1, Holm over these 2
TARGET_FAMILY = {"X": X_FAMILY, "Y": Y_FAMILY, "Z": Z_FAMILY}  # S2X's experiments: the family each one tests

# -------------------- pre-registration 8: experiments/preregistrations/08-alarm.md
# -------------------- pre-registration 9: experiments/preregistrations/09-z-negative-held-out.md
Z_NEGATIVE_HELD_OUT_ARMS = ("M1", "M2")
ALARM_KEY = "sampling/importance_sampling_ratio/mean"  # TRL 1.16's logged key
ALARM_THRESHOLD = 0.3
ALARM_CONSECUTIVE = 2
ALARM_MIN_COLLAPSES = 2
ALARM_MIN_SENSITIVITY = 0.75
ALARM_MAX_FALSE_ALARM = 0.10

# -------------------- pre-registration 10: experiments/preregistrations/10-q-heavy-tailed-gap.md
Q_PILOT = {(0.1, 0.02, 10.0, 1e-2): (2.44e-3, 0.62, 252, 0.773), (0.1, 0.04, 10.0, 1e-2): (3.55e-3, 0.89, 251, 0.753),
           (0.1, 0.06, 10.0, 1e-2): (6.19e-3, 1.54, 249, 0.706), (0.1, 0.08, 10.0, 1e-2): (7.91e-3, 1.96, 248, 0.691),
           (1.0, 0.0, 0.0, 1e-2): (4.41e-3, 1.08, 245, 0.655), (1.5, 0.0, 0.0, 1e-2): (2.34e-2, 5.25, 224, 0.389)}
Q_KL_TARGET = 8e-3
Q_NOISE = min(Q_PILOT, key=lambda k: abs(Q_PILOT[k][0] - Q_KL_TARGET))  # (0.1, 0.08, 10.0, 1e-2)
Q_SEEDS = tuple(range(125, 135))
Q_HELD_OUT = tuple(range(135, 140))
Q_ARMS = ("on_policy", "M0", "M1", "M3", "M2")
Q_FAMILY = (("S1X", "M3"), ("S1X", "M2"), ("S1X", "M0"))  # each - M1, Holm over these 3

# -------------------- pre-registration 11: experiments/preregistrations/11-d-dense-gap.md
D_PILOT = {(1.0, 0.0, 0.0, 1e-2): (4.41e-3, 1.08, 245, 0.655), (1.1, 0.0, 0.0, 1e-2): (6.28e-3, 1.54, 245, 0.618),
           (1.2, 0.0, 0.0, 1e-2): (8.85e-3, 2.17, 245, 0.586), (1.3, 0.0, 0.0, 1e-2): (1.24e-2, 2.96, 239, 0.520),
           (1.4, 0.0, 0.0, 1e-2): (1.71e-2, 4.05, 237, 0.470), (1.5, 0.0, 0.0, 1e-2): (2.34e-2, 5.25, 224, 0.389)}
D_NOISE = min(D_PILOT, key=lambda k: abs(D_PILOT[k][0] - Q_KL_TARGET))  # (1.2, 0.0, 0.0, 1e-2)
D_SEEDS = tuple(range(140, 150))
D_HELD_OUT = tuple(range(150, 155))
D_FAMILY = (("S1D", "M3"), ("S1D", "M2"), ("S1D", "M0"))  # each - M1, Holm over these 3
# -------------------- pre-registration 12: experiments/preregistrations/12-d-negative-held-out.md
D_NEGATIVE_HELD_OUT_ARMS = ("M1", "M3", "M2")
PRECISION_EXPERIMENTS = {  # experiment -> (scenario, family, seeds, held-out seeds): pre-registrations 10 and 11
    "Q": ("S1X", Q_FAMILY, Q_SEEDS, Q_HELD_OUT), "D": ("S1D", D_FAMILY, D_SEEDS, D_HELD_OUT)}
# -------------------- pre-registration 13: experiments/preregistrations/13-a-stale-and-dense.md
A_LAG = 4
A_SEEDS = tuple(range(155, 165))
A_HELD_OUT = tuple(range(165, 170))
A_ARMS = ("on_policy", "M0", "M1", "M3", "M2")
A_FAMILY = (("S2D", "M3"), ("S2D", "M2"), ("S2D", "M0"))  # each - M1, Holm over these 3
FAMILY_EXPERIMENTS = {**PRECISION_EXPERIMENTS, "A": ("S2D", A_FAMILY, A_SEEDS, A_HELD_OUT)}
# -------------------- pre-registration 14: experiments/preregistrations/14-alarm-pool.md
# -------------------- pre-registration 15: experiments/preregistrations/15-b-smaller-gap.md
B_NOISE = (1.0, 0.0, 0.0, 1e-2)
B_SEEDS = tuple(range(170, 180))
B_HELD_OUT = tuple(range(180, 185))
B_FAMILY = (("S2B", "M3"),)  # M3 - M1
# -------------------- pre-registration 16: experiments/preregistrations/16-e-f-gap-ladder.md
E_PILOT = {(1.0, 0.0, 0.0, 1e-2): (4.41e-3, 1.08, 245, 0.655), (0.9, 0.0, 0.0, 1e-2): (3.02e-3, 0.74, 246, 0.675),
           (0.8, 0.0, 0.0, 1e-2): (2.05e-3, 0.50, 247, 0.685), (0.7, 0.0, 0.0, 1e-2): (1.37e-3, 0.34, 248, 0.721),
           (0.6, 0.0, 0.0, 1e-2): (8.69e-4, 0.22, 249, 0.744)}
E_NOISE = (0.8, 0.0, 0.0, 1e-2)
E_SEEDS = tuple(range(185, 195))
E_HELD_OUT = tuple(range(195, 200))
F_NOISE = (0.6, 0.0, 0.0, 1e-2)
F_SEEDS = tuple(range(200, 210))
F_HELD_OUT = tuple(range(210, 215))
GAP_LADDER = {  # experiment -> (scenario, noise, seeds, held-out seeds): A's engine at smaller gaps, M3 - M1 only
    "B": ("S2B", B_NOISE, B_SEEDS, B_HELD_OUT), "E": ("S2E", E_NOISE, E_SEEDS, E_HELD_OUT),
    "F": ("S2F", F_NOISE, F_SEEDS, F_HELD_OUT)}
LADDER_NOISE = {scenario: noise for scenario, noise, _, _ in GAP_LADDER.values()}
SIGNED_HELD_OUT = ("A", *GAP_LADDER)
HELD_OUT_EXPERIMENTS = {**FAMILY_EXPERIMENTS, **{name: (scenario, ((scenario, "M3"),), seeds, held_out)
                                                for name, (scenario, _, seeds, held_out) in GAP_LADDER.items()}}
ALARM_POOL = (("S2X", "Z", Z_SEEDS), ("S2X", "Z held-out", Z_HELD_OUT), ("S1X", "Q", Q_SEEDS),
              ("S1D", "D", D_SEEDS), ("S1D", "D held-out", D_HELD_OUT), ("S2D", "A", A_SEEDS),
              ("S2D", "A held-out", A_HELD_OUT))

# ------------------------------------------------------------------------------------------------ run settings
HIDDEN, LAYERS, HEADS = 96, 3, 4
BASE_STEPS, BASE_LR, BASE_SEED = 200, 2e-3, 12345
WARMUP_STEPS, WARMUP_LR = 10, 5e-4
GEN_PROMPTS, NUM_GENERATIONS, STEPS_PER_GENERATION = 4, 8, 2
LR = 1e-4
# The learning-rate pilot, run ONCE on-policy (seed 99, outside every analysed seed; 2026-11-26, 2-core CPU shared
# with other work): the policy's held-out reward at step 0 -> the score (mean of the evaluations in the last 30%).
# Base model after 150 supervised steps (reward 0.17 after the warm-up), 60 steps: lr 3e-4 0.174 -> 0.140,
# lr 1e-3 0.174 -> 0.040 (collapse); 40 steps: lr 1e-4 0.174 -> 0.158. Nothing learned from that base, so the base
# moved to 200 steps (reward 0.70 after the warm-up), 40 steps: lr 1e-4 0.702 -> 0.777, lr 3e-4 0.702 -> 0.684 (a dip
# to 0.54 at step 20). Chosen: lr 1e-4, base 200 steps, 40 steps, for every method.
LR_PILOT = {(150, 60, 3e-4): (0.174, 0.140), (150, 60, 1e-3): (0.174, 0.040), (150, 40, 1e-4): (0.174, 0.158),
            (200, 40, 1e-4): (0.702, 0.777), (200, 40, 3e-4): (0.702, 0.684)}  # (base steps, steps, lr): (start, score)
N_EVAL, EVAL_EVERY, TAIL, TAIL_EVAL_EVERY = 64, 10, 0.3, 3  # evaluations every 10 steps, every 3 in the tail
S1_SIGMA, S1_SPIKE_P, S1_SPIKE, S1_SPIKE_BELOW = 0.1, 0.1, 10.0, 1e-2
S2_LAG = 8
# GPU sizes (issue 36 item 5: "the same benchmark runs on a GPU from the same command"): ``--size gpu --device
# cuda``. Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864, tied embeddings, rope theta
# 1e6; random weights, built locally) over the task's vocabulary plus never-used words up to GPU_VOCAB (not
# 151,936: the engine keeps its (B, T, V) log-softmax for the exact KL, 32 x 4096 x 4352 floats = 2.3 GB at T =
# 4096), trained with bf16 autocast (fp32 master weights, TRL's bf16=True) and sampled under the same autocast;
# T = n_digits + 1 = 512 (``--n_digits 1023 / 2047 / 4095`` for T = 1024 / 2048 / 4096; S2L's long length 2047).
# No run has finished on a GPU yet (a first try on an H200, 2026-11-27, built the base model: docs/benchmarks.md,
# "The same command on a GPU"): its learning rates are placeholders that the
# LR_PILOT rule must re-tune once on-policy (``--lr``) before a family runs, and its base model's recipe
# (GPU_BASE_STEPS at GPU_BASE_LR) is untested.
GPU_VOCAB = 4352
GPU_SIZE = dict(hidden=896, layers=24, heads=14, n_digits=511, long_digits=2047, xl_digits=4095, base_steps=300,
                xl_base_steps=300, warmup_steps=10, n_eval=64, eval_every=10, base_lr=3e-4, warmup_lr=1e-5,
                device="cuda", bf16=True,
                shape=dict(num_key_value_heads=2, intermediate_size=4864, vocab_size=GPU_VOCAB,
                           tie_word_embeddings=True, rope_theta=1e6))
GPU_LR = 1e-6
SMOKE = dict(hidden=32, layers=1, heads=2, n_digits=6, base_steps=3, warmup_steps=1, n_eval=8, eval_every=1,
             steps=2, long_digits=8, xl_digits=10, xl_base_steps=4)


def full_size() -> dict:
    """The CPU size of every run (``--size full``); a scenario's length comes from :func:`cell_size`."""
    return dict(hidden=HIDDEN, layers=LAYERS, heads=HEADS, n_digits=48, base_steps=BASE_STEPS,
                warmup_steps=WARMUP_STEPS, n_eval=N_EVAL, eval_every=EVAL_EVERY, long_digits=S2L_DIGITS,
                xl_digits=X_DIGITS, xl_base_steps=X_BASE_STEPS)


def _stats():
    from experiments import stats

    return stats


# ------------------------------------------------------------------------------------------------ sampling engine
BF16 = False  # set from the size in each run's process: forwards under bf16 autocast, as TRL's bf16=True trains


def autocast(model):
    """The forward's precision context: bf16 autocast on the model's device when ``BF16`` (the GPU size), else none."""
    import torch

    return torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=BF16)


@contextlib.contextmanager
def checkpointed(model, size: dict):
    """Gradient checkpointing (non-reentrant) around a supervised loop off the CPU (``size["checkpointing"]``
    overrides): measured on an H200 (2026-11-27), the GPU size's base build (batch 64 x 1,026 tokens, no
    checkpointing) held ~114 GB (nvidia-smi), more than an H100's 80 GB; the GRPO runs check-point through TRL's own
    ``gradient_checkpointing``. Numerically the same update either way (recomputed activations; equal within float
    tolerance on CPU)."""
    on = size.get("checkpointing", size.get("device", "cpu") != "cpu")
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        yield model
    finally:
        if on:
            model.gradient_checkpointing_disable()


def task_tokenizer(size: dict):
    """The task's tokenizer, its vocabulary padded to the size's model (the GPU size's longer tail)."""
    from trl_rollout_corr.testing.psum_task import build_tokenizer

    return build_tokenizer(size.get("shape", {}).get("vocab_size"))


def task_model(size: dict, n_digits: int):
    """A fresh model of the size (weights of seed ``BASE_SEED``) on the size's device."""
    from trl_rollout_corr.testing.psum_task import build_model

    model = build_model(size["hidden"], size["layers"], seed=BASE_SEED, num_heads=size["heads"], n_digits=n_digits,
                        **size.get("shape", {}))
    return model.to(size.get("device", "cpu"))


def sample(model, prompt_ids, max_new: int, generator, perturb=None):
    """Autoregressive sampling with a KV cache from ``model`` (logits optionally perturbed by
    ``perturb(logits, generator)``), at temperature 1, stopping a row at EOS.

    Returns ``(completions, logps, engine_logps, kl)``: the token ids per row (EOS included), the sampler's log-prob
    of each sampled token, the sampler's log-softmax at each position (B, T, V), and the exact per-position
    KL(perturbed || unperturbed) over the vocabulary (B, T; zeros without ``perturb``)."""
    import torch

    from trl_rollout_corr.testing.psum_task import EOS_ID, PAD_ID

    batch = prompt_ids.shape[0]
    prompt_ids = prompt_ids.to(model.device)
    with torch.no_grad(), autocast(model):
        out = model(input_ids=prompt_ids, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1].float()
        done = torch.zeros(batch, dtype=torch.bool, device=model.device)
        tokens, logps, dists, kls = [], [], [], []
        for _ in range(max_new):
            logq = torch.log_softmax(perturb(logits, generator) if perturb is not None else logits, -1)  # (B, V)
            if perturb is not None:  # q log(q / p) with 0 log 0 = 0 (a truncating perturbation zeroes tokens)
                q = logq.exp()
                kls.append(torch.where(q > 0, q * (logq - torch.log_softmax(logits, -1)), 0.0).sum(-1))  # (B,)
            y = torch.multinomial(logq.exp(), 1, generator=generator).squeeze(-1)
            y = torch.where(done, torch.full_like(y, PAD_ID), y)
            tokens.append(y)
            logps.append(logq.gather(-1, y[:, None]).squeeze(-1))
            dists.append(logq)
            done = done | (y == EOS_ID)
            if bool(done.all()):
                break
            out = model(input_ids=y[:, None], past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1].float()
    tok, lp = torch.stack(tokens, 1), torch.stack(logps, 1)
    completions, logprobs = [], []
    for row in range(batch):
        ids = tok[row].tolist()
        n = ids.index(EOS_ID) + 1 if EOS_ID in ids else len(ids)
        completions.append(ids[:n])
        logprobs.append(lp[row, :n].tolist())
    kl = torch.stack(kls, 1) if kls else torch.zeros(batch, len(tokens), device=model.device)
    return completions, logprobs, torch.stack(dists, 1), kl


def top_p_truncation(top_p: float):
    """S3's engine processing of a batch of logits (B, V): top-p (nucleus) truncation as transformers' and vLLM's
    samplers do it: sort ascending, remove the tokens whose cumulative probability is <= 1 - top_p, always keep the
    most likely one; removed tokens get -inf, so the log-softmax is log p - log M over the kept set (M = kept mass)
    and the exact KL(engine || policy) per position is -log M. The main job's rule
    (:func:`trl_rollout_corr.demo.task.top_p_truncation`), as ``perturb(logits, generator)``."""
    from trl_rollout_corr.demo.task import top_p_truncation as truncation

    truncate = truncation(top_p)
    return lambda logits, generator: truncate(logits)  # (B, V) -> (B, V)


def top_k_truncation(top_k: int):
    """Top-k truncation of a batch of logits (B, V) as vLLM's sampler does it: every token outside the ``top_k``
    largest logits gets -inf (a tie at the k-th logit keeps every tied token, as vLLM's threshold does), so the
    log-softmax is log p - log M over the kept set and the exact KL(engine || policy) per position is -log M."""
    import torch

    def perturb(logits, generator):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1) the k-th largest logit
        return logits.masked_fill(logits < kth, float("-inf"))  # (B, V)

    return perturb


def min_p_truncation(min_p: float):
    """Min-p truncation of a batch of logits (B, V) as vLLM's sampler does it: every token whose probability is below
    ``min_p`` times the most likely token's gets -inf, so the log-softmax is log p - log M over the kept set and the
    exact KL(engine || policy) per position is -log M."""
    import torch

    def perturb(logits, generator):
        probs = torch.softmax(logits, -1)  # (B, V)
        return logits.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))  # (B, V)

    return perturb


def heavy_tailed(sigma: float, spike_p: float, spike: float, below: float):
    """S1's perturbation of a batch of logits (B, V): dense N(0, sigma^2) noise on every logit, and at a fraction
    ``spike_p`` of rows a ``+spike`` on one token drawn uniformly among those the unperturbed distribution gives
    probability < ``below`` (the low-probability tail)."""
    import torch

    def perturb(logits, generator):
        noisy = logits + sigma * torch.randn(logits.shape, generator=generator, device=logits.device)
        p = torch.softmax(logits, -1)
        rows = torch.rand(logits.shape[0], generator=generator, device=logits.device) < spike_p
        if bool(rows.any()):
            tail = (p < below).float() + 1e-12
            pick = torch.multinomial(tail, 1, generator=generator).squeeze(-1)
            bump = torch.zeros_like(noisy)
            bump[torch.arange(len(pick)), pick] = spike
            noisy = noisy + bump * rows[:, None]
        return noisy

    return perturb


class Engine:
    """The ``rollout_func`` of every run: samples with the scenario's engine, returns TRL's dict (``prompt_ids``,
    ``completion_ids``, ``logprobs``: the engine's own log-probs), and records per generation the exact per-token
    KL(engine || policy), its sequence sum (T*KL) and the engine's sample reward."""

    def __init__(self, scenario: str, seed: int, tokenizer, policy_factory, n_digits: int, lag: int = S2_LAG,
                 noise: tuple = (S1_SIGMA, S1_SPIKE_P, S1_SPIKE, S1_SPIKE_BELOW)):
        self.scenario, self.tok, self.n_digits, self.lag = scenario, tokenizer, n_digits, lag
        self.seed, self.generator = 1_000_003 * seed + 17, None  # the generator lives on the policy's device
        self.perturb = (heavy_tailed(*noise) if scenario == "S1" else heavy_tailed(*Q_NOISE) if scenario == "S1X" else
                        heavy_tailed(*D_NOISE) if scenario in ("S1D", "S2D") else
                        heavy_tailed(*LADDER_NOISE[scenario]) if scenario in LADDER_NOISE else
                        top_p_truncation(S3_TOP_P) if scenario == "S3" else None)
        self.stale = policy_factory() if scenario in STALE_SCENARIOS else None
        self.snapshots: dict[int, dict] = {}
        self.log: list[dict] = []

    def __call__(self, prompts, trainer):
        import torch

        from trl_rollout_corr.testing.psum_task import psum_reward

        policy = trainer.model
        step = trainer.state.global_step
        was_training = policy.training
        policy.eval()
        prompt_ids = [self.tok.convert_tokens_to_ids(p.split()) for p in prompts]
        ids = torch.tensor(prompt_ids, device=policy.device)
        if self.generator is None:
            self.generator = torch.Generator(device=policy.device).manual_seed(self.seed)
        sampler = policy
        if self.stale is not None:  # the policy of `lag` optimizer steps ago (the oldest kept before that)
            self.snapshots[step] = {k: v.detach().clone() for k, v in policy.state_dict().items()}
            for old in [s for s in self.snapshots if s < step - self.lag]:
                del self.snapshots[old]
            self.stale.load_state_dict(self.snapshots[min(self.snapshots)])
            sampler = self.stale
        completions, logprobs, logq, kl = sample(sampler, ids, self.n_digits + 1, self.generator, self.perturb)
        # the exact per-token KL(engine || policy) over the vocabulary: S1's and S3's from the unperturbed logits of
        # the same forward, S2's from a no-grad forward of the policy, S0's is 0 (the engine is the policy)
        width = logq.shape[1]
        mask = torch.zeros(len(prompts), width, device=logq.device)
        for row, c in enumerate(completions):
            mask[row, : len(c)] = 1
        if self.stale is not None:
            with torch.no_grad(), autocast(policy):
                full = torch.zeros(len(prompts), ids.shape[1] + width, dtype=torch.long, device=ids.device)
                full[:, : ids.shape[1]] = ids
                for row, c in enumerate(completions):
                    full[row, ids.shape[1]: ids.shape[1] + len(c)] = torch.tensor(c, device=ids.device)
                logp = torch.log_softmax(policy(input_ids=full).logits[:, ids.shape[1] - 1: -1].float(), -1)
                kl = (logq.exp() * (logq - logp)).sum(-1)
        kl = kl * mask  # (B, T)
        texts = [" ".join(self.tok.convert_ids_to_tokens(c)) for c in completions]
        self.log.append(dict(step=step, kl_token=float(kl.sum() / mask.sum()), t_kl=float(kl.sum(-1).mean()),
                             length=float(mask.sum(-1).mean()),
                             engine_reward=statistics.fmean(psum_reward(prompts, texts))))
        policy.train(was_training)
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": logprobs}


# ------------------------------------------------------------------------------------------------ one run
def policy_reward(model, tokenizer, prompts, n_digits: int, seed: int = 1234, perturb=None) -> float:
    """The policy's own mean reward on ``prompts``: sampled at T = 1 with a fixed seed (no mismatch; ``perturb``: the
    logits processed first, e.g. :func:`top_p_truncation` to score the policy as a top-p sampler serves it)."""
    import torch

    from trl_rollout_corr.testing.psum_task import psum_reward

    was_training = model.training
    model.eval()
    ids = torch.tensor([tokenizer.convert_tokens_to_ids(p.split()) for p in prompts], device=model.device)
    completions, _, _, _ = sample(model, ids, n_digits + 1, torch.Generator(device=model.device).manual_seed(seed),
                                  perturb)
    model.train(was_training)
    return statistics.fmean(psum_reward(prompts, [" ".join(tokenizer.convert_ids_to_tokens(c))
                                                  for c in completions]))


def base_model_path(out: str, n_digits: int | None = None, steps: int | None = None) -> str:
    """The shared base model of ``out``; a long scenario's (``n_digits`` given) is its own, pre-trained at its
    length; one trained longer than the recipe's ``BASE_STEPS`` (``steps``) is named by its steps."""
    name = "base" if n_digits is None else f"base_n{n_digits}"
    return os.path.join(out, "base", f"{name}_s{steps}.pt" if steps else f"{name}.pt")


def cell_size(scenario: str, size: dict) -> dict:
    """The sizes of one scenario's runs: a long scenario's completion length replaces ``n_digits``."""
    if scenario in LONG_SCENARIOS:
        out = {**size, "n_digits": size[LONG_DIGITS_KEY[scenario]]}
        if scenario in XL_SCENARIOS and size.get("xl_base_steps", size["base_steps"]) > size["base_steps"]:
            out.update(base_steps=size["xl_base_steps"], base_from=size["base_steps"])  # deviation 1
        return out
    return size


def cell_base(out: str, scenario: str, size: dict) -> str:
    if scenario not in LONG_SCENARIOS:
        return base_model_path(out)
    longer = cell_size(scenario, size).get("base_from")
    return base_model_path(out, size[LONG_DIGITS_KEY[scenario]], cell_size(scenario, size)["base_steps"] if longer
                           else None)


def scenario_lr(scenario: str, lr: float | None, size_name: str = "full") -> float:
    """The learning rate of ``scenario``'s runs: ``lr`` when given (``--lr``), else the one tuned on-policy for its
    length (``X_LR`` for S2X and S1X, ``LR`` otherwise; ``GPU_LR`` at the GPU size)."""
    if lr is not None:
        return lr
    if size_name == "gpu":
        return GPU_LR
    return X_LR if scenario in XL_SCENARIOS else LR


def scenario_lag(scenario: str) -> int:
    """The stale engine's lag (optimizer steps) in ``scenario``."""
    return {"S2L": S2L_LAG, "S2X": X_LAG, "S2D": A_LAG, **dict.fromkeys(LADDER_NOISE, A_LAG)}.get(scenario, S2_LAG)


def pretrain_base(size: dict, init: str | None = None, start: int = 0):
    """The shared pre-trained model: ``base_steps`` AdamW steps (lr ``BASE_LR``, gradient norm clipped at 1) of
    teacher forcing on fresh batches of 64 (data seed 10**6 + step), from the weights of seed ``BASE_SEED``, one
    thread (deterministic). At 200 steps it sits just past the task's sudden drop in loss (at ~150 steps):
    teacher-forced per-token accuracy 0.99, the policy's own sampled reward ~0.64 (~0.70 after a seed's warm-up),
    leaving GRPO room to climb. ``init``/``start``: continue a checkpoint of ``start`` steps of the same recipe (a
    fresh AdamW, the data stream continued at step ``start``): S2X's longer base (pre-registration 5, deviation 1)."""
    import torch

    global BF16
    BF16 = size.get("bf16", False)
    n = size["n_digits"]
    tok = task_tokenizer(size)
    model = task_model(size, n)
    if init is not None:
        model.load_state_dict(torch.load(init, map_location=model.device))
    opt = torch.optim.AdamW(model.parameters(), lr=size.get("base_lr", BASE_LR))
    model.train()
    with checkpointed(model, size):
        _teacher_force(model, tok, opt, size, n, start)
    model.eval()
    return model


def _teacher_force(model, tok, opt, size: dict, n: int, start: int) -> None:
    """:func:`pretrain_base`'s loop: steps ``start`` .. ``base_steps`` - 1 of teacher forcing."""
    import torch

    from trl_rollout_corr.testing.psum_task import psum_prompts, psum_target

    for step in range(start, size["base_steps"]):
        prompts = psum_prompts(size.get("base_batch", 64), n, seed=10**6 + step)
        ids = torch.tensor([tok.convert_tokens_to_ids((p + " " + " ".join(psum_target(p)) + " <eos>").split())
                            for p in prompts], device=model.device)  # (64, 2n + 3)
        labels = ids.clone()
        labels[:, : n + 2] = -100  # learn the answer only
        with autocast(model):
            loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()


def in_child(fn, *args, fork: bool = True) -> None:
    """Run ``fn(*args)`` in a forked child and wait (on a GPU: the driver then never initializes CUDA, which a
    forked run could not re-initialize); in this process when ``fork`` is False."""
    if not fork:
        fn(*args)
        return
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fn(*args)
            code = 0
        except SystemExit as stop:  # a clean exit stays one
            code = 0 if stop.code in (None, 0) else 1
        except BaseException:  # os._exit below would swallow it: print it first
            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} failed in its child process (see its traceback above)")


def cuda_available_in_child() -> bool:
    """``torch.cuda.is_available()`` asked in a forked child: asked here it would initialize the CUDA driver
    (``cudaGetDeviceCount``; torch's "poison fork"), and every forked child of this process (the base model's build,
    each run) would then fail at its first CUDA call (measured on an H200, 2026-11-27: the base build failed)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)  # the real check (cuInit): this child may init CUDA
            import torch

            code = 0 if torch.cuda.is_available() else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def build_base(out: str, size: dict, path: str | None = None) -> str:
    """The shared pre-trained checkpoint (:func:`pretrain_base`), built once per output folder (and length)."""
    import torch

    path = path or base_model_path(out)
    if os.path.exists(path):
        return path
    init, start = None, 0
    if size.get("base_from"):  # a longer base continues the shorter one of the same recipe (built first if missing)
        start = size["base_from"]
        shorter = {**size, "base_steps": start, "base_from": None}
        init = build_base(out, shorter, base_model_path(out, size["n_digits"]))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.set_num_threads(1)
    t0 = time.time()
    model = pretrain_base(size, init, start)
    torch.save(model.state_dict(), path + ".tmp")
    os.replace(path + ".tmp", path)
    print(f"base model: {size['base_steps']} supervised steps, {time.time() - t0:.0f} s -> {path}", flush=True)
    return path


def run_path(out: str, scenario: str, method: str, seed: int) -> str:
    """S0's M0 is the on_policy run (the same sampler, the same loss); on_policy is shared by every scenario of the
    same length (a long scenario has its own)."""
    if method == "on_policy" or (scenario == COST_SCENARIO and method == "M0"):
        scenario, method = (scenario if scenario in LONG_SCENARIOS else "all"), "on_policy"
    return os.path.join(out, "runs", f"{scenario}__{method}__seed{seed}.json")


def build_trainer(method: str, model, tokenizer, engine, dataset, args_fields: dict, callbacks):
    """TRL's unmodified GRPOTrainer on its vLLM IS path (M1, M2), or this package's trainer (the others), both fed
    by ``engine``."""
    kind, settings = METHODS[method]
    from trl_rollout_corr.testing.psum_task import psum_reward

    if kind == "trl":
        from types import SimpleNamespace

        from trl import GRPOConfig, GRPOTrainer

        args = GRPOConfig(**args_fields, vllm_importance_sampling_correction=True, **settings)
        trainer = GRPOTrainer(model=model, reward_funcs=psum_reward, args=args, train_dataset=dataset,
                              processing_class=tokenizer, rollout_func=engine, callbacks=callbacks)
        # TRL applies its correction only on its vLLM path: switch it on; the engine is the rollout_func, so the only
        # vLLM call left, the weight sync, is a no-op (as tests/config/test_trl_modes.py and benchmarks/bench_step.py
        # do)
        trainer.use_vllm = True
        trainer.vllm_importance_sampling_correction = True
        trainer.vllm_generation = SimpleNamespace(sync_weights=lambda: None)
        trainer._last_loaded_step = -1
        return trainer
    from trl_rollout_corr import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

    args = RolloutCorrGRPOConfig(**args_fields, **settings)
    return RolloutCorrGRPOTrainer(model=model, reward_funcs=psum_reward, args=args, train_dataset=dataset,
                                  processing_class=tokenizer, rollout_func=engine, callbacks=callbacks)


def grpo_fields(output_dir: str, steps: int, n_digits: int, lr: float, seed: int, top_p: float = 1.0,
                device: str = "cpu", bf16: bool = False) -> dict:
    """The GRPO settings every method shares (GRPOConfig / RolloutCorrGRPOConfig fields); ``top_p`` is the engine's
    (S3), set as a user would set it for their vLLM."""
    per_step = GEN_PROMPTS * NUM_GENERATIONS // STEPS_PER_GENERATION
    return dict(output_dir=output_dir, per_device_train_batch_size=per_step, gradient_accumulation_steps=1,
                steps_per_generation=STEPS_PER_GENERATION, num_generations=NUM_GENERATIONS,
                max_completion_length=n_digits + 1, max_steps=steps, learning_rate=lr, lr_scheduler_type="constant",
                warmup_steps=0, adam_beta2=0.99, max_grad_norm=1.0, loss_type="dapo", beta=0.0, epsilon=0.2,
                temperature=1.0, top_p=top_p, logging_steps=1, save_strategy="no", report_to="none",
                use_cpu=device == "cpu", bf16=bf16, gradient_checkpointing=device != "cpu", seed=seed,
                disable_tqdm=True, dataloader_num_workers=0)


def hurt_summary(logs: list[dict]) -> dict:
    """Experiment H: each "does it hurt?" metric's mean and max over a run's logged steps (``rollout_corr/<name>``,
    logged by this package's trainer only; absent -> NaN, a bucket without tokens is not logged at that step)."""
    from trl_rollout_corr.core.metric_names import metric

    out = {}
    for name in HURT_METRICS:
        values = [row[metric(name)] for row in logs if metric(name) in row and math.isfinite(row[metric(name)])]
        out[f"{name}_mean"] = statistics.fmean(values) if values else math.nan
        out[f"{name}_max"] = max(values) if values else math.nan
    return out


def warm_model(model, tok, base: str, size: dict, seed: int):
    """``model`` with seed ``seed``'s warm-up of ``base`` loaded: ``warmup_steps`` supervised steps from ``base``
    (torch seed ``seed``), computed once per seed and base and saved beside it (shared by the seed's runs)."""
    import torch

    from trl_rollout_corr.testing.psum_task import supervised_warmup

    device = size.get("device", "cpu")
    stem = os.path.basename(base)[len("base_"):-len(".pt")] + "_" if os.path.basename(base) != "base.pt" else ""
    warm = os.path.join(os.path.dirname(base), f"warmup_{stem}seed{seed}.pt")
    if os.path.exists(warm):
        model.load_state_dict(torch.load(warm, map_location=device))
        return model
    model.load_state_dict(torch.load(base, map_location=device))
    torch.manual_seed(seed)
    with autocast(model), checkpointed(model, size):
        supervised_warmup(model, tok, steps=size["warmup_steps"], lr=size.get("warmup_lr", WARMUP_LR),
                          n_digits=size["n_digits"], seed=seed + 1)
    torch.save(model.state_dict(), f"{warm}.{os.getpid()}.tmp")
    os.replace(f"{warm}.{os.getpid()}.tmp", warm)
    return model


def noise_pilot(out: str, size: dict, levels: tuple | None = None, seed: int = 99, n_prompts: int = 128) -> dict:
    """Q_PILOT's and D_PILOT's calibrations (pre-registrations 10, 11; ``levels`` None: every level of both), no
    training: per noise level (sigma, spike_p, spike, below) of :func:`heavy_tailed`, one batch of ``n_prompts``
    prompts (psum_prompts seed 4242) sampled from seed ``seed``'s warm-up of S1X's base model with generator seed 7
    -> (per-token KL(engine || policy), T*KL, mean length, the engine's sample reward)."""
    import torch

    from trl_rollout_corr.testing.psum_task import psum_prompts, psum_reward

    levels = tuple(dict.fromkeys([*Q_PILOT, *D_PILOT])) if levels is None else levels
    size = cell_size("S1X", size)
    tok = task_tokenizer(size)
    model = warm_model(task_model(size, size["n_digits"]), tok, cell_base(out, "S1X", size), size, seed).eval()
    prompts = psum_prompts(n_prompts, size["n_digits"], seed=4242)
    ids = torch.tensor([tok.convert_tokens_to_ids(p.split()) for p in prompts], device=model.device)
    found = {}
    for level in levels:
        completions, _, _, kl = sample(model, ids, size["n_digits"] + 1,
                                       torch.Generator(device=model.device).manual_seed(7), heavy_tailed(*level))
        mask = torch.zeros_like(kl)  # (B, T)
        for row, c in enumerate(completions):
            mask[row, : len(c)] = 1
        reward = statistics.fmean(psum_reward(prompts, [" ".join(tok.convert_ids_to_tokens(c)) for c in completions]))
        found[level] = (float((kl * mask).sum() / mask.sum()), float((kl * mask).sum(-1).mean()),
                        float(mask.sum(-1).mean()), reward)
        print(level, "per-token KL {:.2e}  T*KL {:.2f}  length {:.0f}  engine reward {:.3f}".format(*found[level]),
              flush=True)
    return found


def run_one(scenario: str, method: str, seed: int, steps: int, out_path: str, base: str, size: dict,
            lr: float = LR, threads: int = 1) -> dict:
    """Train one (scenario, method, seed) and write its JSON."""
    import tempfile

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging

    from trl_rollout_corr.testing.psum_task import psum_prompts

    global BF16
    BF16 = size.get("bf16", False)
    device = size.get("device", "cpu")
    torch.set_num_threads(threads)
    hf_logging.set_verbosity_error()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    t0 = time.time()
    n_digits = size["n_digits"]
    tok = task_tokenizer(size)

    def factory():
        return task_model(size, n_digits)

    model = warm_model(factory(), tok, base, size, seed)
    held_out = psum_prompts(size["n_eval"], n_digits, seed=777_777)  # fixed across seeds and methods
    curve = [(0, policy_reward(model, tok, held_out, n_digits))]
    logs: list[dict] = []
    eval_every = size["eval_every"]

    class Recorder(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            tail_step = state.global_step >= (1 - TAIL) * steps and state.global_step % TAIL_EVAL_EVERY == 0
            if state.global_step % eval_every == 0 or tail_step or state.global_step == steps:
                curve.append((state.global_step, policy_reward(model, tok, held_out, n_digits)))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                logs_list.append({"step": state.global_step,
                                  **{k: v for k, v in logs.items() if isinstance(v, (int, float))}})

    logs_list = logs
    engine_scenario = "S0" if method == "on_policy" else scenario
    engine = Engine(engine_scenario, seed, tok, factory, n_digits,
                    lag=scenario_lag(scenario))
    with tempfile.TemporaryDirectory() as tmp:
        fields = grpo_fields(tmp, steps, n_digits, lr, seed, top_p=S3_TOP_P if engine_scenario == "S3" else 1.0,
                             device=device, bf16=BF16)
        dataset = Dataset.from_dict({"prompt": psum_prompts(steps * GEN_PROMPTS + 64, n_digits, seed=seed)})
        trainer = build_trainer(method, model, tok, engine, dataset, fields, [Recorder()])
        trainer.train()
    tail = [r for s, r in curve if s >= (1 - TAIL) * steps and s > 0]
    pool = (scenario if scenario in LONG_SCENARIOS else "all") if method == "on_policy" else scenario
    result = dict(scenario=scenario, method=method, seed=seed, steps=steps, lr=lr, trainer=METHODS[method][0],
                  pool=pool, n_digits=n_digits, lag=engine.lag if engine.stale is not None else 0,
                  top_p=fields["top_p"],
                  score=statistics.fmean(tail), curve=curve, initial=curve[0][1], final=curve[-1][1],
                  collapsed=curve[-1][1] < COLLAPSE_FRACTION * curve[0][1],
                  kl_token=statistics.fmean(g["kl_token"] for g in engine.log),
                  t_kl=statistics.fmean(g["t_kl"] for g in engine.log),
                  engine_reward=statistics.fmean(g["engine_reward"] for g in engine.log),
                  generations=engine.log, logs=logs, seconds=time.time() - t0, **hurt_summary(logs))
    return save_run(result, out_path) if out_path else result


def save_run(result: dict, out_path: str) -> dict:
    """Write one run's JSON atomically (a temporary file, then a rename: a killed run leaves no half file that a
    resumed command would skip) and return ``result``."""
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out_path + ".tmp", out_path)
    return result


# ------------------------------------------------------------------------------------------------ the driver
def cells(scenarios, methods, seeds, on_policy: bool = True) -> list[tuple[str, str, int]]:
    """Every (scenario, method, seed) to run: scenario by scenario in the order given, seed by seed within one (a
    partial run leaves whole paired comparisons); on_policy once per seed (shared by the scenarios of one length),
    unless ``on_policy`` is False."""
    out = []
    for scenario in scenarios:
        for seed in seeds:
            for method in (["on_policy"] if on_policy else []) + list(methods):
                out.append((scenario, method, seed))
    return out


RUN_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "TRL_ROLLOUT_CORR_NO_VLLM": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}


def run_all(todo_cells, steps: int, out: str, jobs: int, size: dict, lr: float | None) -> None:
    """Run every missing cell, ``jobs`` at a time, each in its own process: forked from this one after the heavy
    imports (torch, transformers, TRL, this package: ~40 s per process on a loaded 2-core machine), so no run
    shares a process with another run's training, and no run pays the imports."""

    todo, seen = [], set()
    for cell in todo_cells:
        path = run_path(out, *cell)
        if path not in seen and not os.path.exists(path):
            seen.add(path)
            todo.append((cell, path))
    print(f"{len(todo)} runs to go", flush=True)
    os.environ.update(RUN_ENV)
    import torch
    import datasets  # noqa: F401
    import transformers  # noqa: F401
    import trl  # noqa: F401

    import trl_rollout_corr.grpo.trainer  # noqa: F401

    torch.set_num_threads(1)
    running: dict[int, tuple[str, float]] = {}
    done, t_start = 0, time.time()
    while todo or running:
        while todo and len(running) < jobs:
            (scenario, method, seed), path = todo.pop(0)
            pid = os.fork()
            if pid == 0:  # the run's own process
                code = 1
                try:
                    devnull = os.open(os.devnull, os.O_WRONLY)
                    os.dup2(devnull, 1)  # TRL prints its logs
                    run_one(scenario, method, seed, steps, path, cell_base(out, scenario, size),
                            cell_size(scenario, size), lr=scenario_lr(scenario, lr, size.get("name", "full")))
                    code = 0
                except BaseException:
                    with open(path + ".err", "w") as f:
                        f.write(traceback.format_exc())
                finally:
                    os._exit(code)
            running[pid] = (path, time.time())
        time.sleep(0.5)
        for pid in list(running):
            finished, status = os.waitpid(pid, os.WNOHANG)
            if finished == 0:
                continue
            path, t0 = running.pop(pid)
            done += 1
            if os.waitstatus_to_exitcode(status) != 0:
                err = open(path + ".err").read()[-3000:] if os.path.exists(path + ".err") else ""
                print(f"FAILED {path}:\n{err}", flush=True)
            else:
                print(f"[{done}] {os.path.basename(path)} {time.time() - t0:.0f} s "
                      f"(elapsed {time.time() - t_start:.0f} s)", flush=True)


def load_runs(out: str) -> list[dict]:
    runs_dir = os.path.join(out, "runs")
    runs = []
    for name in sorted(os.listdir(runs_dir)) if os.path.isdir(runs_dir) else []:
        if name.endswith(".json"):
            with open(os.path.join(runs_dir, name)) as f:
                runs.append(json.load(f))
    return runs


RESULTS = os.path.join(HERE, "results")  # the committed results
MAIN_CSV, CONFIRM_CSV = "mismatch_train_results.csv", "mismatch_train_confirm_results.csv"
TRUNCATION_CSV = "mismatch_train_truncation_results.csv"  # experiment P (S3)
TARGET_CSV = "mismatch_train_target_results.csv"  # experiment X (S2X)
TARGET_LAG16_CSV = "mismatch_train_target_lag16_results.csv"  # experiment Y (S2X at lag 16)
TARGET_Z_CSV = "mismatch_train_target_z_results.csv"  # experiment Z (Y's setting on 30 fresh seeds)
TARGET_Q_CSV = "mismatch_train_target_q_results.csv"  # experiment Q (S1X: a precision-like gap at T = 257)
TARGET_D_CSV = "mismatch_train_target_d_results.csv"  # experiment D (S1D: a dense precision gap at T = 257)
TARGET_A_CSV = "mismatch_train_target_a_results.csv"  # experiment A (S2D: staleness and a dense gap at T = 257)
TARGET_B_CSV = "mismatch_train_target_b_results.csv"  # experiment B (S2B: A with a smaller gap; M1 and M3 only)
TARGET_E_CSV = "mismatch_train_target_e_results.csv"  # experiment E (S2E: B with a smaller gap; M1 and M3 only)
TARGET_F_CSV = "mismatch_train_target_f_results.csv"  # experiment F (S2F: E with a smaller gap; only if E survived)
LADDER_CSV = {  # pre-registration 16: the experiments of A's engine at each gap, and their held-out results
    name: (csv_name, csv_name.replace("_results.csv", "_heldout_results.csv"))
    for name, csv_name in (("A", TARGET_A_CSV), ("B", TARGET_B_CSV), ("E", TARGET_E_CSV), ("F", TARGET_F_CSV))}
PRECISION_CSV = {"Q": TARGET_Q_CSV, "D": TARGET_D_CSV, "A": TARGET_A_CSV}  # FAMILY_EXPERIMENTS' committed results
ALARM_POOL_CSV = {"Z": TARGET_Z_CSV, "Z held-out": "mismatch_train_target_z_heldout_results.csv", "Q": TARGET_Q_CSV,
                  "D": TARGET_D_CSV, "D held-out": "mismatch_train_target_d_heldout_results.csv", "A": TARGET_A_CSV,
                  "A held-out": "mismatch_train_target_a_heldout_results.csv"}  # pre-registration 14's runs


def runs_from_csv(path: str) -> list[dict]:
    """The runs of a committed ``results.csv`` (one row per run) as the analysis reads them: the per-seed score,
    regime and collapse, and on_policy's pool (its scenario for a long one, else shared by every scenario)."""
    runs = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            run = dict(scenario=row["scenario"], method=row["method"], seed=int(row["seed"]),
                       collapsed=row["collapsed"] == "True",
                       **{k: float(row[k]) for k in ("score", "kl_token", "t_kl", "engine_reward")},
                       **{k: int(row[k]) if row.get(k) else None for k in ("alarm_step", "first_low_eval")})
            if run["method"] == "on_policy":
                run["pool"] = run["scenario"] if run["scenario"] in LONG_SCENARIOS else "all"
            runs.append(run)
    return runs


def lag0_caution_kl(results: str = RESULTS) -> float | None:
    """Pre-registration 16, decision (2): the smallest step-0 noise-only per-token KL (``D_PILOT`` / ``E_PILOT``) of
    experiments A, B, E, F whose M3 - M1 row was significant by both tests (Holm within the family), NEGATIVE, and
    survived its held-out seeds (the same sign there), from the committed results; ``None`` if none did. An
    experiment whose results (or held-out results) are not committed counts as not run."""
    noise_of = {"A": D_NOISE, **{name: noise for name, (_, noise, _, _) in GAP_LADDER.items()}}
    levels = []
    for name, (csv_name, held_csv) in LADDER_CSV.items():
        if not os.path.exists(os.path.join(results, csv_name)):
            continue
        scenario, family, seeds, held_out = HELD_OUT_EXPERIMENTS[name]
        runs = runs_from_csv(os.path.join(results, csv_name))
        _, result = analyse_family(runs, list(seeds), scenario, family, name)
        row = next(r for r in result["family"] if r["method"] == "M3")
        significant = row["p_sign_flip_holm"] < ALPHA and row["p_holm"] < ALPHA
        if row["diff"] >= 0 or not significant or not os.path.exists(os.path.join(results, held_csv)):
            continue
        q_held_out_text(runs + runs_from_csv(os.path.join(results, held_csv)), result, list(held_out), scenario,
                        signed=True)
        if result.get("held_out", {}).get("M3", {}).get("survives", False):
            levels.append({**D_PILOT, **E_PILOT}[noise_of[name]][0])
    return min(levels, default=None)


def confirmed_methods(results: str = RESULTS) -> dict[str, list[str]]:
    """Scenario -> the methods the pre-registered analyses of the committed results confirm above TRL's default (M1)
    there: S2 by experiment C (``CONFIRM_FAMILY`` on ``CONFIRM_SEEDS``), S2L by experiment L (``LONG_FAMILY`` on
    ``LONG_SEEDS``: none ran, its cost check failed), S3 by experiment P (``P_FAMILY`` on ``P_SEEDS``), S1 by none
    (the first family, seeds 0-9, picked no candidate, and a candidate is confirmed only on held-out seeds; no later
    experiment ran a family in S1), S2X by experiments X, Y and Z (``X_FAMILY`` on ``X_SEEDS``, ``Y_FAMILY`` on
    ``Y_SEEDS``, ``Z_FAMILY`` on ``Z_SEEDS`` with Y's established cost; a confirmed row counts only if it also
    survives its held-out seeds ``X_HELD_OUT`` / ``Y_HELD_OUT`` / ``Z_HELD_OUT``), S1X by experiment Q (``Q_FAMILY``
    on ``Q_SEEDS``, rule (b), surviving ``Q_HELD_OUT``; M0, "no correction", is never a remedy), S1D by experiment D
    (the same with ``D_FAMILY``, ``D_SEEDS``, ``D_HELD_OUT``), S2D by experiment A (``A_FAMILY``, ``A_SEEDS``,
    ``A_HELD_OUT``; a negative row held out there is a cost, never a remedy). What the monitor's
    advice (``trl_rollout_corr/monitor/advice.py``) may recommend, and nothing else."""
    _, main = analyse(runs_from_csv(os.path.join(results, MAIN_CSV)), list(range(10)))
    if main["candidate"] is not None:  # would need its held-out analysis: not written, since none was picked
        raise NotImplementedError(f"the first family picked {main['candidate']}: analyse its held-out seeds")
    runs = runs_from_csv(os.path.join(results, CONFIRM_CSV))
    _, c = analyse_family(runs, list(CONFIRM_SEEDS), "S2", CONFIRM_FAMILY, "C", established=C_GAP_SEEDS_0_9)
    _, long = analyse_family(runs, list(LONG_SEEDS), "S2L", LONG_FAMILY, "L")
    _, trunc = analyse_family(runs_from_csv(os.path.join(results, TRUNCATION_CSV)), list(P_SEEDS), "S3", P_FAMILY, "P")
    target = []  # S2X: experiments X (lag 8), Y and Z (lag 16), each row only if it survives its held-out seeds
    for csv_name, seeds, family, held_out, established in (
            (TARGET_CSV, X_SEEDS, X_FAMILY, X_HELD_OUT, None),
            (TARGET_LAG16_CSV, Y_SEEDS, Y_FAMILY, Y_HELD_OUT, None),
            (TARGET_Z_CSV, Z_SEEDS, Z_FAMILY, Z_HELD_OUT, Y_GAP_SEEDS_75_84)):
        target_runs = runs_from_csv(os.path.join(results, csv_name))
        _, result = analyse_family(target_runs, list(seeds), "S2X", family, "X/Y/Z", established=established)
        if result["confirmed"]:  # pre-registrations 5 and 6, item 4: the held-out seeds decide
            held_out_row_text(target_runs, result, list(held_out), "S2X")
            if result.get("held_out", {}).get("survives", False):
                target += [m for m in result["confirmed"] if m not in target]
    precision = {}  # S1X, S1D, S2D: pre-registrations 10, 11, 13, rule (b), a row only if it survives its held-out
    for experiment, (scenario, family, seeds, held_out) in FAMILY_EXPERIMENTS.items():
        q_runs = runs_from_csv(os.path.join(results, PRECISION_CSV[experiment]))
        _, q = analyse_family(q_runs, list(seeds), scenario, family, experiment)
        q_text = q_held_out_text(q_runs, q, list(held_out), scenario)  # rule (b)'s rows: positive only
        if q["confirmed"] and "not run yet" in q_text:
            raise NotImplementedError(f"experiment {experiment} confirmed {q['confirmed']}: run its held-out seeds "
                                      f"{experiment}_HELD_OUT")
        precision[scenario] = [m for m in q["confirmed"] if m != "M0"
                               and q.get("held_out", {}).get(m, {}).get("survives")]
    return {"S1": [], "S2": c["confirmed"], "S2L": long["confirmed"], "S3": trunc["confirmed"], "S2X": target,
            **precision}


def score_table(runs: list[dict]) -> dict:
    """(scenario, method) -> {seed: run}, with on_policy under every scenario and S0's M0 = on_policy."""
    table: dict = {}
    pools = {r.get("pool", "all") for r in runs if r["method"] == "on_policy"} - {"all"}
    scenarios = sorted({r["scenario"] for r in runs if r["method"] != "on_policy"} | {COST_SCENARIO} | pools)
    for r in runs:
        if r["method"] == "on_policy":
            pool = r.get("pool", "all")  # records written before the long scenarios have none: "all"
            for s in scenarios if pool == "all" else [pool]:
                if pool != "all" or s not in LONG_SCENARIOS:
                    table.setdefault((s, "on_policy"), {})[r["seed"]] = r
            if pool == "all":
                table.setdefault((COST_SCENARIO, "M0"), {})[r["seed"]] = r
        else:
            table.setdefault((r["scenario"], r["method"]), {})[r["seed"]] = r
    return table


def alarm_step(logs: list[dict], key: str = ALARM_KEY, threshold: float = ALARM_THRESHOLD,
               consecutive: int = ALARM_CONSECUTIVE) -> int | None:
    """Pre-registration 8's rule: the step of the first logged row whose ``key`` and the ``consecutive - 1`` values
    of it logged before are all below ``threshold``; None if it never fires (rows without the key are skipped)."""
    below = 0
    for row in logs:
        value = row.get(key)
        if value is None or not math.isfinite(value):
            continue
        below = below + 1 if value < threshold else 0
        if below >= consecutive:
            return int(row["step"])
    return None


def first_low_eval(curve: list) -> int | None:
    """The first evaluation step (after step 0) whose held-out reward is below COLLAPSE_FRACTION x the step-0 one."""
    start = curve[0][1]
    return next((int(step) for step, reward in curve[1:] if reward < COLLAPSE_FRACTION * start), None)


def write_csv(runs: list[dict], path: str) -> None:
    cols = ["scenario", "method", "seed", "trainer", "steps", "lr", "n_digits", "lag", "score", "initial", "final",
            "collapsed", "kl_token", "t_kl", "engine_reward", "seconds"]
    cols += [f"{m}_{agg}" for m in HURT_METRICS for agg in ("mean", "max")]
    cols += ["alarm_step", "first_low_eval"]  # pre-registration 8 (TRL's trainer arms; "" where none)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in sorted(runs, key=lambda r: (r["scenario"], r["method"], r["seed"])):
            row = {c: r.get(c, "") for c in cols}
            if "logs" in r and "curve" in r:  # from the run's own JSON (a row read back from a CSV keeps its values)
                row["alarm_step"] = "" if (step := alarm_step(r["logs"])) is None else step
                row["first_low_eval"] = "" if (step := first_low_eval(r["curve"])) is None else step
            if row["n_digits"] == "":  # written before the long scenarios: the 48-digit task
                row["n_digits"] = 48
            w.writerow(row)


def paired(table, scenario, method, ref, seeds):
    a, b = table.get((scenario, method), {}), table.get((scenario, ref), {})
    common = [s for s in seeds if s in a and s in b]
    return common, [a[s]["score"] for s in common], [b[s]["score"] for s in common]


def gap_closed(table, scenario, method, seeds):
    """(seeds, Fieller result) of the gap closed (method - M0) / (on_policy - M0) on the seeds all three share, or
    None with fewer than 2."""
    by = [table.get((scenario, k), {}) for k in (method, "M0", "on_policy")]
    common = [s for s in seeds if all(s in b for b in by)]
    if len(common) < 2:
        return None
    m, u, o = ([b[s]["score"] for s in common] for b in by)
    return common, _stats().fieller(m, u, o)


def analyse(runs: list[dict], seeds: list[int]) -> tuple[str, dict]:
    """The pre-registered analysis of ``seeds`` (markdown, and the numbers as a dict)."""
    st = _stats()
    table = score_table(runs)
    lines, result = [], {"gap": {}, "family": [], "tost": [], "collapse": []}
    fmt = lambda x: "—" if x is None or not math.isfinite(x) else f"{x:.3g}"  # noqa: E731
    lines.append(f"Seeds {seeds[0]}-{seeds[-1]} ({len(seeds)} paired seeds). Score: the policy's own held-out reward "
                 "(mean over the evaluations in the last 30% of the steps).\n")
    # per-cell means and regime
    lines.append("| scenario | method | n | score mean | sd | per-token KL(engine‖policy) | T·KL | engine reward "
                 "| collapsed |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for (scenario, method), by_seed in sorted(table.items()):
        rs = [by_seed[s] for s in seeds if s in by_seed]
        if not rs:
            continue
        xs = [r["score"] for r in rs]
        lines.append(f"| {scenario} | {method} | {len(rs)} | {statistics.fmean(xs):.4f} | "
                     f"{statistics.stdev(xs) if len(xs) > 1 else math.nan:.4f} | "
                     f"{statistics.fmean(r['kl_token'] for r in rs):.2e} | "
                     f"{statistics.fmean(r['t_kl'] for r in rs):.2f}"
                     f" | {statistics.fmean(r['engine_reward'] for r in rs):.3f} | "
                     f"{sum(bool(r['collapsed']) for r in rs)} |")
    # does the mismatch cost anything? on_policy vs M0, per scenario
    lines.append("\n**Does the mismatch cost anything?** on_policy − M0 (paired t, exact sign-flip):\n")
    lines.append("| scenario | n | on_policy − M0 | 95% CI | p (t) | p (sign-flip) | counts |")
    lines.append("|---|---|---|---|---|---|---|")
    counts = {}
    for scenario in FAMILY_SCENARIOS:
        common, o, u = paired(table, scenario, "on_policy", "M0", seeds)
        if len(common) < 2:
            continue
        row = st.compare_paired(o, u)
        counts[scenario] = row["p"] < ALPHA and row["p_sign_flip"] < ALPHA and row["diff"] > 0
        result["gap"][scenario] = {**row, "counts": counts[scenario]}
        lines.append(f"| {scenario} | {row['n']} | {row['diff']:+.4f} | [{row['diff_lo']:+.4f}, {row['diff_hi']:+.4f}]"
                     f" | {fmt(row['p'])} | {fmt(row['p_sign_flip'])} | {'yes' if counts[scenario] else 'no'} |")
    # the family: each of M0, M2, M3, M4 vs M1 in S1, S2; Holm over the sign-flip p's (and the t p's)
    rows = []
    for scenario, method in FAMILY:
        common, x, ref = paired(table, scenario, method, REFERENCE, seeds)
        if len(common) < 2:
            continue
        fl = [table[(scenario, "M0")][s]["score"] for s in common] if (scenario, "M0") in table else None
        ce = [table[(scenario, "on_policy")][s]["score"] for s in common] if (scenario, "on_policy") in table else None
        ok = fl is not None and ce is not None and all(s in table[(scenario, "M0")] for s in common)
        row = st.compare_paired(x, ref, floor=fl if ok else None, ceiling=ce if ok else None)
        row.update(scenario=scenario, method=method, counts=counts.get(scenario, False))
        rows.append(row)
    st.add_holm(rows, "p_sign_flip")
    st.add_holm(rows, "p")
    result["family"] = rows
    lines.append(f"\n**The pre-registered family**: each of {', '.join(FAMILY_METHODS)} vs M1 (TRL's default) in "
                 f"{', '.join(FAMILY_SCENARIOS)}; Holm over the {len(FAMILY)} comparisons (sign-flip p's; the paired-t "
                 "p's adjusted the same way beside them). Gap closed = (method − M0) / (on_policy − M0), Fieller 95%, "
                 "only where the gap is significant.\n")
    lines.append("| scenario | method | n | method − M1 | 95% CI | p sign-flip | Holm | p t | Holm (t) "
                 "| gap closed [95%] | scenario counts |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        gc = r.get("gap_closed", math.nan)
        gct = (f"{gc:.2f} [{r['gap_closed_lo']:.2f}, {r['gap_closed_hi']:.2f}]" if math.isfinite(gc) else "—")
        lines.append(f"| {r['scenario']} | {r['method']} | {r['n']} | {r['diff']:+.4f} | [{r['diff_lo']:+.4f}, "
                     f"{r['diff_hi']:+.4f}] | {fmt(r['p_sign_flip'])} | {fmt(r['p_sign_flip_holm'])} | {fmt(r['p'])} "
                     f"| {fmt(r['p_holm'])} | {gct} | {'yes' if r['counts'] else 'no'} |")
    # the gap closed by every correction, TRL's default included, where the gap is significant
    lines.append("\n**Gap closed** (method − M0) / (on_policy − M0), Fieller 95%, in the scenarios where the gap is "
                 "significant (descriptive: not a family comparison):\n")
    lines.append("| scenario | method | n | gap closed | 95% (Fieller) |")
    lines.append("|---|---|---|---|---|")
    result["gap_closed"] = []
    for scenario in FAMILY_SCENARIOS:
        if not counts.get(scenario):
            continue
        for method in ("M1", "M2", "M3", "M4"):
            if (found := gap_closed(table, scenario, method, seeds)) is None:
                continue
            common, r = found
            result["gap_closed"].append(dict(scenario=scenario, method=method, n=len(common), estimate=r.estimate,
                                             lo=r.lo, hi=r.hi))
            lines.append(f"| {scenario} | {method} | {len(common)} | {r.estimate:.2f} | [{r.lo:.2f}, {r.hi:.2f}] |")
    # S0: no cost, TOST of each vs M0
    lines.append(f"\n**No cost without mismatch (S0)**: each method vs M0 (= on_policy), TOST margin ±{TOST_MARGIN} "
                 "(90% interval inside the margin ⇔ equivalent at 5%):\n")
    lines.append("| method | n | method − M0 | 90% CI | TOST p | equivalent |")
    lines.append("|---|---|---|---|---|---|")
    for method in ("M1", "M2", "M3", "M4"):
        common, x, ref = paired(table, COST_SCENARIO, method, "M0", seeds)
        if len(common) < 2:
            continue
        row = st.compare_paired(x, ref, margin=TOST_MARGIN)
        row.update(method=method)
        result["tost"].append(row)
        lines.append(f"| {method} | {row['n']} | {row['diff']:+.4f} | [{row['tost_lo']:+.4f}, {row['tost_hi']:+.4f}]"
                     f" | {fmt(row['tost_p'])} | {'yes' if row['tost_p'] < ALPHA else 'no'} |")
    # collapses (Fisher vs M1)
    lines.append(f"\n**Collapses** (last evaluation < {COLLAPSE_FRACTION} x step-0), Fisher's exact test vs M1:\n")
    lines.append("| scenario | method | collapsed / n | M1 collapsed / n | Fisher p |")
    lines.append("|---|---|---|---|---|")
    for scenario, method in FAMILY:
        a, b = table.get((scenario, method), {}), table.get((scenario, REFERENCE), {})
        ra, rb = [a[s] for s in seeds if s in a], [b[s] for s in seeds if s in b]
        if not ra or not rb:
            continue
        ca, cb = sum(bool(r["collapsed"]) for r in ra), sum(bool(r["collapsed"]) for r in rb)
        p = st.fisher_exact([[ca, len(ra) - ca], [cb, len(rb) - cb]]).p
        result["collapse"].append(dict(scenario=scenario, method=method, collapsed=ca, n=len(ra), ref_collapsed=cb,
                                       ref_n=len(rb), p=p))
        lines.append(f"| {scenario} | {method} | {ca} / {len(ra)} | {cb} / {len(rb)} | {fmt(p)} |")
    result["candidate"] = pick_candidate(result)
    lines.append("\n" + candidate_text(result))
    return "\n".join(lines), result


def analyse_family(runs: list[dict], seeds: list[int], scenario: str, family: tuple, title: str,
                   established: dict | None = None) -> tuple[str, dict]:
    """Experiments C and L (pre-registration 2): the cost check on_policy - M0 in ``scenario`` on ``seeds``, the
    ``family`` (each method - M1, Holm over the family, exact sign-flip and paired t), the decision rule (a method is
    confirmed iff the scenario's gap counts and method - M1 > 0 with both Holm-adjusted p's < ALPHA), Fieller gap
    closed (where the gap counts) and collapses (Fisher vs M1)."""
    st = _stats()
    table = score_table(runs)
    fmt = lambda x: "—" if x is None or not math.isfinite(x) else f"{x:.3g}"  # noqa: E731
    result: dict = {"scenario": scenario, "seeds": list(seeds), "family": [], "gap_closed": [], "collapse": [],
                    "confirmed": []}
    lines = [f"### {title}\n", f"Scenario {scenario}, seeds {seeds[0]}-{seeds[-1]} ({len(seeds)} paired seeds). Score: "
             "the policy's own held-out reward (mean over the evaluations in the last 30% of the steps).\n",
             "| method | n | score mean | sd | per-token KL(engine‖policy) | T·KL | mean length | collapsed |",
             "|---|---|---|---|---|---|---|---|"]
    for method in ("on_policy", "M0", "M1", "M1p", "M2", "M3", "M4"):
        rs = [r for s, r in sorted(table.get((scenario, method), {}).items()) if s in seeds]
        if not rs:
            continue
        xs = [r["score"] for r in rs]
        length = statistics.fmean(g["length"] for r in rs for g in r["generations"]) if all(
            "generations" in r for r in rs) else math.nan
        lines.append(f"| {method} | {len(rs)} | {statistics.fmean(xs):.4f} | "
                     f"{statistics.stdev(xs) if len(xs) > 1 else math.nan:.4f} | "
                     f"{statistics.fmean(r['kl_token'] for r in rs):.2e} | "
                     f"{statistics.fmean(r['t_kl'] for r in rs):.2f} | {length:.1f} | "
                     f"{sum(bool(r['collapsed']) for r in rs)} |")
    common, o, u = paired(table, scenario, "on_policy", "M0", seeds)
    counts = False
    if len(common) >= 2:
        gap = st.compare_paired(o, u)
        counts = gap["p"] < ALPHA and gap["p_sign_flip"] < ALPHA and gap["diff"] > 0
        result["gap"] = {**gap, "counts": counts}
        lines += ["\n**Does the mismatch cost anything?** on_policy − M0 (paired t, exact sign-flip):\n",
                  "| n | on_policy − M0 | 95% CI | p (t) | p (sign-flip) | counts |", "|---|---|---|---|---|---|",
                  f"| {gap['n']} | {gap['diff']:+.4f} | [{gap['diff_lo']:+.4f}, {gap['diff_hi']:+.4f}] | "
                  f"{fmt(gap['p'])} | {fmt(gap['p_sign_flip'])} | {'yes' if counts else 'no'} |"]
    gap_counts = counts  # the gap on these seeds (decides the gap closed)
    if established is not None:  # C: the gap was established on other seeds; these can only overturn it (all run)
        counts = not (len(common) == len(seeds) and not gap_counts)
        ran = "was re-checked on all of them" if len(common) == len(seeds) else f"ran on {len(common)} of them"
        lines.append(f"\nRule (a) for this experiment: the gap was established on earlier seeds ({established}); "
                     f"on these seeds it {ran}: (a) {'holds' if counts else 'fails'}.")
    result["counts"] = counts
    rows = []
    for sc, method in family:
        common, x, ref = paired(table, sc, method, REFERENCE, seeds)
        if len(common) < 2:
            continue
        row = st.compare_paired(x, ref)
        row.update(scenario=sc, method=method)
        rows.append(row)
    if rows:
        st.add_holm(rows, "p_sign_flip")
        st.add_holm(rows, "p")
    for row in rows:
        row["confirmed"] = bool(counts and row["diff"] > 0 and row["p_sign_flip_holm"] < ALPHA
                                and row["p_holm"] < ALPHA)
    result["family"] = rows
    result["confirmed"] = [r["method"] for r in rows if r["confirmed"]]
    lines += [f"\n**The pre-registered family**: {', '.join(f'{m} − M1' for _, m in family)} in {scenario}; Holm over "
              f"the {len(family)} (sign-flip p's; the paired-t p's adjusted the same way beside them). Confirmed iff "
              "the gap counts and both Holm p < 0.05 with a positive difference.\n",
              "| method | n | method − M1 | 95% CI | p sign-flip | Holm | p t | Holm (t) | confirmed |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['n']} | {r['diff']:+.4f} | [{r['diff_lo']:+.4f}, {r['diff_hi']:+.4f}] | "
                     f"{fmt(r['p_sign_flip'])} | {fmt(r['p_sign_flip_holm'])} | {fmt(r['p'])} | {fmt(r['p_holm'])} | "
                     f"{'yes' if r['confirmed'] else 'no'} |")
    lines += ["\n**Gap closed** (method − M0) / (on_policy − M0), Fieller 95% (descriptive; only where the gap "
              "counts):\n", "| method | n | gap closed | 95% (Fieller) |", "|---|---|---|---|"]
    if gap_counts:
        for method in ("M1", "M1p", "M2", "M3", "M4"):
            if (found := gap_closed(table, scenario, method, seeds)) is None:
                continue
            common, r = found
            result["gap_closed"].append(dict(method=method, n=len(common), estimate=r.estimate, lo=r.lo, hi=r.hi))
            lines.append(f"| {method} | {len(common)} | {r.estimate:.2f} | [{r.lo:.2f}, {r.hi:.2f}] |")
    else:
        lines.append("| — | — | the gap does not count: not computed | — |")
    lines += [f"\n**Collapses** (last evaluation < {COLLAPSE_FRACTION} x step-0), Fisher's exact test vs M1:\n",
              "| method | collapsed / n | M1 collapsed / n | Fisher p |", "|---|---|---|---|"]
    ref_runs = [table.get((scenario, REFERENCE), {}).get(s) for s in seeds]
    ref_runs = [r for r in ref_runs if r is not None]
    for method in ("M0", "M1p", "M2", "M3", "M4"):
        rs = [table.get((scenario, method), {}).get(s) for s in seeds]
        rs = [r for r in rs if r is not None]
        if not rs or not ref_runs:
            continue
        ca, cb = sum(bool(r["collapsed"]) for r in rs), sum(bool(r["collapsed"]) for r in ref_runs)
        p = st.fisher_exact([[ca, len(rs) - ca], [cb, len(ref_runs) - cb]]).p
        result["collapse"].append(dict(method=method, collapsed=ca, n=len(rs), ref_collapsed=cb, ref_n=len(ref_runs),
                                       p=p))
        lines.append(f"| {method} | {ca} / {len(rs)} | {cb} / {len(ref_runs)} | {fmt(p)} |")
    verdict = (", ".join(result["confirmed"]) + " CONFIRMED above TRL's default" if result["confirmed"] else
               "no method confirmed above TRL's default" + ("" if counts else " (the mismatch's cost is not "
                                                                                 "significant on these seeds)"))
    lines.append(f"\n**Decision (pre-registered rule)**: {verdict} in {scenario}.")
    return "\n".join(lines), result


def costly_scenarios(runs: list[dict]) -> tuple:
    """Experiment H's costly set: the scenarios of COSTLY_SCENARIOS whose gap on_policy - M0 counts (paired t and
    sign-flip p < ALPHA, positive) on every seed where both ran."""
    table = score_table(runs)
    out = []
    for scenario in COSTLY_SCENARIOS:
        seeds = sorted(set(table.get((scenario, "on_policy"), {})) & set(table.get((scenario, "M0"), {})))
        if len(seeds) >= 2 and analyse_family(runs, seeds, scenario, (), scenario)[1]["counts"]:
            out.append(scenario)
    return tuple(out)


HURT_ARMS = ("M0", "M1p", "M3", "M4")  # this package's trainer: it logs the "does it hurt?" metrics


def hurt_table(runs: list[dict], costly: tuple = COSTLY_SCENARIOS) -> tuple[str, dict]:
    """Experiment H: per (scenario, arm) of this package's trainer, each metric's run means (their mean and range
    over the runs) and the largest run maximum; then, per arm and metric, whether the healthy scenarios' run means
    and the costly ones' separate (every costly run strictly beyond every healthy run, on one side)."""
    fmt = lambda x: "—" if x is None or not math.isfinite(x) else f"{x:.3g}"  # noqa: E731
    by: dict = {}
    for r in runs:
        scenario = r["scenario"] if r["method"] != "on_policy" else None
        if scenario is None or r["method"] not in HURT_ARMS or f"{HURT_METRICS[0]}_mean" not in r:
            continue
        by.setdefault((scenario, r["method"]), []).append(r)
    lines = ["| scenario | arm | n | per-token KL | T·KL (engine) | "
             + " | ".join(f"{m}: run means mean [min, max]; max" for m in HURT_METRICS) + " |",
             "|---|---|---|---|---|" + "---|" * len(HURT_METRICS)]
    result: dict = {"cells": {}, "separation": {}}
    for (scenario, arm), rs in sorted(by.items()):
        cells_ = []
        cell: dict = {"n": len(rs)}
        for m in HURT_METRICS:
            means = [r[f"{m}_mean"] for r in rs if math.isfinite(r[f"{m}_mean"])]
            maxes = [r[f"{m}_max"] for r in rs if math.isfinite(r[f"{m}_max"])]
            cell[m] = dict(mean=statistics.fmean(means) if means else math.nan, lo=min(means, default=math.nan),
                           hi=max(means, default=math.nan), max=max(maxes, default=math.nan))
            c = cell[m]
            cells_.append(f"{fmt(c['mean'])} [{fmt(c['lo'])}, {fmt(c['hi'])}]; {fmt(c['max'])}")
        result["cells"][f"{scenario}/{arm}"] = cell
        lines.append(f"| {scenario} | {arm} | {len(rs)} | {statistics.fmean(r['kl_token'] for r in rs):.2e} | "
                     f"{statistics.fmean(r['t_kl'] for r in rs):.2f} | " + " | ".join(cells_) + " |")
    lines += ["\n**Separation** (pre-registered: every costly run's mean strictly beyond every healthy run's, per arm; "
              f"healthy = {', '.join(HEALTHY_SCENARIOS)}, costly = {', '.join(costly) or 'none'}):\n",
              "| arm | metric | healthy run means [min, max] (n) | costly run means [min, max] (n) | separates |",
              "|---|---|---|---|---|"]
    for arm in HURT_ARMS:
        for m in HURT_METRICS:
            h = [r[f"{m}_mean"] for (s, a), rs in by.items() if a == arm and s in HEALTHY_SCENARIOS for r in rs]
            c = [r[f"{m}_mean"] for (s, a), rs in by.items() if a == arm and s in costly for r in rs]
            h, c = [x for x in h if math.isfinite(x)], [x for x in c if math.isfinite(x)]
            if not h or not c:
                continue
            sep = min(c) > max(h) or max(c) < min(h)
            result["separation"][f"{arm}/{m}"] = dict(healthy=(min(h), max(h), len(h)), costly=(min(c), max(c), len(c)),
                                                      separates=sep)
            lines.append(f"| {arm} | {m} | [{fmt(min(h))}, {fmt(max(h))}] ({len(h)}) | [{fmt(min(c))}, {fmt(max(c))}] "
                         f"({len(c)}) | {'yes' if sep else 'no'} |")
    return "\n".join(lines), result



def package_vs_trl(runs: list[dict]) -> tuple[str, list[dict]]:
    """M1p (TRL's default by this package's trainer) - M1 (by TRL's GRPOTrainer), paired per scenario on the seeds
    both ran (descriptive: package == TRL in training; the losses agree to float rounding, so the runs differ only
    where a rounding difference changes a sampled token)."""
    st = _stats()
    table = score_table(runs)
    lines = ["**Package == TRL in training**: M1p (preset `trl_default`, this package's trainer) − M1 (TRL's "
             "GRPOTrainer), paired:\n", "| scenario | n | M1p − M1 | 95% CI | p (t) | largest \\|diff\\| |",
             "|---|---|---|---|---|---|"]
    rows = []
    for scenario in sorted({s for s, m in table if m == "M1p"}):
        a, b = table.get((scenario, "M1p"), {}), table.get((scenario, "M1"), {})
        common = sorted(set(a) & set(b))
        if len(common) < 2:
            continue
        x, y = [a[s]["score"] for s in common], [b[s]["score"] for s in common]
        d = max(abs(u - v) for u, v in zip(x, y))
        if d == 0:
            row = dict(scenario=scenario, n=len(common), diff=0.0, diff_lo=0.0, diff_hi=0.0, p=1.0)
        else:
            row = {**st.compare_paired(x, y), "scenario": scenario}
        row["max_abs"] = d
        rows.append(row)
        lines.append(f"| {scenario} | {row['n']} | {row['diff']:+.4f} | [{row['diff_lo']:+.4f}, {row['diff_hi']:+.4f}]"
                     f" | {row['p']:.3g} | {d:.4f} |")
    return "\n".join(lines), rows


def pick_candidate(result: dict):
    """The pre-registered choice: among family rows whose scenario counts, significantly above M1 after Holm
    (sign-flip and t both < ALPHA), the one with the largest mean difference; None if there is none."""
    ok = [r for r in result["family"] if r["counts"] and r["diff"] > 0 and r["p_sign_flip_holm"] < ALPHA
          and r["p_holm"] < ALPHA]
    if not ok:
        return None
    best = max(ok, key=lambda r: r["diff"])
    return {"scenario": best["scenario"], "method": best["method"], "diff": best["diff"]}


def candidate_text(result: dict) -> str:
    c = result["candidate"]
    counting = [s for s, g in result["gap"].items() if g["counts"]]
    text = ("**Scenarios where the mismatch costs something** (on_policy > M0, paired t and sign-flip p < 0.05): "
            + (", ".join(counting) if counting else "none: no method can be compared in any scenario") + ".\n")
    if c is None:
        text += ("**Candidate**: none — no method is significantly above TRL's default (M1) after Holm in a scenario "
                 "that counts, so no held-out seed is run.")
    else:
        text += (f"**Candidate**: {c['method']} in {c['scenario']} ({c['diff']:+.4f} vs M1); the held-out seeds run "
                 f"{c['method']} and M1 in {c['scenario']} and in S0.")
    return text


def held_out_text(runs: list[dict], candidate: dict, seeds: list[int]) -> str:
    st = _stats()
    table = score_table(runs)
    lines = [f"**Held-out confirmation** (seeds {seeds[0]}-{seeds[-1]}, run after the choice):\n",
             "| scenario | comparison | n | diff | 95% CI | p (t) | p (sign-flip) | same sign |",
             "|---|---|---|---|---|---|---|---|"]
    for scenario, method, ref in ((candidate["scenario"], candidate["method"], REFERENCE),
                                  (COST_SCENARIO, candidate["method"], "M0"), (COST_SCENARIO, REFERENCE, "M0")):
        common, x, r = paired(table, scenario, method, ref, seeds)
        if len(common) < 2:
            lines.append(f"| {scenario} | {method} − {ref} | {len(common)} | not run | | | | |")
            continue
        row = st.compare_paired(x, r, margin=TOST_MARGIN if scenario == COST_SCENARIO else None)
        same = "yes" if (scenario != COST_SCENARIO and row["diff"] * candidate["diff"] > 0) else (
            "—" if scenario == COST_SCENARIO else "no")
        extra = (f" (TOST ±{TOST_MARGIN}: 90% [{row['tost_lo']:+.4f}, {row['tost_hi']:+.4f}], p {row['tost_p']:.3g})"
                 if scenario == COST_SCENARIO else "")
        lines.append(f"| {scenario} | {method} − {ref} | {row['n']} | {row['diff']:+.4f}{extra} | "
                     f"[{row['diff_lo']:+.4f}, {row['diff_hi']:+.4f}] | {row['p']:.3g} | {row['p_sign_flip']:.3g} | "
                     f"{same} |")
    return "\n".join(lines)


def plot(runs: list[dict], seeds: list[int], path: str) -> None:
    """One panel per scenario: each method's mean held-out reward curve over the seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = score_table(runs)
    scenarios = sorted({s for s, _ in table})
    fig, axes = plt.subplots(1, len(scenarios), figsize=(4.5 * len(scenarios), 4), squeeze=False)
    for ax, scenario in zip(axes[0], scenarios):
        for (s, method), by_seed in sorted(table.items()):
            rs = [by_seed[x] for x in seeds if x in by_seed]
            if s != scenario or not rs:
                continue
            steps = [p[0] for p in rs[0]["curve"]]
            mean = [statistics.fmean(r["curve"][i][1] for r in rs if len(r["curve"]) > i) for i in range(len(steps))]
            ax.plot(steps, mean, label=f"{method} (n={len(rs)})", ls="--" if method == "on_policy" else "-")
        ax.set(title=f"{scenario}", xlabel="optimizer step", ylabel="policy's held-out reward")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def parse_seeds(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        if "-" in part:
            a, b = part.split("-")
            out.extend(range(int(a), int(b) + 1))
        elif part:
            out.append(int(part))
    return out


EXPERIMENTS = {  # --experiment: what analysis.md holds
    "main": "the first family (seeds 0-9): each of M0, M2, M3, M4 vs M1 in S1, S2",
    "C": "confirmation of the S2 lead: CONFIRM_FAMILY on CONFIRM_SEEDS",
    "L": "the realistic regime: S2L's cost check, then LONG_FAMILY on LONG_SEEDS",
    "H": "the 'does it hurt?' metrics of this package's trainer arms, healthy vs costly scenarios",
    "P": "truncated sampling: S3's cost check, then P_FAMILY on P_SEEDS (held-out: P_HELD_OUT)",
    "X": "the target regime: S2X's cost check, then X_FAMILY on X_SEEDS (held-out: X_HELD_OUT)",
    "Y": "S2X at lag Y_LAG: the cost check, then Y_FAMILY on Y_SEEDS (held-out: Y_HELD_OUT)",
    "Z": "Y's rare collapses: Z_FAMILY on Z_SEEDS, the cost established by Y (held-out: Z_HELD_OUT)",
    "Q": "a precision-like gap in the target regime: S1X's cost check, Q_FAMILY on Q_SEEDS (held-out: Q_HELD_OUT)",
    "D": "a dense precision-like gap at T = 257: S1D's cost check, D_FAMILY on D_SEEDS (held-out: D_HELD_OUT)",
    "A": "staleness and a dense gap at T = 257: S2D's cost check, A_FAMILY on A_SEEDS (held-out: A_HELD_OUT)",
    "B": "A with a smaller gap: B_FAMILY (M3 - M1) in S2B on B_SEEDS (held-out: B_HELD_OUT)",
    "E": "B with a smaller gap: M3 - M1 in S2E on E_SEEDS (held-out: E_HELD_OUT)",
    "F": "E with a smaller gap (only if E's row survived): M3 - M1 in S2F on F_SEEDS (held-out: F_HELD_OUT)",
}


def report(out: str, seeds: list[int], held_out: list[int] | None = None, experiment: str = "main") -> str:
    runs = load_runs(out)
    write_csv(runs, os.path.join(out, "results.csv"))
    if experiment == "main":
        text, result = analyse(runs, seeds)
        if held_out and result["candidate"] is not None:
            text += "\n\n" + held_out_text(runs, result["candidate"], held_out)
    elif experiment in ("C", "L", "P", "X", "Y", "Z", "Q", "D", "A", "B", "E", "F"):
        scenario, family, title = {
            "C": ("S2", CONFIRM_FAMILY, "Experiment C: confirmation of the S2 lead"),
            "L": ("S2L", LONG_FAMILY, "Experiment L: the stale engine at a long completion"),
            "P": ("S3", P_FAMILY, f"Experiment P: truncated sampling (top_p {S3_TOP_P})"),
            "X": ("S2X", X_FAMILY, f"Experiment X: the stale engine in the target regime (T = {X_DIGITS + 1})"),
            "Y": ("S2X", Y_FAMILY, f"Experiment Y: the stale engine at lag {Y_LAG} in the target regime "
                                   f"(T = {X_DIGITS + 1})"),
            "Z": ("S2X", Z_FAMILY, f"Experiment Z: Y's rare collapses on {len(Z_SEEDS)} fresh seeds (lag {Y_LAG}, "
                                   f"T = {X_DIGITS + 1})"),
            "Q": ("S1X", Q_FAMILY, f"Experiment Q: a heavy-tailed precision-like gap in the target regime (T = "
                                   f"{X_DIGITS + 1}, noise {Q_NOISE})"),
            "D": ("S1D", D_FAMILY, f"Experiment D: a dense precision-like gap in the target regime (T = "
                                   f"{X_DIGITS + 1}, noise {D_NOISE})"),
            "A": ("S2D", A_FAMILY, f"Experiment A: a stale engine (lag {A_LAG}) with a dense precision-like gap "
                                   f"(T = {X_DIGITS + 1}, noise {D_NOISE})"),
            **{name: (scenario, ((scenario, "M3"),), f"Experiment {name}: a stale engine (lag {A_LAG}) with a smaller "
                                                      f"dense gap (T = {X_DIGITS + 1}, noise {noise})")
               for name, (scenario, noise, _, _) in GAP_LADDER.items()},
        }[experiment]
        established = {"C": C_GAP_SEEDS_0_9, "Z": Y_GAP_SEEDS_75_84}.get(experiment)
        text, result = analyse_family(runs, seeds, scenario, family, title, established=established)
        if experiment == "P" and held_out:
            text += "\n\n" + p_held_out_text(runs, result, held_out)
        if experiment == "Z":
            text += "\n\n" + collapse_free_text(runs, seeds, "S2X", Z_ARMS)
            alarm_text, result["alarm"] = alarm_analysis(runs, seeds)
            text += "\n\n" + alarm_text
        if experiment in TARGET_FAMILY and held_out:
            text += "\n\n" + held_out_row_text(runs, result, held_out, "S2X")
        if experiment in HELD_OUT_EXPERIMENTS:
            signed = experiment in SIGNED_HELD_OUT
            rule_c = q_rule_c_text(result) + "\n\n" if any(m == "M0" for _, m in family) else ""
            text += ("\n\n" + rule_c + q_tost_text(runs, seeds, result, scenario, family)
                     + "\n\n" + q_held_out_text(runs, result, held_out or [], scenario, signed=signed))
        hurt, result["hurt"] = hurt_table(runs)
        text += "\n\n### The \"does it hurt?\" metrics of these runs\n\n" + hurt
    else:
        text, result = hurt_table(runs, costly_scenarios(runs))
        same, result["package_vs_trl"] = package_vs_trl(runs)
        text += "\n\n" + same
    with open(os.path.join(out, "analysis.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out, "analysis.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    try:
        plot(runs, seeds, os.path.join(out, "mismatch_train.png"))
    except ImportError:
        pass
    return text


def q_rule_c_text(result: dict) -> str:
    """Pre-registrations 10 and 11, rule (c): TRL's default COSTS in S1X (S1D) iff M0 - M1 > 0 with both Holm p's
    (over Q_FAMILY / D_FAMILY) below ALPHA, whether or not the mismatch's own cost counts (rule (a)). Sets
    ``result["trl_default_costs"]``."""
    row = next((r for r in result["family"] if r["method"] == "M0"), None)
    costs = bool(row is not None and row["diff"] > 0 and row["p_sign_flip_holm"] < ALPHA and row["p_holm"] < ALPHA)
    result["trl_default_costs"] = costs
    if row is None:
        return "**Rule (c)** (does TRL's default cost against no correction?): M0 and M1 not both run yet."
    return (f"**Rule (c)** (does TRL's default cost against no correction?): M0 − M1 {row['diff']:+.4f} "
            f"[{row['diff_lo']:+.4f}, {row['diff_hi']:+.4f}], Holm p {row['p_sign_flip_holm']:.3g} (sign-flip), "
            f"{row['p_holm']:.3g} (t): " + ("TRL's default COSTS reward here." if costs else
                                            "no significant cost of TRL's default."))


def q_tost_text(runs: list[dict], seeds: list[int], result: dict, scenario: str = "S1X",
                family: tuple = Q_FAMILY) -> str:
    """Experiments Q's and D's "ties", descriptive (no decision rests on them; written after Q's first seeds had
    run, at the margin TOST_MARGIN fixed in pre-registration 1): TOST within +-TOST_MARGIN (90% paired interval) for the
    mismatch's cost on_policy - M0 and for each family row (method - M1). Sets ``result["tost"]``."""
    table, result["tost"] = score_table(runs), []
    lines = [f"**Equivalence** (TOST ±{TOST_MARGIN}, 90% paired interval; descriptive, at pre-registration 1's "
             "margin):\n", "| comparison | n | difference | 90% interval | TOST p | equivalent |",
             "|---|---|---|---|---|---|"]
    for method, ref in (("on_policy", "M0"), *((m, REFERENCE) for _, m in family)):
        common, x, y = paired(table, scenario, method, ref, seeds)
        if len(common) < 2:
            continue
        row = _stats().compare_paired(x, y, margin=TOST_MARGIN)
        result["tost"].append({**row, "method": method, "ref": ref})
        lines.append(f"| {method} − {ref} | {row['n']} | {row['diff']:+.4f} | [{row['tost_lo']:+.4f}, "
                     f"{row['tost_hi']:+.4f}] | {row['tost_p']:.3g} | {'yes' if row['tost_p'] < ALPHA else 'no'} |")
    return "\n".join(lines)


def q_held_out_methods(result: dict, signed: bool = False) -> list[str]:
    """Pre-registrations 10 and 11's held-out rows: every method rule (b) confirms (M3, M2) and M0 if rule (c) holds;
    with ``signed`` (pre-registration 13) every family row whose difference has both Holm p's below ALPHA, of either
    sign."""
    if signed:
        return [r["method"] for r in result["family"]
                if r["p_sign_flip_holm"] < ALPHA and r["p_holm"] < ALPHA and r["diff"] != 0]
    if "trl_default_costs" not in result:
        q_rule_c_text(result)
    found = [m for m in result["confirmed"] if m != "M0"]
    return found + (["M0"] if result["trl_default_costs"] else [])


def q_held_out_text(runs: list[dict], result: dict, seeds: list[int], scenario: str = "S1X",
                    signed: bool = False) -> str:
    """Each held-out row of :func:`q_held_out_methods` - M1 on ``seeds`` (Q_HELD_OUT / D_HELD_OUT / A_HELD_OUT) in
    ``scenario``: it survives iff the held-out mean difference has the sign it had on the analysis seeds (positive
    for Q's and D's rows; either for ``signed``, pre-registration 13). Sets ``result["held_out"]``: method -> row."""
    methods = q_held_out_methods(result, signed)
    if not methods:
        return ("**Held-out seeds**: no family row was significant, so none ran." if signed else
                "**Held-out seeds**: rules (b) and (c) found nothing, so none ran.")
    sign = {r["method"]: (1 if r["diff"] > 0 else -1) for r in result["family"]} if signed else {}
    table, lines, result["held_out"] = score_table(runs), [], {}
    for method in methods:
        common, x, ref = paired(table, scenario, method, REFERENCE, seeds)
        if len(common) < 2:
            lines.append(f"**Held-out seeds**: {method} and M1 not run yet.")
            continue
        row = _stats().compare_paired(x, ref)
        survives = row["diff"] * sign.get(method, 1) > 0
        result["held_out"][method] = {**row, "survives": survives}
        lines.append(f"**Held-out seeds** {seeds[0]}-{seeds[-1]} (run after the choice): {method} − M1 "
                     f"{row['diff']:+.4f} [{row['diff_lo']:+.4f}, {row['diff_hi']:+.4f}] (n {row['n']}, paired t p "
                     f"{row['p']:.3g}): " + ("the same sign: SURVIVES." if survives else
                                             "the sign flips: does NOT survive."))
    return "\n\n".join(lines)


def p_candidate(result: dict) -> dict | None:
    """Experiment P's held-out candidate: the confirmed family row with the largest mean difference vs M1."""
    rows = [r for r in result["family"] if r["confirmed"]]
    best = max(rows, key=lambda r: r["diff"]) if rows else None
    return None if best is None else {"scenario": best["scenario"], "method": best["method"], "diff": best["diff"]}


def p_cost_held_out(runs: list[dict], seeds: list[int]) -> dict | None:
    """Pre-registration 4: S3's cost on_policy - M0 on the held-out ``seeds`` (confirmed iff positive, as on P_SEEDS);
    None with fewer than 2 paired seeds."""
    common, o, u = paired(score_table(runs), "S3", "on_policy", "M0", seeds)
    if len(common) < 2:
        return None
    row = _stats().compare_paired(o, u)
    return {**row, "confirmed": row["diff"] > 0}


def p_held_out_text(runs: list[dict], result: dict, seeds: list[int]) -> str:
    """Experiment P's held-out checks: S3's cost (pre-registration 4) and the candidate - M1 on ``seeds`` (survives
    iff the same sign)."""
    cost = p_cost_held_out(runs, seeds)
    head = ("" if cost is None else
            f"**Held-out seeds** {seeds[0]}-{seeds[-1]}, the cost of truncation (pre-registration 4): on_policy − M0 "
            f"{cost['diff']:+.4f} [{cost['diff_lo']:+.4f}, {cost['diff_hi']:+.4f}] (n {cost['n']}, paired t p "
            f"{cost['p']:.3g}, sign-flip p {cost['p_sign_flip']:.3g}): "
            + ("the same sign: CONFIRMED.\n\n" if cost["confirmed"] else "the sign flips: NOT confirmed.\n\n"))
    if cost is not None:
        result["held_out_cost"] = cost
    return head + held_out_row_text(runs, result, seeds, "S3")


def alarm_analysis(runs: list[dict], seeds: list[int], scenario: str = "S2X", method: str = REFERENCE,
                   title: str = "Z") -> tuple[str, dict]:
    """Pre-registration 8: the alarm (:func:`alarm_step`) against the collapse outcome on ``method``'s runs in
    ``scenario`` on ``seeds``: sensitivity and false-alarm rate with Clopper-Pearson 95% intervals, per collapsed run
    the alarm's step and its first evaluation below COLLAPSE_FRACTION x start, and the pre-registered decision."""
    st = _stats()
    rs = [r for s, r in sorted(score_table(runs).get((scenario, method), {}).items()) if s in seeds]
    for r in rs:  # from a JSON (logs, curve) or a CSV row (the columns write_csv adds)
        if "logs" in r:
            r["alarm_step"], r["first_low_eval"] = alarm_step(r["logs"]), first_low_eval(r["curve"])
    collapsed = [r for r in rs if r["collapsed"]]
    healthy = [r for r in rs if not r["collapsed"]]
    hits = [r for r in collapsed if r.get("alarm_step") is not None]
    false = [r for r in healthy if r.get("alarm_step") is not None]
    sens = len(hits) / len(collapsed) if collapsed else math.nan
    far = len(false) / len(healthy) if healthy else math.nan
    sens_ci = st.clopper_pearson(len(hits), len(collapsed)) if collapsed else (math.nan, math.nan)
    far_ci = st.clopper_pearson(len(false), len(healthy)) if healthy else (math.nan, math.nan)
    adopt = (len(collapsed) >= ALARM_MIN_COLLAPSES and sens >= ALARM_MIN_SENSITIVITY
             and (not healthy or far <= ALARM_MAX_FALSE_ALARM))
    result = dict(n=len(rs), collapsed=len(collapsed), alarmed_collapsed=len(hits), healthy=len(healthy),
                  alarmed_healthy=len(false), sensitivity=sens, sensitivity_ci=sens_ci, false_alarm_rate=far,
                  false_alarm_ci=far_ci, adopt=adopt,
                  runs=[dict(seed=r["seed"], collapsed=r["collapsed"], alarm_step=r.get("alarm_step"),
                             first_low_eval=r.get("first_low_eval")) for r in rs])
    lines = [f"### The sequence-weight alarm on {title}'s {method} runs (pre-registration 8)\n",
             f"Rule: `{ALARM_KEY}` below {ALARM_THRESHOLD} on {ALARM_CONSECUTIVE} consecutive logged generations. "
             f"{method} runs in {scenario}, seeds {seeds[0]}-{seeds[-1]} ({len(rs)} runs).\n",
             "| outcome | runs | alarmed | rate | 95% (Clopper-Pearson) |", "|---|---|---|---|---|",
             f"| collapsed | {len(collapsed)} | {len(hits)} | {sens:.2f} | [{sens_ci[0]:.2f}, {sens_ci[1]:.2f}] |",
             f"| not collapsed | {len(healthy)} | {len(false)} | {far:.2f} | [{far_ci[0]:.2f}, {far_ci[1]:.2f}] |",
             "\n| seed | collapsed | alarm at step | first evaluation below half its start |", "|---|---|---|---|"]
    for r in rs:
        if r["collapsed"] or r.get("alarm_step") is not None:
            lines.append(f"| {r['seed']} | {'yes' if r['collapsed'] else 'no'} | {r.get('alarm_step') or '—'} | "
                         f"{r.get('first_low_eval') or '—'} |")
    lines.append(f"\n**Decision (pre-registered rule)**: the alarm is {'ADOPTED' if adopt else 'NOT adopted'} (needs "
                 f">= {ALARM_MIN_COLLAPSES} collapses, sensitivity >= {ALARM_MIN_SENSITIVITY}, false alarms <= "
                 f"{ALARM_MAX_FALSE_ALARM}).")
    return "\n".join(lines), result


ALARM_KIND = {"S2X": "stale", "S1X": "persistent", "S1D": "persistent", "S2D": "stale and persistent"}


def alarm_pool(results: str = RESULTS, pool: tuple = ALARM_POOL) -> tuple[str, dict]:
    """Pre-registration 14: pre-registration 8's alarm judged on every run of TRL's default (M1) of ``pool``'s
    experiments (their committed CSVs in ``results``, the ``alarm_step`` and ``collapsed`` columns; an experiment
    whose CSV is absent has not run and is left out): per experiment, per kind of mismatch and pooled, the collapses,
    the alarms among them (sensitivity) and among the others (false-alarm rate), Clopper-Pearson 95% intervals, and
    the pre-registered decision on the pool."""
    st = _stats()
    groups = []
    for scenario, name, seeds in pool:
        path = os.path.join(results, ALARM_POOL_CSV[name])
        if not os.path.exists(path):
            continue
        rs = [r for r in runs_from_csv(path) if r["scenario"] == scenario and r["method"] == REFERENCE
              and r["seed"] in seeds]
        groups.append((name, ALARM_KIND[scenario], rs))

    def counts(rs):
        collapsed = [r for r in rs if r["collapsed"]]
        healthy = [r for r in rs if not r["collapsed"]]
        hits = sum(r["alarm_step"] is not None for r in collapsed)
        false = sum(r["alarm_step"] is not None for r in healthy)
        return dict(n=len(rs), collapsed=len(collapsed), alarmed_collapsed=hits, healthy=len(healthy),
                    alarmed_healthy=false, sensitivity=hits / len(collapsed) if collapsed else math.nan,
                    false_alarm_rate=false / len(healthy) if healthy else math.nan,
                    sensitivity_ci=st.clopper_pearson(hits, len(collapsed)) if collapsed else (math.nan, math.nan),
                    false_alarm_ci=st.clopper_pearson(false, len(healthy)) if healthy else (math.nan, math.nan))

    rows = [(name, counts(rs)) for name, _, rs in groups]
    kinds = sorted({kind for _, kind, _ in groups})
    rows += [(f"all {kind}", counts([r for _, k, rs in groups if k == kind for r in rs])) for kind in kinds]
    total = counts([r for _, _, rs in groups for r in rs])
    rows.append(("pooled", total))
    adopt = bool(total["collapsed"] >= ALARM_MIN_COLLAPSES and total["sensitivity"] >= ALARM_MIN_SENSITIVITY
                 and (not total["healthy"] or total["false_alarm_rate"] <= ALARM_MAX_FALSE_ALARM))

    def rate(k, n, ci):
        return "—" if not n else f"{k}/{n} = {k / n:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]"

    lines = ["### The sequence-weight alarm on every later run of TRL's default (pre-registration 14)\n",
             f"Rule (pre-registration 8, unchanged): `{ALARM_KEY}` below {ALARM_THRESHOLD} on {ALARM_CONSECUTIVE} "
             "consecutive logged generations. M1 runs (TRL's GRPOTrainer, sequence_mask C = 3, T = 257).\n",
             "| runs | n | collapsed | alarmed / collapsed (sensitivity, 95%) | alarmed / not collapsed (false "
             "alarms, 95%) |", "|---|---|---|---|---|"]
    for name, c in rows:
        lines.append(f"| {name} | {c['n']} | {c['collapsed']} | "
                     f"{rate(c['alarmed_collapsed'], c['collapsed'], c['sensitivity_ci'])} | "
                     f"{rate(c['alarmed_healthy'], c['healthy'], c['false_alarm_ci'])} |")
    lines.append(f"\n**Decision (pre-registration 14)**: the alarm is {'ADOPTED' if adopt else 'NOT adopted'} "
                 f"(needs >= {ALARM_MIN_COLLAPSES} collapses in the pool, sensitivity >= {ALARM_MIN_SENSITIVITY}, "
                 f"false alarms <= {ALARM_MAX_FALSE_ALARM}).")
    return "\n".join(lines), dict(groups=dict(rows), adopt=adopt)


def collapse_free_text(runs: list[dict], seeds: list[int], scenario: str, arms: tuple) -> str:
    """Pre-registration 7's descriptive lines: each pair of ``arms`` on the seeds where neither collapsed (the price
    of a method when nothing goes wrong), and each arm against the next one on every seed (M3 - M2 for Z)."""
    table = score_table(runs)
    lines = ["**Descriptive (no decision)**: each pair on the seeds where neither arm collapsed, and on all seeds.\n",
             "| pair | seeds without a collapse | a − b there | all seeds | a − b (95% CI) |", "|---|---|---|---|---|"]
    for i, a in enumerate(arms):
        for b in arms[i + 1:]:
            both = [s for s in seeds if s in table.get((scenario, a), {}) and s in table.get((scenario, b), {})]
            calm = [s for s in both if not table[(scenario, a)][s]["collapsed"]
                    and not table[(scenario, b)][s]["collapsed"]]
            d_calm = statistics.fmean(table[(scenario, a)][s]["score"] - table[(scenario, b)][s]["score"]
                                      for s in calm) if calm else math.nan
            if len(both) < 2:
                continue
            row = _stats().compare_paired([table[(scenario, a)][s]["score"] for s in both],
                                          [table[(scenario, b)][s]["score"] for s in both])
            lines.append(f"| {a} − {b} | {len(calm)} | {d_calm:+.4f} | {len(both)} | {row['diff']:+.4f} "
                         f"[{row['diff_lo']:+.4f}, {row['diff_hi']:+.4f}] |")
    return "\n".join(lines)


def held_out_row_text(runs: list[dict], result: dict, seeds: list[int], scenario: str) -> str:
    """The confirmed family row with the largest difference (:func:`p_candidate`) - M1 on the held-out ``seeds``: it
    survives iff the held-out mean difference has the same sign (experiments P, X and Y)."""
    candidate = p_candidate(result)
    if candidate is None:
        return "**Held-out family row**: nothing confirmed, so none ran."
    common, x, ref = paired(score_table(runs), scenario, candidate["method"], REFERENCE, seeds)
    if len(common) < 2:
        return f"**Held-out seeds** {seeds[0]}-{seeds[-1]}: {candidate['method']} and M1 not run yet."
    row = _stats().compare_paired(x, ref)
    same = row["diff"] * candidate["diff"] > 0
    result["held_out"] = {**row, "method": candidate["method"], "survives": same}
    return (f"**Held-out seeds** {seeds[0]}-{seeds[-1]} (run after the choice): {candidate['method']} − M1 "
            f"{row['diff']:+.4f} [{row['diff_lo']:+.4f}, {row['diff_hi']:+.4f}] (n {row['n']}, paired t p "
            f"{row['p']:.3g}, sign-flip p {row['p_sign_flip']:.3g}): "
            + ("the same sign: the choice SURVIVES." if same else "the sign flips: the choice does NOT survive."))


def held_out_cells(out: str, seeds: list[int], analysis_seeds: list[int]) -> list[tuple[str, str, int]]:
    """The held-out runs: only the candidate and M1 in the scenario it won, and S0 (from the analysis of
    ``analysis_seeds``); none when the analysis picked no candidate."""
    _, result = analyse(load_runs(out), analysis_seeds)
    candidate = result["candidate"]
    if candidate is None:
        print("no candidate: the analysis of the paired seeds picked none, so no held-out run", flush=True)
        return []
    s, m = candidate["scenario"], candidate["method"]
    todo = []
    for seed in seeds:
        todo += [(s, m, seed), (s, REFERENCE, seed), (COST_SCENARIO, m, seed), (COST_SCENARIO, REFERENCE, seed),
                 (COST_SCENARIO, "M0", seed)]
    return todo


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default="S0,S1,S2")
    p.add_argument("--methods", default="M0,M1,M2,M3,M4")
    p.add_argument("--seeds", default="0-9")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", default="outputs/mismatch_train")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--lr", type=float, default=None,
                   help=f"default {LR}, S2X's X_LR {X_LR} ({GPU_LR} at --size gpu: a placeholder)")
    p.add_argument("--held_out", action="store_true",
                   help="run --seeds as the held-out seeds: only the candidate the analysis of --analysis_seeds "
                        "picked, and M1, in its scenario and S0")
    p.add_argument("--analysis_seeds", default="0-9")
    p.add_argument("--report_only", action="store_true")
    p.add_argument("--without_on_policy", action="store_true", help="run only --methods (no on_policy run per seed)")
    p.add_argument("--experiment", default="main", choices=sorted(EXPERIMENTS),
                   help="the analysis analysis.md holds: " + "; ".join(f"{k}: {v}" for k, v in EXPERIMENTS.items()))
    p.add_argument("--s2l_lag", type=int, default=None, help="S2L's lag (the pilot only; default S2L_LAG)")
    p.add_argument("--x_lag", type=int, default=None, help="S2X's lag (the pilot only; default X_LAG)")
    p.add_argument("--s3_top_p", type=float, default=None, help="S3's top_p (the pilot only; default S3_TOP_P)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, in-process: the suite's check (seconds)")
    p.add_argument("--size", default="full", choices=("full", "smoke", "gpu"),
                   help="full: the committed CPU runs (465k parameters, T = 49); gpu: Qwen2.5-0.5B's shape in bf16 at "
                        "T = 512 (see GPU_SIZE; no run finished on a GPU yet); smoke: the suite's seconds")
    p.add_argument("--device", default=None, help="cpu (default) or cuda (default at --size gpu)")
    p.add_argument("--n_digits", type=int, default=None,
                   help="the task's length (T = n_digits + 1): 48 at full, 511 at gpu (1023 / 2047 / 4095 for T up to "
                        "4096)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast at any size (default at --size gpu only)")
    p.add_argument("--noise_pilot", action="store_true",
                   help="pre-registrations 10 and 11's calibration of S1X's and S1D's noise (Q_PILOT, D_PILOT), "
                        "no training")
    p.add_argument("--alarm_pool", action="store_true",
                   help="pre-registration 14: the sequence-weight alarm on every later run of TRL's default, from the "
                        "committed results (no training)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    size = full_size()
    if a.s2l_lag is not None:
        global S2L_LAG
        S2L_LAG = a.s2l_lag
    global X_LAG
    if a.x_lag is not None:
        X_LAG = a.x_lag
    elif a.experiment in ("Y", "Z"):  # pre-registrations 6 and 7: S2X at twice the lag
        X_LAG = Y_LAG
    if a.s3_top_p is not None:
        global S3_TOP_P
        S3_TOP_P = a.s3_top_p
    if a.smoke or a.size == "smoke":
        size.update({k: v for k, v in SMOKE.items() if k != "steps"})
        a.size = "smoke"
    if a.size == "gpu":
        size.update(GPU_SIZE)
    size["device"] = a.device or size.get("device", "cpu")
    size["bf16"] = a.bf16 or size.get("bf16", False)
    if a.n_digits is not None:
        size["n_digits"] = a.n_digits
    size["name"] = a.size
    if size["device"].startswith("cuda"):  # this process forks the base build and the runs: it must not touch CUDA
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # an is_available() in an import: NVML, no cuInit
    if size["device"].startswith("cuda") and not cuda_available_in_child():
        import torch

        p.error(f"--device {size['device']}: torch.cuda.is_available() is False here (torch {torch.__version__}); "
                "run on a machine with a CUDA GPU and a CUDA build of torch, or pass --device cpu")
    if a.alarm_pool:
        print(alarm_pool()[0])
        return
    if a.noise_pilot:
        build_base(a.out, cell_size("S1X", size), cell_base(a.out, "S1X", size))
        noise_pilot(a.out, size)
        return
    if a.worker:
        scenario, method, seed = a.worker.split(":")
        run_one(scenario, method, int(seed), a.steps, run_path(a.out, scenario, method, int(seed)),
                cell_base(a.out, scenario, size), cell_size(scenario, size), lr=scenario_lr(scenario, a.lr, a.size))
        return
    scenarios = [s for s in a.scenarios.split(",") if s]
    methods = [m for m in a.methods.split(",") if m]
    unknown = [s for s in scenarios if s not in SCENARIOS] + [m for m in methods if m not in METHODS]
    if unknown:
        p.error(f"unknown scenario(s)/method(s) {unknown}")
    seeds = parse_seeds(a.seeds)
    t0 = time.time()
    if a.smoke:
        steps = SMOKE["steps"]
        for scenario in {s if s in LONG_SCENARIOS else "S0" for s in scenarios}:
            build_base(a.out, cell_size(scenario, size), cell_base(a.out, scenario, size))
        for cell in cells(scenarios, methods, seeds, on_policy=not a.without_on_policy):
            path = run_path(a.out, *cell)
            if not os.path.exists(path):
                run_one(*cell, steps, path, cell_base(a.out, cell[0], size), cell_size(cell[0], size),
                        lr=scenario_lr(cell[0], a.lr, a.size),
                        threads=1)
        print(report(a.out, seeds, experiment=a.experiment))
        print(f"total {time.time() - t0:.0f} s")
        return
    analysis_seeds = parse_seeds(a.analysis_seeds)
    if not a.report_only:
        for scenario in {s if s in LONG_SCENARIOS else "S0" for s in scenarios}:
            in_child(build_base, a.out, cell_size(scenario, size), cell_base(a.out, scenario, size),
                     fork=size["device"] != "cpu")
        if a.held_out and a.experiment in TARGET_FAMILY:  # pre-registrations 5-7: only a confirmed row and M1
            _, result = analyse_family(load_runs(a.out), analysis_seeds, "S2X", TARGET_FAMILY[a.experiment],
                                       a.experiment, established=Y_GAP_SEEDS_75_84 if a.experiment == "Z" else None)
            candidate = p_candidate(result)
            todo = [] if candidate is None else cells(["S2X"], [candidate["method"], REFERENCE], seeds, False)
            if candidate is None:
                print("nothing confirmed on the analysis seeds, so no held-out run", flush=True)
        elif a.held_out and a.experiment in HELD_OUT_EXPERIMENTS:  # pre-registrations 10, 11, 13, 15, 16: rows, M1
            scenario, family = HELD_OUT_EXPERIMENTS[a.experiment][:2]
            _, result = analyse_family(load_runs(a.out), analysis_seeds, scenario, family, a.experiment)
            methods = q_held_out_methods(result, a.experiment in SIGNED_HELD_OUT)
            todo = cells([scenario], methods + [REFERENCE], seeds, False) if methods else []
            if not methods:
                print("no family row qualifies on the analysis seeds, so no held-out run", flush=True)
        elif a.held_out and a.experiment == "P":  # the candidate of P's analysis and M1, in S3
            _, result = analyse_family(load_runs(a.out), analysis_seeds, "S3", P_FAMILY, "P")
            candidate = p_candidate(result)
            todo = cells(["S3"], ["M0"], seeds)  # pre-registration 4: P_HELD_OUT_ARMS
            if candidate is not None:
                todo += cells(["S3"], [candidate["method"], REFERENCE], seeds, False)
        else:
            todo = (held_out_cells(a.out, seeds, analysis_seeds) if a.held_out else
                    cells(scenarios, methods, seeds, on_policy=not a.without_on_policy))
        run_all(todo, a.steps, a.out, a.jobs, size, a.lr)
    print(report(a.out, analysis_seeds if a.held_out else seeds, seeds if a.held_out else None, a.experiment))
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
