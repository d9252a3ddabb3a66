"""RolloutCorrAsyncGRPOTrainer's loss path, checked without a server: TRL's AsyncGRPOTrainer runs unchanged with its
own injection points (a fixed rollout queue, a weight transfer that only counts), so every number is reproducible.

The gradient of one optimizer step is compared with a float64 re-derivation from the formulas (plain forward of the
initial model per sample; no code of the package), in every mode; the per-lag diagnostics with a hand computation;
every preset trains; bad input fails clearly; two processes give the same update as one.
"""

from __future__ import annotations

import trl_rollout_corr  # noqa: F401  (first: its CPU-torch guard)

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.async_stub import build_model_dir, build_trainer, make_samples  # noqa: E402

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(str(tmp_path_factory.mktemp("async_model")))


@pytest.fixture(scope="module")
def samples(model_dir):
    return make_samples(model_dir, n_groups=5, noise=0.3, seed=0)


class GradCapture:
    """A callback holding every parameter's gradient just before the first optimizer step."""

    def __new__(cls):
        from transformers import TrainerCallback

        class _Capture(TrainerCallback):
            grads: dict | None = None

            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                if self.grads is None:
                    self.grads = {n: p.grad.detach().double().clone() for n, p in model.named_parameters()
                                  if p.grad is not None}
        return _Capture()


# ---------------------------------------------------------------------------------------------- float64 reference
def reference_gradient(model_dir: str, samples: list, cfg: dict, epsilon: float = 0.2) -> dict:
    """The gradient of one step, from the formulas of the seeds, in float64 (pi_theta = the initial model)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    terms = []  # (logp (T,), rollout (T,), A) per sample
    for s in samples:
        ids = torch.tensor(s.input_ids.tolist())
        logits = model(input_ids=ids[None]).logits[0, :-1]
        logp_all = logits.log_softmax(-1).gather(-1, ids[1:, None])[:, 0]  # position p predicts ids[p+1]
        pos = np.nonzero(s.completion_mask[1:])[0]
        terms.append((logp_all[pos], torch.tensor(s.old_log_probs[1:][pos], dtype=torch.float64), s.advantage))
    losses, kept_n = [], 0
    bypass, pg = cfg.get("bypass_mode", False), cfg.get("use_policy_gradient", False)
    C = cfg.get("rollout_is_threshold", 2.0)
    for logp, rollout, adv in terms:
        if not torch.isfinite(rollout).all():
            continue  # an invalid sample leaves the loss
        log_rho = logp.detach() - rollout  # (T,) pi_theta = pi_prox here
        keep = torch.ones_like(log_rho, dtype=torch.bool)
        rs, hi = cfg.get("rollout_rs"), cfg.get("rollout_rs_threshold")
        lo = cfg.get("rollout_rs_threshold_lower") or (1 / hi if hi else None)
        if rs == "token":
            keep &= (torch.exp(log_rho) >= lo) & (torch.exp(log_rho) <= hi)
        elif rs == "sequence":
            keep &= bool(lo <= math.exp(log_rho.sum()) <= hi)
        elif rs == "geometric":
            keep &= bool(lo <= math.exp(log_rho.mean()) <= hi)
        veto = cfg.get("rollout_token_veto_threshold")
        if veto is not None and bool((torch.exp(log_rho) < veto).any()):
            keep &= False
        level = cfg.get("rollout_is", "token")
        w = (torch.exp(log_rho).clamp(max=C) if level == "token"
             else torch.full_like(log_rho, min(math.exp(log_rho.sum()), C)))
        if bypass and not pg:
            r = torch.exp(logp - rollout)
            per_token = -torch.minimum(r * adv, r.clamp(1 - epsilon, 1 + epsilon) * adv)
        else:
            per_token = -w * adv * torch.exp(logp - logp.detach())
        losses.append(per_token[keep].sum())
        kept_n += int(keep.sum())
    loss = torch.stack(losses).sum() / max(kept_n, 1)
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


REFERENCE_CASES = {
    # bypass_mode=False: the async config's base is TRL's own (ppo_is_bypass) when no preset is named
    "decoupled_token_is_token_rs": dict(bypass_mode=False, rollout_is="token", rollout_is_threshold=1.5,
                                        rollout_rs="token", rollout_rs_threshold=1.6, rollout_rs_threshold_lower=0.6),
    "decoupled_seq_is_veto": dict(bypass_mode=False, rollout_is="sequence", rollout_is_threshold=3.0,
                                  rollout_token_veto_threshold=0.5),
    "bypass_ppo_token_rs": dict(bypass_mode=True, rollout_is="token", rollout_rs="token", rollout_rs_threshold=2.0),
    "bypass_pg_seq_is_geo_rs": dict(bypass_mode=True, use_policy_gradient=True, rollout_is="sequence",
                                    rollout_is_threshold=2.0, rollout_rs="geometric", rollout_rs_threshold=1.15),
}


@pytest.mark.parametrize("case", list(REFERENCE_CASES))
def test_one_step_gradient_equals_the_float64_formula(model_dir, tmp_path, case):
    cfg = REFERENCE_CASES[case]
    batch = make_samples(model_dir, n_groups=4, noise=0.4, seed=3, nan_sample=2)  # sample 2: a NaN log-prob
    trainer, _ = build_trainer(model_dir, batch, str(tmp_path), max_steps=1, per_device_train_batch_size=8,
                               max_grad_norm=0.0, temperature=1.0, **cfg)
    capture = GradCapture()
    trainer.add_callback(capture)
    trainer.train()
    log = trainer.state.log_history[0]
    # the first 8 samples (groups 0 and 1) were the micro-batch
    ref = reference_gradient(model_dir, batch[:8], cfg)
    num = sum(float(((capture.grads[n] - g) ** 2).sum()) for n, g in ref.items())
    den = sum(float((g ** 2).sum()) for g in ref.values())
    assert den > 0 and math.sqrt(num / den) < 1e-4, (case, math.sqrt(num / den))
    assert log["rollout_corr/invalid_logprob_fraction"] > 0  # the NaN sample is counted ...
    assert math.isfinite(log["loss"])  # ... and not trained on (the reference leaves it out)
    if cfg.get("rollout_rs") or cfg.get("rollout_token_veto_threshold"):
        assert 0 < log["rollout_corr/rejected_token_fraction"] < 1  # the rejection really acts here


def test_lag_diagnostics_equal_a_hand_computation(model_dir, tmp_path):
    # samples of versions 1 and 0 in one micro-batch: at the first step (trainer version 1) lags 0 and 1
    batch = make_samples(model_dir, n_groups=4, noise=0.3, seed=5, version=[1, 1, 0, 0] * 4)
    trainer, _ = build_trainer(model_dir, batch, str(tmp_path), max_steps=1, per_device_train_batch_size=8,
                               rollout_correction_preset="decoupled_token_is")
    trainer.train()
    log = trainer.state.log_history[0]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    diffs = {0: [], 1: []}
    for s in batch[:8]:
        ids = torch.tensor(s.input_ids.tolist())
        with torch.no_grad():
            logp = model(input_ids=ids[None]).logits[0, :-1].log_softmax(-1).gather(-1, ids[1:, None])[:, 0]
        pos = np.nonzero(s.completion_mask[1:])[0]
        diffs[1 - s.model_version].append(torch.tensor(s.old_log_probs[1:][pos], dtype=torch.float64) - logp[pos])
    for lag, parts in diffs.items():
        d = torch.cat(parts)  # log pi_rollout - log pi_theta
        assert log[f"rollout_corr/lag_{lag}/kl"] == pytest.approx(float(d.mean()), rel=1e-4, abs=1e-6)
        assert log[f"rollout_corr/lag_{lag}/k3_kl"] == pytest.approx(float((torch.exp(-d) + d - 1).mean()), rel=1e-4)
        assert log[f"rollout_corr/lag_{lag}/sample_fraction"] == pytest.approx(0.5)
        w = torch.exp(-d).clamp(max=2.0)
        assert log[f"rollout_corr/lag_{lag}/is_weight_mean"] == pytest.approx(float(w.mean()), rel=1e-4)
    assert log["rollout_corr/lag_mean"] == pytest.approx(0.5) and log["rollout_corr/lag_max"] == 1
    assert "rollout_corr/lag_2/kl" not in log  # no sample at lag 2: not reported


def test_mismatch_grows_with_the_lag(model_dir, tmp_path):
    # pi_rollout = the initial policy exactly; the same queue is consumed while the policy moves: lag 0, 1, 2, 3
    batch = make_samples(model_dir, n_groups=5, noise=0.0, seed=7)
    trainer, _ = build_trainer(model_dir, batch, str(tmp_path), max_steps=4, learning_rate=3e-2,
                               rollout_correction_preset="decoupled_token_is")
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    k3 = [logs[k][f"rollout_corr/lag_{k}/k3_kl"] for k in range(4)]
    assert k3[0] < 1e-10 and all(a < b for a, b in zip(k3, k3[1:])), k3
    assert [log["rollout_corr/lag_max"] for log in logs] == [0, 1, 2, 3]


def test_all_rejected_micro_batch_trains_nothing_and_warns_and_a_normal_run_stays_quiet(model_dir, samples, tmp_path,
                                                                                         caplog):
    caplog.set_level(logging.WARNING, logger="trl_rollout_corr")
    quiet, _ = build_trainer(model_dir, samples, str(tmp_path / "q"), max_steps=2,
                             rollout_correction_preset="decoupled_token_is")
    quiet.train()
    assert not [r for r in caplog.records if "rejected every token" in r.getMessage()]
    # a token band no token falls in: everything rejected
    trainer, _ = build_trainer(model_dir, samples, str(tmp_path / "r"), max_steps=2, rollout_rs="token",
                               rollout_rs_threshold=1.0001, rollout_rs_threshold_lower=0.9999)
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    log = [log for log in trainer.state.log_history if "loss" in log][0]
    assert log["loss"] == 0 and log["rollout_corr/rejected_token_fraction"] == 1
    assert log["rollout_corr/all_rejected_micro_batches"] == 1
    assert [r for r in caplog.records if "rejected every token" in r.getMessage()]
    assert all(torch.equal(p.detach(), start[n]) for n, p in trainer.model.named_parameters())  # no update


def _every_preset():
    from trl_rollout_corr import RolloutCorrectionConfig

    return [*RolloutCorrectionConfig.PRESETS, "decoupled_k3_rs_token_tis", "bypass_pg_geo_rs_seq_tis"]


@pytest.mark.parametrize("preset", _every_preset())
def test_every_preset_trains_on_trl_s_async_trainer(model_dir, samples, tmp_path, preset):
    """Each preset (and two of verl's divergence-criteria names) trains 2 steps with every metric finite and the
    resolved config saved (against the real server: four of them, tests/async_grpo/test_async_cpu.py)."""
    from trl_rollout_corr.core.metrics import ALWAYS_METRICS, OFFPOLICY_METRICS, PREFIX

    trainer, _ = build_trainer(model_dir, samples, str(tmp_path), max_steps=2, rollout_correction_preset=preset)
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 2 and {PREFIX + m for m in (*OFFPOLICY_METRICS, *ALWAYS_METRICS)} <= logs[-1].keys()
    assert all(math.isfinite(v) for log in logs for k, v in log.items() if k.startswith(PREFIX)), logs
    trainer.save_model()
    from trl_rollout_corr import RolloutCorrectionConfig

    saved = RolloutCorrectionConfig.from_file(tmp_path / "rollout_correction_config.json")
    assert saved == RolloutCorrectionConfig.from_preset(preset)  # the preset, as named (nothing else set)


def test_require_rollout_logprobs_names_the_sample(model_dir, tmp_path):
    batch = make_samples(model_dir, n_groups=4, seed=3, nan_sample=1)
    trainer, _ = build_trainer(model_dir, batch, str(tmp_path), max_steps=1, require_rollout_logprobs=True)
    with pytest.raises(ValueError, match=r"Samples \[1\].*non-finite rollout log-probs"):
        trainer.train()


def test_config_errors_name_the_field_and_the_fix(model_dir, tmp_path):
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from tests.support.async_stub import async_args
    from trl_rollout_corr import RolloutCorrAsyncGRPOTrainer

    with pytest.raises(TypeError, match="RolloutCorrAsyncGRPOConfig"):
        RolloutCorrAsyncGRPOTrainer(model_dir, args=AsyncGRPOConfig(output_dir=str(tmp_path), bf16=False,
                                                                    use_cpu=True, report_to=[]))
    with pytest.raises(ValueError, match="use_policy_gradient=True requires bypass_mode=True"):
        async_args(str(tmp_path), use_policy_gradient=True, bypass_mode=False)
    with pytest.raises(ValueError, match="rollout_rs_threshold"):
        async_args(str(tmp_path), rollout_rs="token")
    with pytest.raises(ValueError, match="server_unreachable_timeout_s"):
        async_args(str(tmp_path), server_unreachable_timeout_s=0)
    args = async_args(str(tmp_path), rollout_correction_preset="ppo_is_bypass")
    assert args.bypass_mode is True and args.rollout_is == "token" and args.to_dict()["bypass_mode"] is True


def test_no_server_at_start_is_a_clear_error_before_loading_anything(model_dir, tmp_path):
    import time

    from tests.support.async_stub import async_args
    from trl_rollout_corr import RolloutCorrAsyncGRPOTrainer
    from trl_rollout_corr.trl_hooks import async_grpo_cpu as cpu

    if not torch.cuda.is_available():
        start = time.monotonic()
        args = async_args(str(tmp_path), vllm_server_base_url="http://127.0.0.1:9")  # nothing listens on port 9
        with pytest.raises(RuntimeError, match=r"No vLLM server answers at http://127.0.0.1:9.*vllm-serve-async"):
            RolloutCorrAsyncGRPOTrainer(model_dir, reward_funcs=[], args=args)
        assert time.monotonic() - start < 30
    assert cpu is not None


@pytest.mark.parametrize("preset", ["decoupled_seq_is_rs"])  # bypass/PG across processes:
                                                             # tests/grpo/test_distributed.py
def test_two_processes_give_the_same_update_as_one(model_dir, tmp_path, preset):
    worker = str(ROOT / "tests" / "support" / "async_dist_worker.py")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "TRL_EXPERIMENTAL_SILENCE": "1"}
    results = {}
    for n in (1, 2):
        out = tmp_path / f"n{n}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_port",
               str(_free_port()), worker, str(out), model_dir, preset, str(8 // n)]
        proc = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
        results[n] = json.loads(out.read_text())
    assert results[1]["world_size"] == 1 and results[2]["world_size"] == 2
    one, two = results[1], results[2]
    assert len(one["logs"]) == len(two["logs"]) == 2
    for a, b in zip(one["logs"], two["logs"]):
        assert a.keys() == b.keys() and len(a) > 40
        for name, value in a.items():
            assert b[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    p1, p2 = torch.tensor(one["params"]), torch.tensor(two["params"])
    assert (p1 - p2).abs().max() < 1e-6 * max(1.0, float(p1.abs().max()))


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_flat_terms_to_rows_by_hand():
    from trl_rollout_corr.core.flat import per_row, rows_from_segments, to_rows, to_terms

    segment_id = torch.tensor([0, 0, 2, 1, 0, 2])  # sample 0: terms 0, 1, 4; sample 1: term 3; sample 2: terms 2, 5
    layout = rows_from_segments(segment_id)
    assert (layout.num_rows, layout.width) == (3, 3)
    values = torch.tensor([10.0, 11.0, 12.0, 13.0, 14.0, 15.0])
    assert to_rows(values, layout, -1.0).tolist() == [[10, 11, 14], [13, -1, -1], [12, 15, -1]]
    assert torch.equal(to_terms(to_rows(values, layout), layout), values)
    assert per_row(torch.tensor([5, 5, 7, 6, 5, 7]), layout).tolist() == [5, 6, 7]
    empty = rows_from_segments(torch.zeros(0, dtype=torch.long))
    assert (empty.num_rows, empty.width) == (0, 0) and to_rows(torch.zeros(0), empty).shape == (0, 0)
    gap = rows_from_segments(torch.tensor([0, 2]))  # sample 1 has no trained token: an empty row
    assert to_rows(torch.tensor([1.0, 2.0]), gap, 0.0).tolist() == [[1.0], [0.0], [2.0]]


def test_padded_terms_laid_out_with_the_collator_s_sizes_by_hand():
    """The collator's CPU layout (term_columns) and the trainer's padded one: padding terms (valid False) go to a
    dummy row that to_rows drops; B and T may exceed this rank's own (another rank's row is larger)."""
    from trl_rollout_corr.core.flat import padded_layout, per_row, term_columns, to_rows, to_terms

    col, num_rows, width = term_columns(torch.tensor([0, 0, 2, 1, 0, 2]))
    assert col.tolist() == [0, 1, 0, 0, 2, 1] and (num_rows, width) == (3, 3)
    segment_id = torch.tensor([0, 0, 2, 1, 0, 2, 0, 0])  # (M_pad,) two padding terms (TRL pads segment_id with 0)
    valid = torch.tensor([True] * 6 + [False] * 2)
    layout = padded_layout(segment_id, torch.cat([col, torch.tensor([-1, -1])]), valid, 4, 4)
    values = torch.tensor([10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 99.0, 98.0])
    assert to_rows(values, layout, -1.0).tolist() == [[10, 11, 14, -1], [13, -1, -1, -1], [12, 15, -1, -1],
                                                      [-1, -1, -1, -1]]
    assert to_terms(to_rows(values, layout), layout)[valid].tolist() == values[valid].tolist()
    assert per_row(torch.tensor([5, 5, 7, 6, 5, 7, -9, -9]), layout).tolist() == [5, 6, 7, -1]


def _sample(ids: list[int], prompt: int, group: int) -> dict:
    """A rollout sample as TRL's RolloutQueueDataset yields it (with the version the trainer's dataset tags)."""
    n = len(ids)
    return {"input_ids": torch.tensor(ids), "completion_mask": torch.tensor([0] * prompt + [1] * (n - prompt)),
            "old_log_probs": -torch.arange(1.0, n + 1.0) / 10, "advantage": float(group) - 0.5, "group_id": group,
            "metrics": {}, "rc_model_version": 3}


def test_the_packed_row_is_sliced_with_the_collator_s_sizes_exactly_where_trl_masks_it():
    """Three ranks' rows of different lengths (a shared prompt, the longest row, a short one): after
    accelerate's slicing, every rank's forward keywords (slices of the sizes carried as shapes) equal TRL's own
    boolean-mask reads of the same batch (TRL 1.16's compute_loss, written out here); a row padded at its start is
    refused on the CPU batch."""
    from accelerate.utils import slice_tensors
    from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout
    from trl.experimental.async_grpo.packing import TreeRow

    from trl_rollout_corr.trl_hooks import TrlInternalsChanged
    from trl_rollout_corr.trl_hooks.async_grpo import packed_forward
    from trl_rollout_corr.trl_hooks.async_grpo_data import _collator_class, _packed_sizes

    rows = [TreeRow() for _ in range(3)]
    for sample in (_sample([5, 6, 7, 8, 9], 3, 0), _sample([5, 6, 7, 10], 3, 0)):  # one prompt, two completions
        rows[0].add(sample)
    rows[1].add(_sample([11, 12, 13, 14, 15, 16, 17, 18], 2, 1))  # the longest row
    rows[2].add(_sample([20, 21, 22], 1, 1))
    collator = _collator_class(DataCollatorForRollout)(pad_token_id=0, num_processes=3)
    batch = collator.torch_call([rows])
    assert [tuple(c.shape) for c in batch["rc_packed_sizes"]] == [
        # (P, 0, N, kv, cu_q, cu_k, max_q, max_k). Row 0: TRL's trie forks one token early (a node is keyed on its
        # token and the next), so segments 5 6 | 7 8 9 | 7 10: N = 7, paths of 2, 5 and 4 positions (kv 11)
        (3, 0, 7, 11, 4, 4, 3, 5), (3, 0, 8, 8, 2, 2, 8, 8), (3, 0, 3, 3, 2, 2, 3, 3)]
    assert all(c.numel() == 0 for c in batch["rc_packed_sizes"])

    class Model:
        def __call__(self, **kwargs):
            self.kwargs = kwargs
            return "outputs"

    for rank in range(3):
        inputs = slice_tensors(batch, slice(rank, rank + 1))  # what accelerate's dispatcher hands rank r
        model = Model()
        outputs, kwargs, _ = packed_forward(model, inputs, aux_loss_enabled=False, rank=rank)
        assert outputs == "outputs" and kwargs["fused_lm_head"] is True
        assert model.kwargs.keys() == kwargs.keys() and all(model.kwargs[k] is v for k, v in kwargs.items())
        mask = inputs["attention_mask"].bool()  # TRL's reads, with their host syncs
        for key in ("input_ids", "position_ids", "shift_labels"):
            assert torch.equal(kwargs[key], inputs[key][mask].unsqueeze(0)), (rank, key)
        for key in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k"):
            assert torch.equal(kwargs[key], inputs[key][inputs[key] >= 0]), (rank, key)
        assert [kwargs["tree_max_seqlen_q"], kwargs["tree_max_seqlen_k"]] == inputs["tree_max_seqlens"][0].tolist()
        assert kwargs["input_ids"].tolist() == [rows[rank].pack()["input_ids"].tolist()]

    left = dict(batch, attention_mask=batch["attention_mask"].flip(1))  # TRL padding at the start of a row
    with pytest.raises(TrlInternalsChanged, match="no longer pads attention_mask at the end of a row"):
        _packed_sizes(left)
    tree = batch["tree_kv_index"].clone()
    tree[2] = tree[2].roll(1)  # rank 2's padding first
    with pytest.raises(TrlInternalsChanged, match="no longer pads tree_kv_index at the end of a row"):
        _packed_sizes(dict(batch, tree_kv_index=tree))


def test_server_probe_raises_only_after_the_timeout():
    import time

    from trl_rollout_corr.async_grpo.server_probe import ServerProbe

    probe = ServerProbe("http://127.0.0.1:9", timeout_s=0.5)  # nothing listens on port 9
    probe.probe()  # not answering, but not for long yet
    time.sleep(0.6)
    with pytest.raises(RuntimeError, match=r"vLLM server at http://127.0.0.1:9 has not answered .*vllm-serve-async"):
        probe.probe()


def test_ppo_is_bypass_trains_exactly_as_trl_async_grpo(model_dir, tmp_path):
    """Bypass PPO keeps TRL's loss (pi_old := pi_rollout, clipped ratio pi_theta / pi_rollout): with nothing rejected,
    the same gradient as TRL's AsyncGRPOTrainer itself, which then logs nothing under rollout_corr/."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from tests.support.async_stub import StubRolloutWorker, StubWeightTransfer, async_args

    batch = make_samples(model_dir, n_groups=4, noise=0.4, seed=9)
    ours, _ = build_trainer(model_dir, batch, str(tmp_path / "ours"), max_steps=1, per_device_train_batch_size=8,
                            max_grad_norm=0.0, rollout_correction_preset="ppo_is_bypass")
    own = async_args(str(tmp_path / "trl"), max_steps=1, per_device_train_batch_size=8, max_grad_norm=0.0).to_dict()
    trl_args = AsyncGRPOConfig(**{k: v for k, v in own.items() if k in AsyncGRPOConfig.__dataclass_fields__
                                  and AsyncGRPOConfig.__dataclass_fields__[k].init and not k.startswith("_")})
    trl_args.output_dir = str(tmp_path / "trl")
    theirs = AsyncGRPOTrainer(model=model_dir, reward_funcs=[], args=trl_args,
                              train_dataset=Dataset.from_dict({"prompt": ["x"] * 8}),
                              processing_class=AutoTokenizer.from_pretrained(model_dir),
                              rollout_worker=StubRolloutWorker(batch), weight_transfer=StubWeightTransfer())
    grads = []
    for trainer in (ours, theirs):
        capture = GradCapture()
        trainer.add_callback(capture)
        trainer.train()
        grads.append(capture.grads)
    assert max(float((grads[0][n] - g).abs().max()) for n, g in grads[1].items()) < 1e-7
    ours_log, theirs_log = ours.state.log_history[0], theirs.state.log_history[0]
    assert ours_log["loss"] == pytest.approx(theirs_log["loss"], rel=1e-6)
    assert ours_log["ratio"] == pytest.approx(theirs_log["ratio"], rel=1e-6)
    assert not any(k.startswith("rollout_corr/") for k in theirs_log)


def test_each_assumption_about_trl_fails_loudly_when_broken(model_dir, samples, tmp_path, monkeypatch):
    import importlib

    from trl_rollout_corr.trl_hooks import TrlInternalsChanged
    from trl_rollout_corr.trl_hooks.async_grpo import AnsweredForward
    from trl_rollout_corr.trl_hooks.async_grpo_data import carrying_sample_versions

    module = importlib.import_module("trl.experimental.async_grpo.async_grpo_trainer")
    original = module.DataCollatorForRollout
    monkeypatch.delattr(module, "DataCollatorForRollout")
    with pytest.raises(TrlInternalsChanged, match="DataCollatorForRollout is gone.*installed TRL"):
        with carrying_sample_versions():
            pass
    monkeypatch.setattr(module, "DataCollatorForRollout", original, raising=False)
    with carrying_sample_versions():  # swapped while TRL builds its dataloader, restored after
        assert module.DataCollatorForRollout is not original
    assert module.DataCollatorForRollout is original

    ran = dict(input_ids=torch.tensor([[1, 2, 3]]), tree_kv_index=torch.tensor([0, 1, 2]), tree_max_seqlen_q=3,
               fused_lm_head=True)
    answered = AnsweredForward("outputs", ran)
    with pytest.raises(TrlInternalsChanged, match="one forward on the packed row"):
        answered(input_ids=torch.tensor([[1, 2]]))  # another row: compared by shape (values: a host sync)
    for key, other in (("input_ids", torch.tensor([[1, 2]])), ("tree_kv_index", torch.tensor([0, 1])),
                       ("tree_kv_index", torch.tensor([0, 1, 2], dtype=torch.int32)), ("tree_max_seqlen_q", 2)):
        with pytest.raises(TrlInternalsChanged, match=f"as the trainer ran it: {key} differ"):
            AnsweredForward("outputs", ran)(**{**ran, key: other})  # TRL's masks found other sizes than the collator
    with pytest.raises(TrlInternalsChanged, match="as the trainer ran it: output_router_logits differ"):
        AnsweredForward("outputs", ran)(**ran, output_router_logits=True)
    same = {**ran, "input_ids": torch.tensor([[7, 8, 9]])}  # other values, same layout: answered (no host sync)
    assert AnsweredForward("outputs", ran)(**same) == "outputs"

    trainer, _ = build_trainer(model_dir, samples, str(tmp_path), max_steps=1)
    with pytest.raises(TrlInternalsChanged,
                       match="no rc_sample_version, rc_term_col, rc_row_mask, rc_packed_sizes at compute_loss"):
        trainer.compute_loss(trainer.model, {k: torch.zeros(1, 1) for k in (
            "input_ids", "attention_mask", "position_ids", "shift_labels", "token_index", "old_log_probs",
            "advantages", "segment_id", "global_n_tokens", "global_n_forward_tokens", "mean_seq_len",
            "tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k", "tree_max_seqlens")})


def test_a_log_while_not_training_keeps_the_statistics_for_the_next_training_log(model_dir, samples, tmp_path):
    """A log call outside training (an eval-mode log between two training logs) must not drop what the steps since
    the last training log gathered: the next training log equals a run without it."""
    from transformers import TrainerCallback

    class LogWhileNotTraining(TrainerCallback):
        def __init__(self, trainer):
            self.trainer = trainer

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                self.trainer.model.eval()
                self.trainer.log({"probe": 0.0})
                self.trainer.model.train()

    logs = []
    for probe in (False, True):
        trainer, _ = build_trainer(model_dir, samples, str(tmp_path / str(probe)), max_steps=2, logging_steps=2,
                                   rollout_correction_preset="decoupled_token_is", bypass_mode=False)
        if probe:
            trainer.add_callback(LogWhileNotTraining(trainer))
        trainer.train()
        logs.append([log for log in trainer.state.log_history if "loss" in log][-1])
    plain, probed = ({k: v for k, v in log.items() if k.startswith("rollout_corr/")} for log in logs)
    assert plain and probed == pytest.approx(plain)
