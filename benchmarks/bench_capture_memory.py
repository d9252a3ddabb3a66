"""Peak memory of the generation phase: the pi_rollout capture vs TRL's GRPOTrainer (which captures nothing).

One generation batch goes through each trainer's own ``_generate_single_turn`` (TRL's transformers ``generate``
path; ours wraps it with ``capture_sampling_logprobs``): 16 completions of exactly S = 256 tokens
(``min_new_tokens``) from a Qwen2-style model with a V = 32,000 vocabulary. Variants:

* ``trl``: TRL 1.16 ``GRPOTrainer`` (the baseline: no log-probs kept on this path);
* ``ours``: ``RolloutCorrGRPOTrainer`` with today's lean capture (one (B, V) buffer at a time);
* ``ours_output_scores``: the same trainer with the previous capture re-created here (``generate(output_scores=True,
  return_dict_in_generate=True)``, S buffers of (B, V) kept until the end): the "before" number.

Measurement (CPU): the process's resident-set high-water mark over the measured ``_generate_single_turn`` call only:
``/proc/self/clear_refs`` <- 5 resets ``VmHWM`` to the current RSS right before the call, ``VmHWM`` is read right
after. Reported: that peak ("peak RSS") and the peak minus the RSS just before the call ("generation increment").
Workers run with ``MALLOC_MMAP_THRESHOLD_=65536`` so that glibc serves every tensor buffer above 64 KiB by ``mmap``
and returns it on free (otherwise its adaptive threshold recycles freed buffers inside the heap and RSS lags the live
memory). On CUDA (``--device cuda``): ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, and the
increment over ``memory_allocated`` before the call.

Every variant runs in its own fresh process (a first ``train()``/generation in a process changes later timings and
allocator state), one warm-up generation precedes the measured one, variants are interleaved over repeats in
alternating order, and medians are reported as ratios against ``trl`` from the same run.

    python benchmarks/bench_capture_memory.py                   # V=32000, 16 x 256 tokens, 3 repeats
    python benchmarks/bench_capture_memory.py --repeats 5 --vocab 151936 --completion 512
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

if not __package__:  # run as a script (python benchmarks/x.py): this checkout's root first, for benchmarks.*
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BASELINE = "trl"
VARIANTS = [BASELINE, "ours", "ours_output_scores"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--completions", type=int, default=16, help="completions in the generation batch")
    parser.add_argument("--num-generations", type=int, default=4, help="completions per prompt")
    parser.add_argument("--completion", type=int, default=256, help="tokens per completion (forced)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------------------------- the old capture
@contextlib.contextmanager
def output_scores_capture(model, sampler=None):
    """The capture as it was before the lean one: every step's processed scores are kept by ``generate``."""
    import torch

    captured = {}
    generate = sampler if sampler is not None else model.generate

    def generate_and_capture(*args, **kwargs):
        kwargs.update(output_scores=True, return_dict_in_generate=True)
        out = generate(*args, **kwargs)
        prompt_length = kwargs["input_ids"].shape[1]
        generated = out.sequences[:, prompt_length:]  # (B, S)
        captured["logprobs"] = torch.cat([torch.log_softmax(z.float(), -1).gather(-1, generated[:, t : t + 1])
                                          for t, z in enumerate(out.scores)], dim=1)  # (B, S)
        return out.sequences

    model.generate = generate_and_capture
    try:
        yield captured
    finally:
        del model.generate


# ---------------------------------------------------------------------------------------------- one run (worker)
def _proc_status_kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        return int(re.search(rf"^{field}:\s+(\d+) kB", fh.read(), re.M).group(1))


def run_variant(opts) -> dict:
    import torch
    from datasets import Dataset
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trl_rollout_corr.testing.toy_task import build_tokenizer

    torch.set_num_threads(opts.threads)
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    config = Qwen2Config(vocab_size=opts.vocab, hidden_size=opts.hidden, intermediate_size=4 * opts.hidden,
                         num_hidden_layers=opts.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=opts.completion + 64, tie_word_embeddings=False, pad_token_id=0,
                         eos_token_id=1, bos_token_id=3)
    model = Qwen2ForCausalLM(config)
    common = dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=opts.completions,
                  num_generations=opts.num_generations, max_completion_length=opts.completion, max_steps=1,
                  report_to="none", save_strategy="no", use_cpu=opts.device == "cpu", bf16=False, seed=0,
                  dataloader_num_workers=0, beta=0.0, generation_kwargs={"min_new_tokens": opts.completion})
    dataset = Dataset.from_dict({"prompt": ["rev 1 2 3 ="] * 8})

    def reward(completions, **_):
        return [0.0] * len(completions)

    variant = opts.worker
    if variant == BASELINE:
        from trl import GRPOConfig, GRPOTrainer

        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(**common), train_dataset=dataset,
                              processing_class=tokenizer)
    else:
        import trl_rollout_corr.grpo.trainer as ours

        if variant == "ours_output_scores":
            ours.capture_sampling_logprobs = output_scores_capture
        trainer = ours.RolloutCorrGRPOTrainer(
            model=model, reward_funcs=reward, train_dataset=dataset, processing_class=tokenizer,
            args=ours.RolloutCorrGRPOConfig(**common, rollout_correction_preset="decoupled_token_is"))

    g = torch.Generator().manual_seed(1)
    n_prompts = opts.completions // opts.num_generations
    prompts = [torch.randint(4, 16, (6,), generator=g).tolist() for _ in range(n_prompts)]
    prompt_ids = [p for p in prompts for _ in range(opts.num_generations)]  # what TRL's repeat sampler hands over
    cuda = opts.device == "cuda"

    def generate():
        torch.manual_seed(2)
        return trainer._generate_single_turn(prompt_ids, None, {}, opts.num_generations)

    generate()  # warm-up: first-call allocations (caches, kernels) are not the capture's
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        before = _proc_status_kb("VmRSS") * 1024
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # reset the RSS high-water mark to the current RSS
    start = time.perf_counter()
    completion_ids, logprobs = generate()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if cuda else _proc_status_kb("VmHWM") * 1024
    lengths = sorted({len(c) for c in completion_ids})
    return {"variant": variant, "peak_mb": peak / 2**20, "increment_mb": (peak - before) / 2**20,
            "before_mb": before / 2**20, "seconds": seconds, "lengths": lengths,
            "logprobs": None if logprobs is None else sum(len(lp) for lp in logprobs)}


# ---------------------------------------------------------------------------------------------- the driver
def main(argv=None) -> None:
    opts = parse_args(argv)
    if opts.worker:
        result = run_variant(opts)
        with open(opts.out, "w") as fh:
            json.dump(result, fh)
        return
    variants = list(dict.fromkeys([BASELINE] + opts.variants))
    shared = ["--vocab", str(opts.vocab), "--completions", str(opts.completions), "--num-generations",
              str(opts.num_generations), "--completion", str(opts.completion), "--hidden", str(opts.hidden),
              "--layers", str(opts.layers), "--threads", str(opts.threads), "--device", opts.device]
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false",
           "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": str(opts.threads)}
    results: dict[str, list[dict]] = {v: [] for v in variants}
    started = time.time()
    for repeat in range(opts.repeats):
        for variant in variants if repeat % 2 == 0 else variants[::-1]:
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
                out = fh.name
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", variant, "--out", out, *shared]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"{variant} failed:\n{proc.stderr[-4000:]}")
            with open(out) as fh:
                r = json.load(fh)
            results[variant].append(r)
            print(f"  repeat {repeat + 1}/{opts.repeats} {variant:20s} peak {r['peak_mb']:8.1f} MB  increment "
                  f"{r['increment_mb']:8.1f} MB  {r['seconds']:6.1f} s  lengths {r['lengths']}", flush=True)

    def med(variant, key):
        return statistics.median(r[key] for r in results[variant])

    base_peak, base_inc = med(BASELINE, "peak_mb"), med(BASELINE, "increment_mb")
    buffer_mb = opts.completions * opts.vocab * 4 / 2**20
    print(f"\nQwen2 hidden {opts.hidden}, {opts.layers} layers, V = {opts.vocab}; {opts.completions} completions x "
          f"{opts.completion} tokens; device {opts.device}; {opts.threads} thread(s); {opts.repeats} repeats; "
          f"one (B, V) float32 buffer = {buffer_mb:.1f} MB, S of them = {buffer_mb * opts.completion:.0f} MB; "
          f"wall {time.time() - started:.0f} s\n")
    print(f"| variant | peak (MB, median) | vs {BASELINE} | generation increment (MB) | vs {BASELINE} | "
          "generate (s) |")
    print("|---|---|---|---|---|---|")
    for variant in variants:
        peak, inc = med(variant, "peak_mb"), med(variant, "increment_mb")
        print(f"| {variant} | {peak:.0f} | {peak / base_peak:.3f} | {inc:.0f} | {inc / base_inc:.2f} | "
              f"{med(variant, 'seconds'):.1f} |")


if __name__ == "__main__":
    main()
