"""The GPU check: one command, one CUDA GPU, bf16, a model of Qwen2.5-0.5B's real shape (random weights, no download).

    python benchmarks/gpu_check.py --out DIR            # on a GPU (sized for one H100: < 5 minutes)
    python benchmarks/gpu_check.py --out DIR --toy      # the same code paths, toy size, CPU (the suite's run)

Phases, cheapest and most informative first; each in its own try/except (the traceback goes into the JSON and the run
goes on), and ``DIR/gpu_check.json`` + ``DIR/gpu_check.md`` are rewritten after every phase (and after every preset),
so a run cut short still leaves what it measured. Once ``--budget_s`` seconds have passed, the remaining phases (and
presets) are skipped and marked so. The costs below are estimates for one H100 (not measured yet):

1. ``env``: versions, the GPU, which optional packages got imported (vllm, deepspeed must not be). ~0 s.
2. ``model``: Qwen2.5-0.5B's config (hidden 896, 24 layers, 14/2 heads, intermediate 4864, vocabulary 151,936, tied
   embeddings, rope theta 1e6) built on the GPU in bf16 with random weights, and a WordLevel tokenizer of the same
   151,936 entries (the toy task's words first). ~5 s.
3. ``probe_cost``: the truncated-support probe (``rollout/support.py``'s KeptMassProbe over ``core/truncation.py``)
   at top-p 0.9 and top-k 50 against TRL's fused LM-head log-prob (``ChunkedLogProbFunction``, forward, and forward +
   backward) on 16,384 tokens x hidden 896 and 3584 x vocabulary 151,936: ms and peak memory above the inputs.
   A 16k x 3584 x 152k projection is ~18 TFLOP (~30 ms); the probe also sorts 16k rows of 152k: ~1 s per call at
   most; 1 warm-up + 3 timed calls each. ~15 s.
4. ``step_time``: one optimizer step of the package's trainer (decoupled_token_is, ppo_is_bypass) against TRL's own
   GRPOTrainer with its pi_old forward (TRL's vLLM-IS path, as benchmarks/bench_step.py sets it) and without it, in
   this process, on the same pre-generated completions and log-probs (an instant ``rollout_func``, so generation is
   not in the step), at T = 512 (16 sequences) and T = 2048 (8 sequences): 16k tokens per step, ~60 TFLOP with the
   backward, ~0.3 s; 1 warm-up + 3 timed steps per variant, synchronized; ~3 s per trainer construction. ~45 s.
5. ``mismatch``: the bf16 sampler against the trainer's forward. ``generate`` samples 8 sequences of exactly 2048 new
   tokens (no EOS) with the package's log-prob capture (the trainer's transformers path); TRL's forward (the one both
   trainers run) scores them. Per-token k1 and k3 KL, max |log ratio|, T * KL, over the first T tokens for each T.
   Decoding is launch-bound, ~15-30 ms per token step: 2048 steps, 30-60 s. ~60 s.
6. ``preflight``: ``trl-rollout-corr probe``'s work (``trl_rollout_corr.cli.probe``) on one generation batch of 16 x 512
   tokens with top-p 0.95: its cost and what it reports. ~40 s.
7. ``presets``: every preset of ``RolloutCorrectionConfig.preset_names()`` (this package's, then verl's names), then
   top-p 0.9 and top-k 50 sampling (the probe in the loss), each a fresh RolloutCorrGRPOTrainer on the transformers
   generation path (use_vllm=False: the trainer captures the sampler's log-probs in ``generate``), 2 optimizer steps
   of 8 sequences x 32 tokens (toy: 1 step of 4): every loss and every logged ``rollout_corr/*`` value finite, host
   syncs per step (benchmarks/profiling.py's counter: this package's calls, and all callers). 24 runs x ~4 s
   (construction, 2 x 32 decoding steps, 2 steps). ~100 s.

Numbers in the JSON: seconds, milliseconds and GiB as named; ``finite`` flags. ``--toy``: a 2-layer hidden-64 model,
vocabulary 512, T 16/32, float32, CPU, every phase at that size (the test checks every phase ran with finite numbers).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not __package__:  # run as a script (python benchmarks/x.py): this checkout's root first, for benchmarks.*
    sys.path.insert(0, ROOT)
# this check never samples with vLLM: the package's guard then skips looking for it (the device has none)
os.environ.setdefault("TRL_ROLLOUT_CORR_NO_VLLM", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

PHASES = ("env", "model", "probe_cost", "step_time", "mismatch", "preflight", "presets")

# Qwen2.5-0.5B's config.json (the architecture; weights random)
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0,
                  max_position_embeddings=32768, rms_norm_eps=1e-6, hidden_act="silu", use_sliding_window=False)
TOY_MODEL = dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=256,
                 rms_norm_eps=1e-6, hidden_act="silu", use_sliding_window=False)

SIZES = {
    "gpu": dict(probe_tokens=16384, probe_hidden=(896, 3584), probe_reps=3,
                step_lengths={512: 16, 2048: 8}, step_timed=3,
                mismatch_batch=8, mismatch_lengths=(128, 512, 2048),
                preflight_batch=16, preflight_length=512,
                preset_batch=8, preset_length=32, preset_steps=2),
    "toy": dict(probe_tokens=256, probe_hidden=(64, 128), probe_reps=1,
                step_lengths={16: 8, 32: 4}, step_timed=1,
                mismatch_batch=4, mismatch_lengths=(8, 16, 32),
                preflight_batch=4, preflight_length=16,
                preset_batch=4, preset_length=16, preset_steps=1),
}
STEP_VARIANTS = ("trl_pi_old", "trl_no_old", "decoupled_token_is", "ppo_is_bypass")
TRUNCATED_RUNS = {"top_p_0.9": ("decoupled_token_is", dict(top_p=0.9)),
                  "top_k_50": ("ppo_is_bypass", dict(top_k=50))}
NUM_GENERATIONS = 4


# ---------------------------------------------------------------------------------------------- the report
class Report:
    """The JSON (and its Markdown summary), rewritten after every phase."""

    def __init__(self, out: str, budget_s: float, meta: dict) -> None:
        self.out, self.budget_s, self.start = out, budget_s, time.perf_counter()
        self.data = {"meta": meta, "phases": {}}
        os.makedirs(out, exist_ok=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def over_budget(self) -> bool:
        return self.elapsed() > self.budget_s

    def run(self, name: str, fn, *args) -> None:
        entry = self.data["phases"][name] = {"status": "running"}
        if self.over_budget():
            entry.update(status="skipped", reason=f"budget of {self.budget_s:.0f} s spent ({self.elapsed():.0f} s)")
            print(f"[gpu_check] {name}: skipped (budget)", flush=True)
            self.write()
            return
        print(f"[gpu_check] {name}: start at {self.elapsed():.1f} s", flush=True)
        began = time.perf_counter()
        try:
            entry["result"] = {}
            fn(entry["result"], *args)
            entry["status"] = "ok"
        except Exception:  # noqa: BLE001 (each phase records its failure and the run goes on)
            entry["status"] = "error"
            entry["traceback"] = traceback.format_exc()
            print(f"[gpu_check] {name}: ERROR\n{entry['traceback']}", flush=True)
        entry["seconds"] = round(time.perf_counter() - began, 3)
        print(f"[gpu_check] {name}: {entry['status']} in {entry['seconds']:.1f} s", flush=True)
        self.write()

    def write(self) -> None:
        self.data["meta"]["elapsed_s"] = round(self.elapsed(), 3)
        tmp = os.path.join(self.out, "gpu_check.json.tmp")
        with open(tmp, "w") as fh:
            json.dump(self.data, fh, indent=1, default=_jsonable)
        os.replace(tmp, os.path.join(self.out, "gpu_check.json"))
        with open(os.path.join(self.out, "gpu_check.md"), "w") as fh:
            fh.write(markdown(self.data))


def _jsonable(x):
    try:
        return float(x)
    except Exception:  # noqa: BLE001
        return repr(x)


def _num(x, digits=3) -> str:
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int, float)):
        return f"{x:.{digits}g}" if isinstance(x, float) else str(x)
    return str(x)


def markdown(data: dict) -> str:
    meta, phases = data["meta"], data["phases"]
    lines = [f"# GPU check ({meta.get('mode')}), {meta.get('date')}", "",
             f"device: {meta.get('device_name')}; elapsed {meta.get('elapsed_s', 0):.0f} s", "",
             "| phase | status | seconds |", "|---|---|---|"]
    lines += [f"| {n} | {p['status']} | {_num(p.get('seconds'))} |" for n, p in phases.items()]
    res = lambda name: phases.get(name, {}).get("result") or {}  # noqa: E731
    if res("probe_cost"):
        lines += ["", "## Probe vs TRL's fused LM-head log-prob", "",
                  "| hidden | what | ms | peak GiB above inputs |", "|---|---|---|---|"]
        for hidden, rows in res("probe_cost").get("by_hidden", {}).items():
            for what, row in rows.items():
                lines.append(f"| {hidden} | {what} | {_num(row.get('ms'))} | {_num(row.get('peak_gib'))} |")
    if res("step_time"):
        lines += ["", "## Step time vs TRL's GRPOTrainer", "",
                  "| T | sequences | variant | step ms (median) | vs trl_pi_old | peak GiB | vs trl_pi_old |",
                  "|---|---|---|---|---|---|---|"]
        for length, block in res("step_time").get("by_length", {}).items():
            for variant, row in block.get("variants", {}).items():
                lines.append(f"| {length} | {block.get('sequences')} | {variant} | {_num(row.get('step_ms'))} | "
                             f"{_num(row.get('time_vs_trl_pi_old'))} | {_num(row.get('peak_gib'))} | "
                             f"{_num(row.get('memory_vs_trl_pi_old'))} |")
    if res("mismatch"):
        lines += ["", "## bf16 mismatch: sampler (generate) vs the trainer's forward", "",
                  "| T | tokens | k1 KL / token | k3 KL / token | max abs log ratio | T * k1 |",
                  "|---|---|---|---|---|---|"]
        for length, row in res("mismatch").get("by_length", {}).items():
            lines.append(f"| {length} | {row['tokens']} | {_num(row['k1'])} | {_num(row['k3'])} | "
                         f"{_num(row['max_abs_log_ratio'])} | {_num(row['t_times_k1'])} |")
    if res("preflight"):
        r = res("preflight")
        lines += ["", "## The pre-flight probe (trl-rollout-corr probe's work), top-p 0.95", "",
                  "| sequences x T | seconds | k3 / token | T*KL mean | kept mass | k3 before renormalizing "
                  "| seq ESS |",
                  "|---|---|---|---|---|---|---|",
                  f"| {r.get('sequences')} x {r.get('completion_tokens')} | {_num(r.get('seconds'))} | "
                  f"{_num(r.get('k3'))} | {_num(r.get('t_kl_mean'))} | {_num(r.get('kept_mass_mean'))} | "
                  f"{_num(r.get('k3_before_renormalization'))} | {_num(r.get('seq_ess'))} |"]
    if res("presets"):
        lines += ["", "## Presets (transformers generation path)", "",
                  "| run | status | losses | rollout_corr values | all finite | our syncs / step | all syncs / step |",
                  "|---|---|---|---|---|---|---|"]
        for name, row in res("presets").get("runs", {}).items():
            lines.append(f"| {name} | {row.get('status')} | {_num(row.get('losses'))} | "
                         f"{_num(row.get('rollout_corr_values'))} | {_num(row.get('finite'))} | "
                         f"{_num(row.get('our_syncs_per_step'))} | {_num(row.get('all_syncs_per_step'))} |")
    errors = [n for n, p in phases.items() if p["status"] == "error"]
    if errors:
        lines += ["", "Errors (tracebacks in gpu_check.json): " + ", ".join(errors)]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- shared state
class Context:
    def __init__(self, opts) -> None:
        import torch

        self.opts = opts
        self.toy = opts.toy
        self.sizes = SIZES["toy" if opts.toy else "gpu"]
        self.device = torch.device("cpu" if opts.toy else "cuda")
        self.dtype = torch.float32 if opts.toy else torch.bfloat16
        self.model = None
        self.tokenizer = None
        self.tmp = tempfile.mkdtemp(prefix="gpu_check_")

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def reset_peak(self) -> int:
        import torch

        if self.device.type != "cuda":
            return 0
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def peak(self) -> int:
        import torch

        return torch.cuda.max_memory_allocated() if self.device.type == "cuda" else 0

    def cleanup(self) -> None:
        import torch

        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def common_args(self, length: int, batch: int, steps: int) -> dict:
        """TrainingArguments shared by every trainer here: one micro-batch per generation batch, no KL term."""
        return dict(output_dir=os.path.join(self.tmp, "run"), per_device_train_batch_size=batch,
                    gradient_accumulation_steps=1, num_generations=NUM_GENERATIONS, max_completion_length=length,
                    max_steps=steps, learning_rate=1e-6, logging_steps=1, save_strategy="no", report_to="none",
                    use_cpu=self.toy, bf16=not self.toy, gradient_checkpointing=False, seed=0,
                    dataloader_num_workers=0, beta=0.0, temperature=1.0)

    def dataset(self, n: int = 256):
        from datasets import Dataset

        from trl_rollout_corr.testing.toy_task import reverse_prompts

        return Dataset.from_dict({"prompt": reverse_prompts(n, n_digits=6)})

    def release(self, trainer) -> None:
        """Drop a trainer and what it put on the shared model (TRL's fused-head forward, a capture wrapper)."""
        for name in ("forward", "generate"):
            vars(self.model).pop(name, None)
        del trainer
        self.cleanup()


def length_reward(completions, **_):
    """A reward that varies across a group (so advantages are not all zero)."""
    return [float(len(str(c)) % 7) / 7 for c in completions]


# ---------------------------------------------------------------------------------------------- 1. env
def phase_env(result: dict, ctx: Context) -> None:
    import torch
    import transformers

    import trl_rollout_corr
    from trl_rollout_corr import RolloutCorrGRPOTrainer  # noqa: F401  (the import the device must manage)
    from trl_rollout_corr.rollout.support import KeptMassProbe  # noqa: F401

    from benchmarks import profiling  # noqa: F401

    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "trl_rollout_corr": trl_rollout_corr.__version__}
    for name in ("trl", "accelerate", "datasets", "peft", "tokenizers", "triton", "pyarrow", "fsspec",
                 "huggingface_hub", "numpy"):
        try:
            versions[name] = __import__(name).__version__
        except Exception as exc:  # noqa: BLE001
            versions[name] = f"missing ({type(exc).__name__})"
    result["versions"] = versions
    result["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        result["gpu"] = {"name": props.name, "memory_gib": props.total_memory / 2**30,
                         "multiprocessors": props.multi_processor_count,
                         "capability": list(torch.cuda.get_device_capability()),
                         "cuda": torch.version.cuda, "bf16_supported": torch.cuda.is_bf16_supported()}
    elif not ctx.toy:
        raise RuntimeError("no CUDA device (run with --toy on a CPU)")
    # a None entry is the package's guard marking the module absent (TRL_ROLLOUT_CORR_NO_VLLM), not an import
    result["imported"] = {name: sys.modules.get(name) is not None for name in ("vllm", "deepspeed")}
    # relative to this checkout (a path outside it is named as such, never a machine's absolute path)
    package = os.path.dirname(trl_rollout_corr.__file__)
    inside = os.path.commonpath([package, ROOT]) == ROOT
    result["package_from"] = os.path.relpath(package, ROOT) if inside else "outside this checkout"


# ---------------------------------------------------------------------------------------------- 2. model
def build_tokenizer(vocab_size: int):
    """A WordLevel tokenizer of exactly ``vocab_size`` entries: the toy task's words (ids 0-15), then fillers."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from trl_rollout_corr.testing.toy_task import VOCAB

    vocab = {w: i for i, w in enumerate(VOCAB)}
    vocab.update({f"w{i}": i for i in range(len(VOCAB), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   bos_token="<bos>", padding_side="left")


def phase_model(result: dict, ctx: Context) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    spec = TOY_MODEL if ctx.toy else QWEN25_05B
    config = Qwen2Config(**spec, pad_token_id=0, eos_token_id=1, bos_token_id=3)
    torch.manual_seed(0)
    began = time.perf_counter()
    with torch.device(ctx.device):  # initialized where it runs (a 0.5B CPU init takes ~10 s)
        model = Qwen2ForCausalLM(config)
    model = model.to(ctx.dtype)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 1
    ctx.model = model
    ctx.tokenizer = build_tokenizer(config.vocab_size)
    ctx.sync()
    if len(ctx.tokenizer) != config.vocab_size:
        raise RuntimeError(f"tokenizer has {len(ctx.tokenizer)} entries, the model {config.vocab_size}")
    result.update(config={k: getattr(config, k, None) for k in spec if k != "rope_theta"},
                  rope_parameters=dict(getattr(config, "rope_parameters", None) or {}),
                  tied=model.get_output_embeddings().weight is model.get_input_embeddings().weight,
                  parameters=sum(p.numel() for p in model.parameters()), dtype=str(ctx.dtype),
                  attn_implementation=getattr(config, "_attn_implementation", None),
                  tokenizer_size=len(ctx.tokenizer), build_s=time.perf_counter() - began,
                  weights_gib=torch.cuda.memory_allocated() / 2**30 if ctx.device.type == "cuda" else 0.0)


# ---------------------------------------------------------------------------------------------- 3. probe cost
def _head_only_lm(weight, ctx: Context):
    """The smallest causal LM the probe accepts: a config, a backbone (``base_model``) and an output embedding."""
    import torch
    from transformers import Qwen2Config

    class Backbone(torch.nn.Module):
        def forward(self, input_ids=None, hidden=None):
            from types import SimpleNamespace

            return SimpleNamespace(last_hidden_state=hidden)

    class HeadOnly(torch.nn.Module):
        base_model_prefix = "model"

        def __init__(self):
            super().__init__()
            self.config = Qwen2Config(vocab_size=weight.size(0), hidden_size=weight.size(1), num_hidden_layers=1,
                                      num_attention_heads=1, num_key_value_heads=1, intermediate_size=8)
            self.model = Backbone()
            self.lm_head = torch.nn.Linear(weight.size(1), weight.size(0), bias=False, device=weight.device,
                                           dtype=weight.dtype)
            self.lm_head.weight = torch.nn.Parameter(weight, requires_grad=False)

        @property
        def base_model(self):
            return self.model

        def get_output_embeddings(self):
            return self.lm_head

    return HeadOnly()


def _measure(ctx: Context, fn, reps: int) -> dict:
    """ms per call (median of ``reps`` after one warm-up, synchronized) and peak memory above what was live."""
    fn()
    ctx.sync()
    base = ctx.reset_peak()
    times = []
    for _ in range(reps):
        ctx.sync()
        began = time.perf_counter()
        fn()
        ctx.sync()
        times.append((time.perf_counter() - began) * 1e3)
    return {"ms": statistics.median(times), "ms_all": times, "peak_gib": (ctx.peak() - base) / 2**30}


def phase_probe_cost(result: dict, ctx: Context) -> None:


    try:  # TRL 1.16's fused LM-head log-prob, as add_fused_lm_head calls it
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as chunk
        from trl.trainer.utils import _ChunkedLogProbFunction as chunked
    except ImportError:
        from trl.kernels import ChunkedLogProbFunction as chunked
        chunk = 32768
    vocab = ctx.model.config.vocab_size
    n, reps = ctx.sizes["probe_tokens"], ctx.sizes["probe_reps"]
    result.update(tokens=n, vocab=vocab, dtype=str(ctx.dtype), trl_chunk=chunk, by_hidden={})
    for hidden_size in ctx.sizes["probe_hidden"]:
        result["by_hidden"][str(hidden_size)] = _probe_rows(ctx, hidden_size, vocab, n, reps, chunked, chunk)
        ctx.cleanup()


def _probe_rows(ctx: Context, hidden_size: int, vocab: int, n: int, reps: int, chunked, chunk: int) -> dict:
    import torch

    from trl_rollout_corr.core.truncation import SamplingTruncation
    from trl_rollout_corr.rollout.support import KeptMassProbe

    gen = torch.Generator(device=ctx.device).manual_seed(hidden_size)
    weight = torch.randn(vocab, hidden_size, device=ctx.device, generator=gen).mul_(0.02).to(ctx.dtype)  # (V, H)
    hidden = torch.randn(1, n + 1, hidden_size, device=ctx.device, generator=gen).to(ctx.dtype)  # (1, N+1, H)
    ids = torch.randint(0, vocab, (1, n + 1), device=ctx.device, generator=gen)  # (1, N+1)
    targets = ids[0, 1:]  # (N,)
    lm = _head_only_lm(weight, ctx)
    rows: dict = {}
    outputs: dict = {}

    def trl_forward():
        with torch.no_grad():
            outputs["trl"] = chunked.apply(hidden[0, :-1], weight, None, targets, 1.0, chunk, None, 1.0,
                                           ("log_probs",))[0]  # (N,)

    def trl_forward_backward():
        h = hidden[0, :-1].detach().requires_grad_(True)  # (N, H)
        w = weight.detach().requires_grad_(True)  # (V, H)
        logps = chunked.apply(h, w, None, targets, 1.0, chunk, None, 1.0, ("log_probs",))[0]  # (N,)
        logps.sum().backward()

    def probe(truncation):
        def call():
            with KeptMassProbe(lm, truncation, n) as p:
                lm.base_model(input_ids=ids, hidden=hidden)
            outputs[str(truncation)] = p.result()  # (1, N) log M, (1, N) in support
        return call

    rows["trl_fused_logprob_forward"] = _measure(ctx, trl_forward, reps)
    rows["trl_fused_logprob_forward_backward"] = _measure(ctx, trl_forward_backward, reps)
    for label, truncation in (("probe_top_p_0.9", SamplingTruncation(top_p=0.9)),
                              ("probe_top_k_50", SamplingTruncation(top_k=50))):
        rows[label] = _measure(ctx, probe(truncation), reps)
        log_mass, in_support = outputs[str(truncation)]
        rows[label].update(kept_mass_mean=float(log_mass.float().exp().mean()),
                           in_support_fraction=float(in_support.float().mean()),
                           finite=bool(torch.isfinite(log_mass).all()),
                           vs_trl_forward=rows[label]["ms"] / rows["trl_fused_logprob_forward"]["ms"])
    rows["trl_fused_logprob_forward"]["finite"] = bool(torch.isfinite(outputs["trl"]).all())
    return rows


# ---------------------------------------------------------------------------------------------- 4. step time
def _instant_rollout_func(ctx: Context, length: int):
    """Pre-made completions of exactly ``length`` tokens and log-probs near a random-weight model's (~ -log V), the
    same for every trainer (seeded by prompt and index): generation stays out of the step."""
    import torch

    vocab = ctx.model.config.vocab_size

    def rollout_func(prompts, trainer):
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for index, prompt in enumerate(prompts):
            g = torch.Generator().manual_seed(zlib.crc32(f"{prompt}|{index}".encode()))
            out["prompt_ids"].append(ctx.tokenizer(prompt)["input_ids"])
            out["completion_ids"].append(torch.randint(16, vocab, (length,), generator=g).tolist())  # no EOS
            logprobs = -math.log(vocab) + 0.05 * torch.randn(length, generator=g)  # (length,)
            out["logprobs"].append(logprobs.clamp(max=-1e-3).tolist())
        return out

    return rollout_func


def _step_trainer(ctx: Context, variant: str, length: int, batch: int, steps: int, rollout_func):
    common = ctx.common_args(length, batch, steps)
    dataset = ctx.dataset()
    if variant.startswith("trl_"):
        from types import SimpleNamespace

        from trl import GRPOConfig, GRPOTrainer

        trainer = GRPOTrainer(model=ctx.model, reward_funcs=length_reward, args=GRPOConfig(**common),
                              train_dataset=dataset, processing_class=ctx.tokenizer, rollout_func=rollout_func)
        if variant == "trl_pi_old":  # TRL's vLLM path as its trainer sees it: pi_old forward + its IS correction
            trainer.use_vllm = True
            trainer.vllm_importance_sampling_correction = True
            trainer.vllm_generation = SimpleNamespace(sync_weights=lambda: None)
            trainer._last_loaded_step = -1
        return trainer
    from trl_rollout_corr import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

    return RolloutCorrGRPOTrainer(model=ctx.model, reward_funcs=length_reward,
                                  args=RolloutCorrGRPOConfig(**common, rollout_correction_preset=variant),
                                  train_dataset=dataset, processing_class=ctx.tokenizer, rollout_func=rollout_func)


def _timed_train(ctx: Context, trainer) -> dict:
    from transformers import TrainerCallback

    from benchmarks.profiling import count_host_syncs

    times: list[float] = []
    collected: list[dict] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            ctx.sync()
            self.began = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            ctx.sync()
            times.append(time.perf_counter() - self.began)

        def on_log(self, args, state, control, logs=None, **kwargs):
            collected.append(dict(logs or {}))

    trainer.add_callback(Timer())
    base = ctx.reset_peak()
    with count_host_syncs(everywhere=True) as syncs:
        trainer.train()
    ctx.sync()
    steps = max(1, trainer.state.global_step)
    ours = sum(n for site, n in syncs.items() if not site.startswith("ext:"))
    return {"times": times, "logs": collected, "peak": ctx.peak(), "base": base, "steps": trainer.state.global_step,
            "our_syncs_per_step": ours / steps, "all_syncs_per_step": sum(syncs.values()) / steps,
            "our_sync_sites": {k: v for k, v in syncs.items() if not k.startswith("ext:")}}


def _finite_logs(logs: list[dict]) -> tuple[int, int, list[str]]:
    """(losses seen, rollout_corr values seen, the names of non-finite ones)."""
    losses = values = 0
    bad = []
    for entry in logs:
        for key, value in entry.items():
            if key == "loss" or key.startswith("rollout_corr/"):
                if key == "loss":
                    losses += 1
                else:
                    values += 1
                if not (isinstance(value, (int, float)) and math.isfinite(value)):
                    bad.append(f"{key}={value!r}")
    return losses, values, bad


def phase_step_time(result: dict, ctx: Context) -> None:
    timed = ctx.sizes["step_timed"]
    result.update(timed_steps=timed, warmup_steps=1, by_length={})
    for length, batch in ctx.sizes["step_lengths"].items():
        block = result["by_length"][str(length)] = {"sequences": batch, "tokens_per_step": batch * length,
                                                    "variants": {}}
        rollout_func = _instant_rollout_func(ctx, length)
        for variant in STEP_VARIANTS:
            row = block["variants"][variant] = {}
            try:
                trainer = _step_trainer(ctx, variant, length, batch, 1 + timed, rollout_func)
                run = _timed_train(ctx, trainer)
                losses, values, bad = _finite_logs(run["logs"])
                step_times = run["times"][1:]  # the first (warm-up) step excluded
                row.update(step_ms=statistics.median(step_times) * 1e3, step_ms_all=[t * 1e3 for t in run["times"]],
                           peak_gib=run["peak"] / 2**30, peak_above_start_gib=(run["peak"] - run["base"]) / 2**30,
                           losses=losses, finite=not bad and losses > 0, nonfinite=bad,
                           our_syncs_per_step=run["our_syncs_per_step"], all_syncs_per_step=run["all_syncs_per_step"])
                if not variant.startswith("trl_"):
                    row["extra_forward"] = trainer.correction_plan.at_generation
                ctx.release(trainer)
                trainer = None
            except Exception:  # noqa: BLE001 (one variant's failure leaves the others)
                row["error"] = traceback.format_exc()
                print(f"[gpu_check] step_time T={length} {variant}: ERROR\n{row['error']}", flush=True)
                vars(ctx.model).pop("forward", None)
                ctx.cleanup()
            print(f"[gpu_check] step_time T={length} {variant}: {_num(row.get('step_ms'))} ms, "
                  f"peak {_num(row.get('peak_gib'))} GiB", flush=True)
        base = block["variants"].get("trl_pi_old", {})
        for row in block["variants"].values():
            if "step_ms" in row and "step_ms" in base:
                row["time_vs_trl_pi_old"] = row["step_ms"] / base["step_ms"]
                row["memory_vs_trl_pi_old"] = row["peak_gib"] / base["peak_gib"] if base["peak_gib"] else None
    errors = [f"T={t} {v}" for t, b in result["by_length"].items() for v, r in b["variants"].items() if "error" in r]
    if errors:
        raise RuntimeError(f"variants failed: {', '.join(errors)} (tracebacks under result)")


# ---------------------------------------------------------------------------------------------- 5. mismatch
def phase_mismatch(result: dict, ctx: Context) -> None:
    import torch
    from transformers import GenerationConfig
    from trl import GRPOTrainer

    from trl_rollout_corr.rollout.capture import capture_sampling_logprobs
    from trl_rollout_corr.testing.toy_task import reverse_prompts

    lengths = ctx.sizes["mismatch_lengths"]
    batch, longest = ctx.sizes["mismatch_batch"], max(lengths)
    model, tok = ctx.model, ctx.tokenizer
    enc = tok(reverse_prompts(batch, n_digits=6, seed=7), return_tensors="pt", padding=True).to(ctx.device)
    prompt_len = enc["input_ids"].shape[1]
    # exactly `longest` new tokens: no EOS (not min_new_tokens, whose processor renormalizes pi_rollout without EOS),
    # plain sampling at temperature 1 over the full vocabulary
    gen_config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=longest,
                                  eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model.eval()
    eos, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    ctx.sync()
    began = time.perf_counter()
    try:
        with torch.no_grad(), capture_sampling_logprobs(model) as captured:
            sequences = model.generate(**enc, generation_config=gen_config)  # (B, P+T)
    finally:
        model.generation_config.eos_token_id = eos
    ctx.sync()
    generate_s = time.perf_counter() - began
    rollout = captured["logprobs"].float()  # (B, T)
    if sequences.shape[1] - prompt_len != longest:
        raise RuntimeError(f"generate returned {sequences.shape[1] - prompt_len} new tokens, not {longest}")
    # the trainer's forward: TRL's own (fused LM head, under the trainer's autocast), as both trainers run it
    from trl_rollout_corr import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

    trainer = RolloutCorrGRPOTrainer(model=model, reward_funcs=length_reward,
                                     args=RolloutCorrGRPOConfig(**ctx.common_args(longest, NUM_GENERATIONS, 1),
                                                                rollout_correction_preset="decoupled_token_is"),
                                     train_dataset=ctx.dataset(16), processing_class=tok)
    attention_mask = torch.cat([enc["attention_mask"], torch.ones_like(sequences[:, prompt_len:])], dim=1)  # (B, P+T)
    ctx.sync()
    began = time.perf_counter()
    with torch.no_grad():
        train, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, sequences, attention_mask, longest, batch_size=NUM_GENERATIONS)  # (B, T)
    ctx.sync()
    forward_s = time.perf_counter() - began
    ctx.release(trainer)
    model.train()
    log_ratio = train.float() - rollout  # (B, T) log pi_train - log pi_rollout
    finite = torch.isfinite(log_ratio)  # (B, T)
    result.update(sequences=batch, prompt_tokens=prompt_len, generated_tokens=longest, generate_s=generate_s,
                  ms_per_decoding_step=generate_s / longest * 1e3, trainer_forward_s=forward_s,
                  finite_fraction=float(finite.float().mean()),
                  mean_rollout_logprob=float(rollout[finite].mean()), by_length={})
    if not bool(finite.all()):
        raise RuntimeError(f"non-finite log ratios: {int((~finite).sum())} of {finite.numel()}")
    for length in lengths:
        r = log_ratio[:, :length].double()  # (B, t)
        k1 = float((-r).mean())  # KL(pi_rollout || pi_train), samples from pi_rollout
        k3 = float((r.exp() - 1 - r).mean())
        result["by_length"][str(length)] = {
            "tokens": r.numel(), "k1": k1, "k3": k3, "max_abs_log_ratio": float(r.abs().max()),
            "mean_abs_log_ratio": float(r.abs().mean()), "t_times_k1": length * k1, "t_times_k3": length * k3,
            "exact_fraction": float((r == 0).double().mean())}


# ---------------------------------------------------------------------------------------------- 6. the probe
def phase_preflight(result: dict, ctx: Context) -> None:
    """``trl-rollout-corr probe``'s work (trl_rollout_corr/cli/probe.py) on this model: one generation batch of
    ``preflight_batch`` x ``preflight_length`` tokens with top-p 0.95, generated and scored as training would; its
    cost and what it reports."""
    from trl_rollout_corr import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer
    from trl_rollout_corr.cli.probe import probe

    length, batch = ctx.sizes["preflight_length"], ctx.sizes["preflight_batch"]
    args = RolloutCorrGRPOConfig(**ctx.common_args(length, batch, 1), top_p=0.95)
    trainer = RolloutCorrGRPOTrainer(model=ctx.model, reward_funcs=length_reward, args=args,
                                     train_dataset=ctx.dataset(), processing_class=ctx.tokenizer)
    eos, ctx.model.generation_config.eos_token_id = ctx.model.generation_config.eos_token_id, None
    try:
        ctx.sync()
        report = probe(trainer, 1, ("trl_default", "trl_token_truncate", "decoupled_token_is", "icepop"))
        ctx.sync()
    finally:
        ctx.model.generation_config.eos_token_id = eos
        ctx.release(trainer)
    tokens, seqs = report["tokens"], report["sequences"]
    result.update(sequences=batch, completion_tokens=length, seconds=report["seconds"], tokens=tokens["count"],
                  k1=tokens["k1"], k3=tokens["k3"], max_abs_log_rho=tokens["max_abs_log_rho"],
                  t_kl_mean=seqs["t_kl_mean"], seq_ess=seqs["seq_ess"],
                  kept_mass_mean=report.get("truncation", {}).get("kept_mass_mean"),
                  k3_before_renormalization=report.get("truncation", {}).get("before_renormalization", {}).get("k3"),
                  methods={name: {k: m.get(k) for k in ("rollout_is_eff_sample_size", "weight_zero_fraction",
                                                         "rollout_is_ratio_fraction_high")}
                           for name, m in report["methods"].items()})


# ---------------------------------------------------------------------------------------------- 6. presets
def phase_presets(result: dict, ctx: Context, report: Report) -> None:
    from trl_rollout_corr import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer
    from trl_rollout_corr.config.correction import RolloutCorrectionConfig

    length, batch, steps = ctx.sizes["preset_length"], ctx.sizes["preset_batch"], ctx.sizes["preset_steps"]
    runs = {name: (name, {}) for name in RolloutCorrectionConfig.preset_names()}
    runs.update(TRUNCATED_RUNS)
    result.update(sequences=batch, completion_tokens=length, steps=steps, runs={}, planned=list(runs))
    for name, (preset, extra) in runs.items():
        row = result["runs"][name] = {"preset": preset, **extra}
        if report.over_budget():
            row["status"] = "skipped (budget)"
            continue
        began = time.perf_counter()
        try:
            args = RolloutCorrGRPOConfig(**{**ctx.common_args(length, batch, steps), **extra},
                                         rollout_correction_preset=preset)
            trainer = RolloutCorrGRPOTrainer(model=ctx.model, reward_funcs=length_reward, args=args,
                                             train_dataset=ctx.dataset(), processing_class=ctx.tokenizer)
            run = _timed_train(ctx, trainer)
            losses, values, bad = _finite_logs(run["logs"])
            kept = [e["rollout_corr/kept_mass_mean"] for e in run["logs"] if "rollout_corr/kept_mass_mean" in e]
            row.update(status="ok", steps=run["steps"], losses=losses, rollout_corr_values=values, nonfinite=bad,
                       finite=not bad and losses == run["steps"] and values > 0,
                       our_syncs_per_step=run["our_syncs_per_step"], all_syncs_per_step=run["all_syncs_per_step"],
                       our_sync_sites=run["our_sync_sites"], peak_gib=run["peak"] / 2**30,
                       loss=[e["loss"] for e in run["logs"] if "loss" in e],
                       kl=[e.get("rollout_corr/kl") for e in run["logs"] if "loss" in e],
                       truncation_probe=bool(kept), kept_mass_mean=kept,
                       extra_forward=trainer.correction_plan.at_generation)
            if extra and not kept:
                row.update(status="error", error="truncated sampling but no rollout_corr/kept_mass_mean logged")
            elif not row["finite"]:
                row["status"] = "error"
            ctx.release(trainer)
            trainer = None
        except Exception:  # noqa: BLE001 (one preset's failure leaves the others)
            row.update(status="error", error=traceback.format_exc())
            print(f"[gpu_check] preset {name}: ERROR\n{row['error']}", flush=True)
            vars(ctx.model).pop("forward", None)
            vars(ctx.model).pop("generate", None)
            ctx.cleanup()
        row["seconds"] = time.perf_counter() - began
        print(f"[gpu_check] preset {name}: {row['status']} in {row['seconds']:.1f} s, loss {row.get('loss')}, "
              f"our syncs/step {_num(row.get('our_syncs_per_step'))}", flush=True)
        report.write()
    failed = [n for n, r in result["runs"].items() if r.get("status") == "error"]
    if failed:
        raise RuntimeError(f"presets failed: {', '.join(failed)} (details under result.runs)")


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--toy", action="store_true", help="toy size on CPU (the suite's run)")
    parser.add_argument("--budget_s", type=float, default=300.0,
                        help="skip the remaining phases (and presets) once this many seconds have passed")
    parser.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES)
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    opts = parse_args(argv)
    began = time.time()
    import torch  # after the environment variables above

    if opts.toy:
        torch.set_num_threads(1)  # tiny matrices: a second thread only spins (and crawls on a shared machine)
    meta = {"mode": "toy" if opts.toy else "gpu", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "argv": sys.argv if argv is None else argv, "budget_s": opts.budget_s,
            "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() and not opts.toy else "cpu",
            "sizes": SIZES["toy" if opts.toy else "gpu"]}
    report = Report(opts.out, opts.budget_s, meta)
    report.write()
    ctx = Context(opts)
    phases = {"env": phase_env, "model": phase_model, "probe_cost": phase_probe_cost, "step_time": phase_step_time,
              "mismatch": phase_mismatch, "preflight": phase_preflight,
              "presets": lambda result, c: phase_presets(result, c, report)}
    for name in PHASES:
        if name not in opts.phases:
            continue
        if name != "env" and name != "model" and ctx.model is None:
            report.data["phases"][name] = {"status": "skipped", "reason": "no model (the model phase failed)"}
            report.write()
            continue
        report.run(name, phases[name], ctx)
    report.data["meta"]["wall_s"] = time.time() - began
    report.write()
    statuses = {n: p["status"] for n, p in report.data["phases"].items()}
    print(f"[gpu_check] done in {time.time() - began:.1f} s: {statuses}; {os.path.join(opts.out, 'gpu_check.json')}",
          flush=True)
    return report.data


if __name__ == "__main__":
    main()
