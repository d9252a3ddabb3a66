"""RolloutCorrAsyncGRPOTrainer: rollout correction in TRL's asynchronous GRPO trainer.

TRL 1.16's ``AsyncGRPOTrainer`` generates continuously against a vLLM server while it trains; each sample carries the
server's sampling log-probs (pi_rollout) and the policy version that produced it, and TRL's loss is PPO-clip with
pi_old := pi_rollout (bypass by construction), with no importance weighting, rejection or diagnostics. This trainer:

1. carries every sample's policy version to the loss (:mod:`trl_rollout_corr.trl_hooks.async_grpo_data`);
   lag = trainer's version - sample's version;
2. in ``compute_loss``, runs the policy forward as TRL does (its row cut out of the padded batch by the sizes the
   collator read on the CPU: no host sync), maps TRL's flat loss terms to (B, T) rows (one per sample,
   :mod:`trl_rollout_corr.core.flat`), computes the correction with
   :func:`~trl_rollout_corr.core.compute_rollout_correction_stats`
   and runs TRL's own ``compute_loss`` on a corrected copy of the micro-batch (answering its forward with the one
   already run):

   * bypass PPO (``ppo_is_bypass``, ...): pi_old := pi_rollout (TRL's anchor); IS / RS / veto on
     rho = pi_theta / pi_rollout; IS weights feed the metrics (the PPO ratio already is pi_theta / pi_rollout);
   * bypass policy gradient: loss -w A log pi_theta, w = min(rho, C) (TRL's anchor := pi_theta detached: ratio 1);
   * decoupled: pi_prox = the policy before this optimizer step = pi_theta detached (each sample is trained on once,
     and the parameters do not move between the micro-batches of a step), PPO on pi_theta / pi_prox (ratio 1), IS
     weight w = min(pi_prox / pi_rollout, C) on the advantage, RS and veto on the same ratio (AReaL's decoupled
     objective);
   * a rejected term keeps its place with advantage 0 (no gradient) and leaves the token count the loss divides by
     (the kept tokens of the micro-batch, all processes: as the synchronous trainer's ``dapo``);
3. logs ``rollout_corr/*`` (reduced across processes once per logging step), also per lag (``rollout_corr/lag_<k>/*``).

On a machine without CUDA it installs TRL's CPU support (:func:`.install_cpu_support`) and, unless a
``weight_transfer`` is given, syncs weights into the server with :class:`.CPUFileWeightTransfer` (TRL's default is
NCCL). On a GPU: TRL's NCCL transfer, to ``trl-rollout-corr vllm-serve-async`` (its requests carry the server's
control token, :func:`.server_probe.send_token_from_trl_client`) or ``vllm serve`` as TRL documents it, and TRL's
packed attention, which needs the ``kernels`` package (a clear error at construction without it). Either way the
server must return processed log-probs (``--logprobs-mode processed_logprobs``; checked in ``/server_info``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from trl.experimental.async_grpo import AsyncGRPOTrainer

from ..core import compute_rollout_correction_stats
from ..core.flat import padded_layout, per_row, to_rows, to_terms
from ..core.lag import lag_stats
from ..core.metric_names import metric
from ..core.pipeline import finite_rows_mask
from ..core.stats import STAT_DTYPE, RolloutStats, process_all_reduce
from ..training.correction_trainer import CorrectionTrainerMixin, micro_batch_counts, require_correction_config
from ..core.losses import loss_patch, mode_correction
from ..trl_hooks import async_grpo as trl_async
from ..trl_hooks.async_grpo_data import ADDED_KEYS, carrying_sample_versions
from .config import RolloutCorrAsyncGRPOConfig
from .server_probe import ServerProbe, check_server_info, send_token_from_trl_client

logger = logging.getLogger(__name__)

__all__ = ["RolloutCorrAsyncGRPOConfig", "RolloutCorrAsyncGRPOTrainer"]


def served_model_ids(body: Any) -> list[str] | None:
    """The model ids in a vLLM server's ``/v1/models`` answer (``{"data": [{"id": ...}, ...]}``).

    Args:
        body: the decoded JSON answer.

    Returns:
        The ids, or ``None`` for an answer of any other shape.
    """
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
        return None
    return [m["id"] for m in data]


class RolloutCorrAsyncGRPOTrainer(CorrectionTrainerMixin, AsyncGRPOTrainer):
    """``AsyncGRPOTrainer`` with rollout correction (see the module docstring).

    Its loss is TRL's PPO-clip on TRL's flat terms, patched per term by the synchronous trainer's
    :func:`~trl_rollout_corr.core.losses.loss_patch` (A' = A * w * z, the anchor of TRL's ratio by
    :func:`~trl_rollout_corr.core.losses.loss_anchor`), with A' = 0 on rejected terms and the kept terms as TRL's
    token count.

    Args:
        model: the model id or path (TRL's asynchronous trainer loads it; the vLLM server serves the same string).
        reward_funcs: TRL's reward functions.
        args: a :class:`RolloutCorrAsyncGRPOConfig`; None: the default config named after the model.
        *rest: TRL's further positional arguments.
        weight_transfer: TRL's weight transfer; None: TRL's (NCCL) with CUDA, the file transfer on a CPU.
        **kwargs: TRL's keyword arguments (``rollout_worker``: TRL's injection point; no server is probed then).

    Raises:
        TypeError: ``args`` is not a :class:`RolloutCorrAsyncGRPOConfig`.
        ValueError: an invalid correction field, or a server serving another model, naming the fix.
        RuntimeError: on a CPU without a ``weight_transfer``, no server answers at ``vllm_server_base_url``.
    """

    _RC_ALL_REJECTED_REMEDY = ("Loosen rollout_rs_threshold / rollout_token_veto_threshold, lower max_staleness or "
                               "check the server.")

    def __init__(self, model: str, reward_funcs: Any = None, args: RolloutCorrAsyncGRPOConfig | None = None,
                 *rest: Any, weight_transfer: Any = None, **kwargs: Any) -> None:
        if args is None:  # the default config, named as TRL names its own
            args = RolloutCorrAsyncGRPOConfig(f"{str(model).split('/')[-1]}-AsyncGRPO")
        require_correction_config(args, RolloutCorrAsyncGRPOConfig, "RolloutCorrAsyncGRPOTrainer")
        from ..runtime.versions import check_version
        from ..trl_hooks import async_grpo_cpu

        check_version("trl")
        trl_async.check_hooks(__class__, type(self))
        check_version("vllm")  # where it is installed: the trainer drives TRL's vLLM server either way
        on_cpu = async_grpo_cpu.install_cpu_support()  # no-op (False) with CUDA
        if not on_cpu:
            async_grpo_cpu.require_kernels()  # TRL's packed attention on a GPU: a clear error now, not at step 1
        self._rc_probe = None
        if weight_transfer is None and on_cpu and kwargs.get("rollout_worker") is None:
            weight_transfer = self._cpu_weight_transfer(args)
        self._rc_server_checked = True
        if kwargs.get("rollout_worker") is None:
            self._rc_probe = ServerProbe(args.vllm_server_base_url, args.server_unreachable_timeout_s)
            self._check_served_model(args, model)
            token = self._server_token(args)
            send_token_from_trl_client(args.vllm_server_base_url, token)  # TRL's client sends no header itself
            self._rc_server_checked = check_server_info(args.vllm_server_base_url, token)
        super().__init__(model, reward_funcs, args, *rest, weight_transfer=weight_transfer, **kwargs)
        self._rc_freeze()  # the correction this trainer checked: a change to args raises from now on
        self._rc_stats = RolloutStats()
        self._rc_policy_version = 0  # the trainer's policy version, on every rank (TRL keeps it on rank 0)
        self._rc_max_lag = self.args.max_staleness + 1  # dequeue staleness + the batch accelerate prefetches
        self._warn_truncated_sampler()
        if self.accelerator.is_main_process:
            cfg = self.rollout_correction
            logger.info("Rollout correction (async): %s mode, IS=%s, RS=%s, veto=%s, loss=%s",
                        "bypass" if cfg.bypass_mode else "decoupled", cfg.rollout_is, cfg.rollout_rs,
                        cfg.rollout_token_veto_threshold, "policy gradient" if cfg.use_policy_gradient else "PPO-clip")

    @staticmethod
    def _server_token(args: RolloutCorrAsyncGRPOConfig) -> str | None:
        """The control token of the server at ``args.vllm_server_base_url`` (None: none found)."""
        from urllib.parse import urlparse

        from ..vllm.security import find_token

        url = urlparse(args.vllm_server_base_url)
        return find_token(url.port, args.vllm_server_control_token_file, url.hostname)

    @staticmethod
    def _cpu_weight_transfer(args: RolloutCorrAsyncGRPOConfig):
        """CPUFileWeightTransfer to ``args.vllm_server_base_url``, with the server's control token; the server must
        answer now (a clear error otherwise, before any model is loaded)."""
        from urllib.parse import urlparse

        import requests

        from .transfer import CPUFileWeightTransfer

        url = args.vllm_server_base_url.rstrip("/")
        try:
            requests.get(f"{url}/health", timeout=10).raise_for_status()
        except requests.RequestException as error:
            raise RuntimeError(
                f"No vLLM server answers at {url} ({type(error).__name__}). Start it first, e.g. `trl-rollout-corr "
                f"vllm-serve-async MODEL --port {urlparse(url).port or 8000} --dtype float32`, and wait until it "
                "prints that it is ready.") from error
        token = RolloutCorrAsyncGRPOTrainer._server_token(args)
        return CPUFileWeightTransfer(url, token=token, sync_dir=args.vllm_weight_sync_dir,
                                     timeout=float(args.weight_sync_timeout))

    @staticmethod
    def _check_served_model(args: RolloutCorrAsyncGRPOConfig, model: Any) -> None:
        """TRL's rollout worker asks the server for the model by the string the trainer loads; a server serving it
        under another name answers 404 forever (the trainer would wait without end). Checked when the server answers."""
        import requests

        from ..vllm.security import TOKEN_HEADER

        if not isinstance(model, str):
            return
        url = args.vllm_server_base_url.rstrip("/")
        token = RolloutCorrAsyncGRPOTrainer._server_token(args)
        try:
            answer = requests.get(f"{url}/v1/models", timeout=10, headers={TOKEN_HEADER: token} if token else {})
            body = answer.json() if answer.status_code == 200 else None
        except (requests.RequestException, ValueError):  # not up yet (TRL waits for it), or an answer that is not JSON
            body = None
        served = served_model_ids(body)  # None where it is not a vLLM server: TRL's own errors apply
        if served is not None and model not in served:
            raise ValueError(f"The vLLM server at {url} serves {served}, but the trainer loads {model!r}: TRL's "
                             "rollout worker requests the model by that string and would get 404 on every request. "
                             f"Start the server with the same string (trl-rollout-corr vllm-serve-async {model} ...) "
                             "or pass the model path the server was started with.")

    def _warn_truncated_sampler(self) -> None:
        a = self.args
        if (a.top_k or 0) > 0 or (a.top_p or 1.0) < 1.0 or a.min_p or (a.repetition_penalty or 1.0) != 1.0:
            if self.accelerator.is_main_process:
                logger.warning(
                    "top_k=%s, top_p=%s, min_p=%s, repetition_penalty=%s: the server's log-probs are over the "
                    "truncated or penalized distribution, and TRL's fused head computes pi_theta over the full "
                    "vocabulary (at the temperature), so rho = pi_theta / pi_rollout is biased on every token. The "
                    "asynchronous trainer cannot renormalize pi_theta (its head returns the sampled tokens' log-probs "
                    "only): prefer top_k=0, top_p=1, min_p=None, repetition_penalty=1.", a.top_k, a.top_p, a.min_p,
                    a.repetition_penalty)

    # ------------------------------------------------------------------ 1. versions
    def get_train_dataloader(self):
        """TRL's dataloader, built while its dataset and collator carry every sample's policy version (its lag).

        Returns:
            TRL's train dataloader.
        """
        with carrying_sample_versions(self._rc_probe if self.accelerator.is_main_process else None):
            return super().get_train_dataloader()

    def _sync_weight(self) -> None:
        if not self._rc_server_checked and self.accelerator.is_main_process:  # the server was not up at construction
            self._rc_server_checked = check_server_info(self.args.vllm_server_base_url, self._server_token(self.args))
        trl_async.sync_weight(self, __class__)
        version = torch.tensor([self.model_version], dtype=torch.long, device=self.accelerator.device)
        if self.accelerator.num_processes > 1 and dist.is_initialized():
            dist.broadcast(version, src=0)
        self._rc_policy_version = int(version.item())

    # ------------------------------------------------------------------ 2. the corrected loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's own loss on the corrected micro-batch, orchestrated downward: the packed forward from ``trl_hooks``,
        the correction from ``core`` (:meth:`_correct_terms`), TRL's loss answered with that forward
        (``trl_hooks``' :class:`~trl_rollout_corr.trl_hooks.async_grpo.AnsweredForward`).

        Args:
            model: the policy.
            inputs: one packed micro-batch: TRL's keys (``advantages``, ``old_log_probs``, ``token_index`` (1, M_pad),
                ``global_n_tokens`` (1,), ...) plus this package's (``rc_sample_version``, ``rc_term_col``,
                ``rc_row_mask`` (1, B, T), ``rc_packed_sizes``).
            return_outputs, num_items_in_batch: TRL's.

        Returns:
            TRL's loss (a 0-dim tensor with grad).
        """
        trl_async.check_loss_inputs(inputs, added=ADDED_KEYS)
        outputs, forward_kwargs, forward_s = trl_async.packed_forward(model, inputs, self.aux_loss_enabled,
                                                                      self.accelerator.process_index)
        selected = inputs["token_index"] >= 0  # (1, M_pad)
        token_index = inputs["token_index"].clamp(min=0)  # (1, M_pad) padding reads position 0 (masked below)
        log_probs = outputs.log_probs.flatten()[token_index[0]].detach()  # (M_pad,) log pi_theta at the targets

        advantages, anchor, kept_total = self._correct_terms(inputs, selected[0], log_probs)
        patched = dict(inputs)
        patched["advantages"] = torch.where(selected, advantages, inputs["advantages"])  # (1, M_pad)
        patched["old_log_probs"] = torch.where(selected, anchor, inputs["old_log_probs"])  # (1, M_pad)
        n_tokens = inputs["global_n_tokens"]  # (1,) TRL's loss divisor, the kept count instead: a device tensor
        patched["global_n_tokens"] = torch.broadcast_to(kept_total.to(n_tokens.dtype), n_tokens.shape).clone()
        answered = trl_async.AnsweredForward(outputs, forward_kwargs)
        loss = super().compute_loss(answered, patched, return_outputs, num_items_in_batch)
        trl_async.add_forward_time(self, forward_s)  # TRL timed the answered call
        return loss

    def _correct_terms(self, inputs: dict, valid: torch.Tensor, log_probs: torch.Tensor):
        """The corrected advantage and PPO anchor of every loss term, and the global kept-token count.

        On the padded terms of this rank's row, with no host sync: valid (M_pad,) marks the real terms, laid out
        in (B, T) by the collator's ``rc_term_col`` / ``rc_row_mask`` (B and T are that tensor's shape).
        log_probs: (M_pad,) log pi_theta (detached). Returns (M_pad,), (M_pad,) (padding: any value) and the
        kept count over every rank, (1,) float32 on the device.
        """
        cfg = self.rollout_correction
        rollout = inputs["old_log_probs"][0].float()  # (M_pad,) log pi_rollout
        adv = inputs["advantages"][0].float()  # (M_pad,)
        versions = inputs["rc_sample_version"][0]  # (M_pad,)
        mask = inputs["rc_row_mask"][0]  # (B, T) the trained positions
        layout = padded_layout(inputs["segment_id"][0], inputs["rc_term_col"][0], valid, *mask.shape)
        train_rows = to_rows(log_probs.float(), layout, 0.0)  # (B, T) pi_theta = pi_prox (decoupled) or pi_theta
        rollout_rows = to_rows(rollout, layout, 0.0)  # (B, T)
        if self.args.require_rollout_logprobs:  # opt-in check: one host sync per micro-batch
            self._require_finite(rollout_rows, mask)
        adv_rows = to_rows(adv, layout, 0.0)  # (B, T) TRL's A: M2PO's trust region and grad_share_*
        result = compute_rollout_correction_stats(train_rows, rollout_rows, mask, cfg.params(),
                                                  reduce_fn=process_all_reduce, advantages=adv_rows)
        keep_rows = result.modified_response_mask.bool()  # (B, T)
        lag = self._rc_policy_version - per_row(versions, layout)  # (B,)
        valid_rows = finite_rows_mask(mask, train_rows, rollout_rows)  # (B, T) what the statistics average over
        stats = RolloutStats().update(result.stats).update(
            lag_stats(train_rows, rollout_rows, mask, valid_rows, keep_rows, lag, self._rc_max_lag, result.is_weights))
        keep = to_terms(keep_rows, layout) & valid  # (M_pad,)
        weights = None if result.is_weights is None else to_terms(result.is_weights, layout).float()  # (M_pad,)
        zero = None if result.advantage_mask is None else to_terms(result.advantage_mask, layout)  # (M_pad,) M2PO
        # the terms as one row, (1, M_pad): the shapes of TRL's own advantages and old_log_probs
        terms = [None if t is None else t.unsqueeze(0) for t in (keep, weights, zero, rollout, log_probs, adv)]
        keep1, weights1, zero1, rollout1, log_probs1, adv1 = terms
        # pi_rollout: TRL's ratio pi_theta / pi_rollout has the IS weight in it already; pi_old (= pi_prox, pi_theta
        # detached) or pi_theta: ratio 1, the gradient is -w A grad log pi_theta
        correction = mode_correction(cfg.loss_anchor, keep1, weights1, zero1, rollout_anchor=rollout1,
                                     old_anchor=log_probs1)
        patch = loss_patch(adv1, correction, log_probs1, keep1, sequence_level=False)  # the synchronous trainer's
        anchor = log_probs if patch.anchor is None else patch.anchor[0]  # (M_pad,) rejected: ratio 1 ...
        adv = torch.where(keep, patch.advantages[0], torch.zeros_like(adv))  # (M_pad,) ... and no gradient
        kept_total = process_all_reduce(keep.sum(dtype=torch.float32).reshape(1), "sum")  # (1,)
        once = float(self.accelerator.is_main_process)  # a micro-batch spans every process: count it once
        stats.update(micro_batch_counts(kept_total.to(STAT_DTYPE).reshape(()), once))
        self._rc_stats.update(stats)
        return adv.to(inputs["advantages"].dtype), anchor.to(inputs["old_log_probs"].dtype), kept_total

    @staticmethod
    def _require_finite(rollout_rows: torch.Tensor, mask: torch.Tensor) -> None:
        bad = (mask & ~torch.isfinite(rollout_rows)).any(1)  # (B,)
        if bool(bad.any()):
            rows = bad.nonzero().flatten().tolist()
            raise ValueError(f"Samples {rows} of this rank's micro-batch have non-finite rollout log-probs on trained "
                             "tokens (require_rollout_logprobs=True). Check the server's logprobs output, or set "
                             "require_rollout_logprobs=False to reject such samples and count them in "
                             f"{metric('invalid_logprob_fraction')}.")

    # ------------------------------------------------------------------ 3. logging
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's log, with the correction's metrics of the training steps since the last log added (a log while not
        training keeps them for the next one).

        Args:
            logs: the row TRL logs (updated in place).
            start_time: as TRL's.
        """
        if self.model.training and self._rc_stats.sums:  # a log while not training keeps them for the next one
            stats, self._rc_stats = self._rc_stats, RolloutStats()
            logs.update(self._rc_metrics(stats))
        super().log(logs, start_time)
