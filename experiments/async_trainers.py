"""TRL's asynchronous trainer itself, or this package's, against one running ``vllm-serve-async`` server on CPU: the
construction the asynchronous benchmarks (``async_mismatch.py``, ``async_staleness.py``) share."""

from __future__ import annotations

from typing import Any


def build_async_trainer(correction: dict | None, *, url: str, output_dir: str, config: dict[str, Any],
                        **trainer_kwargs):
    """TRL's ``AsyncGRPOTrainer`` itself when ``correction`` is None (TRL's code, unmodified: on a machine without
    CUDA, TRL's CPU support is installed and weights are synced with
    :class:`~trl_rollout_corr.async_grpo.CPUFileWeightTransfer` carrying the server's control token, which TRL's
    default NCCL transfer cannot do on CPU), else
    ``RolloutCorrAsyncGRPOTrainer`` with the correction fields ``correction`` (it chooses the same transfer itself).

    ``url``: the server (``http://host:port``); ``config``: the ``AsyncGRPOConfig`` fields both share;
    ``trainer_kwargs``: the trainer's other arguments (model, reward_funcs, processing_class, train_dataset, ...)."""
    if correction is None:
        from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

        from trl_rollout_corr.async_grpo import CPUFileWeightTransfer, install_cpu_support
        from trl_rollout_corr.vllm.security import find_token

        install_cpu_support()
        transfer = CPUFileWeightTransfer(url, find_token(int(url.rsplit(":", 1)[1])))
        return AsyncGRPOTrainer(args=AsyncGRPOConfig(output_dir=output_dir, **config), weight_transfer=transfer,
                                **trainer_kwargs)
    from trl_rollout_corr import RolloutCorrAsyncGRPOConfig, RolloutCorrAsyncGRPOTrainer

    args = RolloutCorrAsyncGRPOConfig(output_dir=output_dir, **correction, **config)
    return RolloutCorrAsyncGRPOTrainer(args=args, **trainer_kwargs)
