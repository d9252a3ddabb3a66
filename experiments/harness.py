"""The run harness of the toy task's GRPO runs and the earlier CPU demo's worker (:func:`run_worker`, which
``experiments/mismatch_bench.py``, ``experiments/async_staleness.py`` and the monitor's tests train with); the
experiments that train their own (``experiments/async_staleness.py``, ``experiments/monitor_scenarios.py``) share the
rest: one warmed-up policy, one held-out prompt set, one recorder of the policy's own held-out reward and of the
logged rows, and the GRPO settings every one of these runs uses.

A variant is judged by the **policy's own** mean reward on :data:`HELD_OUT_N` fixed held-out prompts (temperature 1,
:func:`held_out_reward`), not by the training reward, which measures the sampler.
Moved out of the package (``trl_rollout_corr/testing/harness.py``, ``trl_rollout_corr/demo/run.py``) by issue 53: only
the experiments and the tests use it.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import tempfile
import time

from transformers import TrainerCallback

from trl_rollout_corr.core.metric_names import metric
from trl_rollout_corr.testing.toy_task import (VOCAB, build_model, build_tokenizer, reverse_prompts, reverse_reward,
                                              supervised_warmup)

HIDDEN_SIZE, NUM_LAYERS = 64, 2  # the toy policy: a Qwen2-style model, hidden 64, 2 layers
N_DIGITS = 6  # "reverse 6 digits"
WARMUP_STEPS = 90  # supervised steps before GRPO, so that GRPO starts from a non-trivial policy
HELD_OUT_N, HELD_OUT_SEED = 256, 10_000 + 7  # fixed across seeds and variants
TAIL = 0.8  # the score: the mean of the evaluations at step >= TAIL * steps (the last 20% of the run)

# the GRPO settings of every toy-task run: 8 prompts x 8 completions per step, completions of at most 9 tokens,
# constant lr 3e-4, T=1, CPU and float32, no checkpoint, no report
TOY_GRPO_ARGS = dict(
    per_device_train_batch_size=64, num_generations=8, max_completion_length=9, learning_rate=3e-4,
    lr_scheduler_type="constant", adam_beta2=0.99, max_grad_norm=1.0, temperature=1.0, save_strategy="no",
    report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False, disable_tqdm=True,
)


def held_out_reward(model, tokenizer, prompts: list[str], seed: int = 1234, max_new_tokens: int = 9) -> float:
    """The policy's own mean reward on held-out prompts: sampled at temperature 1, no truncation, with a fixed seed.

    Judges a variant by the model being trained, not by its sampler. The caller's RNG state and train/eval mode
    are restored, so evaluating does not perturb the run.
    """
    import statistics

    import torch

    rng = torch.get_rng_state()
    torch.manual_seed(seed)
    was_training = model.training
    model.eval()
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        seqs = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              max_new_tokens=max_new_tokens, pad_token_id=0, eos_token_id=1)  # (N, P+S)
    texts = tokenizer.batch_decode(seqs[:, enc["input_ids"].shape[1]:], skip_special_tokens=False)
    model.train(was_training)
    torch.set_rng_state(rng)
    return statistics.fmean(reverse_reward(prompts, texts))


CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # a user turn renders as the plain prompt


def build_chat_tokenizer():
    """``toy_task.build_tokenizer`` with a chat template that renders ``[{"role": "user", "content": p}]`` as ``p`` (the
    same token ids as the plain prompt) and TRL's Qwen3 response template, as TRL's asynchronous trainer needs."""
    from trl.chat_template_utils import qwen3_template

    tok = build_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.response_template = qwen3_template
    return tok


def _text(x) -> str:
    return x[-1]["content"] if isinstance(x, list) else x


def reverse_chat_reward(prompts, completions, completion_ids=None, **_) -> list[float]:
    """``reverse_reward`` on conversational prompts (TRL's asynchronous trainer); the completion read from its
    token ids (TRL's response parser, made for chat models, would leave the prompt in a plain completion's text)."""
    texts = ([" ".join(VOCAB[i] for i in ids) for ids in completion_ids] if completion_ids is not None
             else [_text(c) or "" for c in completions])
    return reverse_reward([_text(p) for p in prompts], texts)


def held_out_prompts() -> list[str]:
    """The :data:`HELD_OUT_N` held-out prompts (seed :data:`HELD_OUT_SEED`), the same for every seed and variant."""
    return reverse_prompts(HELD_OUT_N, N_DIGITS, seed=HELD_OUT_SEED)


def warmed_up_policy(seed: int, num_heads: int = 4, chat: bool = False):
    """The toy task's tokenizer (with a chat template if ``chat``: TRL's asynchronous trainer) and its policy, built
    with ``seed`` and warmed up with :data:`WARMUP_STEPS` supervised steps.

    vLLM's CPU attention needs a head size of at least 32: ``num_heads=2`` (2 heads of 32) for a run that samples with
    vLLM, 4 heads of 16 otherwise."""
    tokenizer = build_chat_tokenizer() if chat else build_tokenizer()
    model = build_model(hidden_size=HIDDEN_SIZE, num_layers=NUM_LAYERS, seed=seed, num_heads=num_heads)
    supervised_warmup(model, tokenizer, steps=WARMUP_STEPS, seed=seed)
    return tokenizer, model


class HeldOutRewardRecorder(TrainerCallback):
    """A run's record: the policy's own held-out reward every ``eval_every`` optimizer steps and every logged
    training row.

    Built before the trainer, it evaluates the model as given (step 0); then, at each step that ``eval_every``
    divides, the trainer's model. ``curve`` is ``[(step, reward), ...]``; ``logs`` holds each row the trainer logs
    with a ``loss`` (its numeric values, booleans left out, and ``step``: the global step).

    ``evaluator``: a model of the policy's architecture that generates in its place (its weights loaded from the
    policy before each evaluation): the asynchronous trainer's policy is not one ``generate`` can run. The
    evaluation restores the RNG state and the train/eval mode
    (:func:`held_out_reward`), so recording does not perturb the run.
    """

    def __init__(self, model, tokenizer, eval_every: int, prompts: list[str] | None = None, evaluator=None):
        self.tokenizer, self.eval_every, self.evaluator = tokenizer, eval_every, evaluator
        self.prompts = held_out_prompts() if prompts is None else prompts
        self.curve: list[tuple[int, float]] = [(0, self.policy_reward(model))]
        self.logs: list[dict] = []

    def policy_reward(self, model) -> float:
        """The mean reward of ``model``'s own samples on the held-out prompts."""
        if self.evaluator is not None:
            self.evaluator.load_state_dict(model.state_dict())
            model = self.evaluator
        return held_out_reward(model, self.tokenizer, self.prompts)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.eval_every == 0:
            self.curve.append((state.global_step, self.policy_reward(model)))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            row = {k: v for k, v in logs.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            row["step"] = state.global_step
            self.logs.append(row)

    def tail_reward(self, steps: int) -> float:
        """The run's score: the mean held-out reward of the evaluations at step >= :data:`TAIL` x ``steps``."""
        return statistics.fmean(r for s, r in self.curve if s >= TAIL * steps)

    def log_mean(self, key: str, default=None):
        """The mean of ``key`` over the logged rows that have it (``default`` when none has)."""
        values = [row[key] for row in self.logs if key in row]
        return statistics.fmean(values) if values else default


VARIANTS = {
    # name: (preset, uses the stale sampler): run_worker's variants
    "on_policy": ("disabled", False),
    "stale_uncorrected": ("disabled", True),
    "trl_default": ("trl_default", True),  # TRL 1.16's own default correction (sequence-masked IS, C=3)
    "decoupled_token_is": ("decoupled_token_is", True),
    "ppo_is_bypass": ("ppo_is_bypass", True),
    "pg_is": ("pg_is", True),
}



METRICS = (metric("kl"), metric("k3_kl"), metric("chi2_token"), metric("rejected_token_fraction"))


def run_worker(variant: str, seed: int, steps: int, lag: int, engine: str, eval_every: int, out: str,
               preset: str | None = None, stale: bool | None = None, config_overrides: dict | None = None) -> None:
    """Train one variant with one seed and write its curves and mean diagnostics to ``out`` (JSON).

    ``variant`` names a row of :data:`VARIANTS`; ``preset`` / ``stale`` replace its preset and whether it samples from
    the mismatched engine, and ``config_overrides`` adds ``RolloutCorrGRPOConfig`` fields (the mismatch benchmark's
    methods and scenarios, ``experiments/mismatch_bench.py``)."""
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from datasets import Dataset
    from transformers.utils import logging as hf_logging

    from trl_rollout_corr.grpo.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer
    from trl_rollout_corr.monitor import RolloutCorrectionMonitor
    from trl_rollout_corr.rollout.emulated import EmulatedRolloutEngine
    from trl_rollout_corr.testing.toy_task import reverse_reward

    hf_logging.set_verbosity_error()
    logging.getLogger("trl_rollout_corr.monitor").setLevel(logging.ERROR)  # alerts go to the table, not stderr
    t0 = time.time()
    default_preset, default_stale = VARIANTS.get(variant, (None, True))
    preset = default_preset if preset is None else preset
    stale = default_stale if stale is None else stale
    # vLLM's CPU attention needs head size >= 32: 2 heads of 32 instead of 4 of 16 for the real engine
    tok, model = warmed_up_policy(seed, num_heads=2 if engine == "vllm" else 4)
    recorder = HeldOutRewardRecorder(model, tok, eval_every)  # the held-out reward at step 0, then every eval_every
    with tempfile.TemporaryDirectory() as out_dir:
        vllm_kwargs = {}
        if engine == "vllm":  # the real engine: loads the warmed-up checkpoint, synced every `lag` steps when stale
            model.save_pretrained(out_dir)
            tok.save_pretrained(out_dir)
            model.name_or_path = model.config.name_or_path = out_dir  # TRL starts vLLM from model.name_or_path
            vllm_kwargs = dict(use_vllm=True, vllm_mode="colocate", vllm_dtype="float32",
                               vllm_gpu_memory_utilization=0.02, vllm_sync_interval=lag if stale else 1)
        args = RolloutCorrGRPOConfig(
            output_dir=out_dir, rollout_correction_preset=preset, max_steps=steps, loss_type="dapo", beta=0.0,
            logging_steps=10, seed=seed, dataloader_num_workers=0,
            **{**TOY_GRPO_ARGS, **vllm_kwargs, **(config_overrides or {})},
        )
        sampler = EmulatedRolloutEngine(engine, lag=lag) if stale and engine != "vllm" else None
        # warn-only monitor (no stop); the engine's lag is known here: `lag` for a stale engine (emulated, or vLLM
        # synced every `lag` steps), else synchronous
        monitor = RolloutCorrectionMonitor(rollout_lag=lag if stale and engine in ("stale", "vllm") else 0,
                                           write_csv=False, write_plot=False)
        trainer = RolloutCorrGRPOTrainer(
            model=model, reward_funcs=reverse_reward, args=args, processing_class=tok,
            train_dataset=Dataset.from_dict({"prompt": reverse_prompts(steps * 8 + 64, 6, seed=seed)}),
            callbacks=[recorder, monitor], rollout_sampler=sampler)
        trainer.train()
    logs = recorder.logs
    result = {
        "variant": variant, "seed": seed, "curve": recorder.curve, "eval_reward": recorder.tail_reward(steps),
        "seconds": time.time() - t0,
        "metrics": {k: recorder.log_mean(k, 0.0) for k in METRICS},
        "kl_curve": [(log["step"], log.get(metric("kl"), 0.0)) for log in logs],
        "alerts": [(a["step"], a["alert"]) for a in monitor.alerts],
        "logs": logs,  # every logged row (the monitor's replay input)
    }
    with open(out, "w") as f:
        json.dump(result, f)
