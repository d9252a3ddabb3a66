"""Deterministic stand-ins for the rollout worker and weight transfer of TRL's AsyncGRPOTrainer (TRL's own injection
points), and a tiny model: the async trainer's loss path trained and checked without a server.

Samples come from a fixed queue: prompt + completion token ids, pi_rollout = the initial policy's log-probs plus
fixed noise (a mismatched sampler), an advantage per sample, a policy version per sample.
"""

from __future__ import annotations

import os
import queue

import numpy as np
import torch

VOCAB = 64


class StubRolloutWorker:
    """TRL's RolloutWorkerProtocol over a pre-filled queue."""

    def __init__(self, samples: list) -> None:
        self.rollout_buffer = queue.Queue()
        for sample in samples:
            self.rollout_buffer.put(sample)
        self.metrics_queue = queue.Queue()
        self.versions: list[int] = []

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def update_model_version(self, model_version: int) -> None:
        self.versions.append(model_version)

    def check_health(self, stale_after_s: float) -> None:
        raise RuntimeError("the stub queue ran dry: the test asked for more steps than it has samples")


class StubWeightTransfer:
    def __init__(self) -> None:
        self.syncs = 0

    def init_weight_transfer(self) -> None:
        pass

    def pause(self) -> None:
        pass

    def send_weights(self, iterator) -> None:
        for _ in iterator:
            pass
        self.syncs += 1

    def resume(self) -> None:
        pass

    def destroy(self) -> None:
        pass


def build_model_dir(path: str, seed: int = 0) -> str:
    """A tiny Qwen2 (vocab 64) and a word-level tokenizer, saved under ``path``."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    os.makedirs(path, exist_ok=True)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                  pad_token="t0", eos_token="t1")
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=False, pad_token_id=0, eos_token_id=1)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@torch.no_grad()
def policy_logprobs(model_dir: str, input_ids: list[int]) -> np.ndarray:
    """log pi(x_t | x_<t) of the saved (initial) model, float32, position 0 = 0."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    x = torch.tensor([input_ids])
    logps = model(input_ids=x).logits[0, :-1].float().log_softmax(-1).gather(-1, x[0, 1:, None])[:, 0]
    return np.concatenate([[0.0], logps.numpy()]).astype(np.float32)


def make_samples(model_dir: str, n_groups: int, group_size: int = 4, version: int | list[int] = 1,
                 noise: float = 0.3, seed: int = 0, prompt_len: int = 3, max_completion: int = 6,
                 nan_sample: int | None = None) -> list:
    """Fixed samples: pi_rollout = initial policy + N(0, noise) per token; group-normalized random advantages."""
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    rng = np.random.default_rng(seed)
    versions = version if isinstance(version, list) else [version] * (n_groups * group_size)
    samples = []
    for g in range(n_groups):
        prompt = rng.integers(2, VOCAB, prompt_len).tolist()
        rewards = rng.normal(size=group_size)
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
        for j in range(group_size):
            completion = rng.integers(2, VOCAB, int(rng.integers(2, max_completion + 1))).tolist()
            ids = prompt + completion
            logps = policy_logprobs(model_dir, ids)
            mask = np.array([0] * prompt_len + [1] * len(completion), dtype=np.int64)
            old = np.where(mask == 1, logps + rng.normal(scale=noise, size=len(ids)), 0.0).astype(np.float32)
            index = len(samples)
            if nan_sample is not None and index == nan_sample:
                old[-1] = np.nan
            samples.append(RolloutSample(prompt=[], completion=[], input_ids=np.array(ids), completion_mask=mask,
                                         old_log_probs=old, advantage=float(adv[j]), model_version=versions[index],
                                         group_id=g, metrics={"reward": float(rewards[j])}))
    return samples


def async_args(output_dir: str, **overrides):
    from trl_rollout_corr import RolloutCorrAsyncGRPOConfig

    kwargs = dict(output_dir=output_dir, dtype="float32", bf16=False, use_cpu=True, per_device_train_batch_size=4,
                  gradient_accumulation_steps=1, learning_rate=1e-2, report_to=[], save_strategy="no",
                  max_steps=3, num_generations=4, max_completion_length=8, logging_steps=1, max_staleness=4,
                  token_budget=-1, gradient_checkpointing=False, disable_tqdm=True, seed=0,
                  vllm_server_base_url="http://127.0.0.1:9")  # never contacted: stubs
    kwargs.update(overrides)
    return RolloutCorrAsyncGRPOConfig(**kwargs)


def build_trainer(model_dir: str, samples: list, output_dir: str, **overrides):
    from datasets import Dataset
    from transformers import AutoTokenizer

    from trl_rollout_corr import RolloutCorrAsyncGRPOTrainer

    args = async_args(output_dir, **overrides)
    worker = StubRolloutWorker(samples)
    trainer = RolloutCorrAsyncGRPOTrainer(
        model=model_dir, reward_funcs=[], args=args, train_dataset=Dataset.from_dict({"prompt": ["x"] * 8}),
        processing_class=AutoTokenizer.from_pretrained(model_dir), rollout_worker=worker,
        weight_transfer=StubWeightTransfer())
    return trainer, worker
