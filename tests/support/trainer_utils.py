"""Build a real RolloutCorrGRPOTrainer on a tiny local model (no download)."""

from __future__ import annotations

from trl_rollout_corr import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer  # first: its CPU-torch guard
from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from trl_rollout_corr.testing.toy_task import build_model, build_tokenizer, reverse_prompts, reverse_reward

_MODEL_CACHE: dict = {}


def tiny_model_dir(tmp_path_factory_dir) -> str:
    """A saved tiny model + tokenizer (a path is needed when beta > 0: TRL reloads the reference model)."""
    key = str(tmp_path_factory_dir)
    if key not in _MODEL_CACHE:
        model, tok = build_model(hidden_size=32), build_tokenizer()
        model.save_pretrained(key)
        tok.save_pretrained(key)
        _MODEL_CACHE[key] = key
    return _MODEL_CACHE[key]


class LogCollector(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def make_trainer(output_dir, model=None, preset=None, max_steps=2, callbacks=(), rollout_sampler=None, **overrides):
    kwargs = dict(
        output_dir=str(output_dir), per_device_train_batch_size=8, gradient_accumulation_steps=1, num_generations=4,
        max_completion_length=8, max_steps=max_steps, learning_rate=1e-3, logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False, seed=0,
        rollout_correction_preset=preset, temperature=1.0, dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    args = RolloutCorrGRPOConfig(**kwargs)
    dataset = Dataset.from_dict({"prompt": reverse_prompts(64, n_digits=4)})
    tok = build_tokenizer()
    if model is None:
        model = build_model(hidden_size=32)
    collector = LogCollector()
    trainer = RolloutCorrGRPOTrainer(model=model, reward_funcs=reverse_reward, args=args, train_dataset=dataset,
                                     processing_class=tok, callbacks=[collector, *callbacks],
                                     rollout_sampler=rollout_sampler)
    return trainer, collector


def count_policy_forwards(model):
    """Count the real log-prob forwards of ``model`` (a forward pre-hook on the calls TRL's
    ``_get_per_token_logps_and_entropies`` makes, not generate's decoding steps), by grad mode."""
    import torch

    counts = {"grad": 0, "no_grad": 0}

    def hook(module, args, kwargs):
        if kwargs.get("fused_lm_head"):
            counts["grad" if torch.is_grad_enabled() else "no_grad"] += 1

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return counts


def spy_batches(trainer):
    """The generation batches ``trainer`` scores from now on (what ``_generate_and_score_completions`` returns)."""
    batches = []
    original = trainer._generate_and_score_completions

    def spy(inputs):
        out = original(inputs)
        batches.append(out)
        return out

    trainer._generate_and_score_completions = spy
    return batches


def run_demo_worker(*args, **kwargs):
    """The demo's worker in this process (it is written for a process of its own: put back the logger level,
    transformers' verbosity and torch's thread count it sets)."""
    import logging

    import torch
    from transformers.utils import logging as hf_logging

    from experiments.harness import run_worker

    monitor_logger = logging.getLogger("trl_rollout_corr.monitor")
    saved = monitor_logger.level, hf_logging.get_verbosity(), torch.get_num_threads()
    try:
        return run_worker(*args, **kwargs)
    finally:
        monitor_logger.setLevel(saved[0])
        hf_logging.set_verbosity(saved[1])
        torch.set_num_threads(saved[2])
