"""Issue 37, item 1: the probe's mismatch split by source (precision, batch shape, remainder, next to truncation),
against a hand computation and, on the toy model, against independent float64 re-derivations of the per-token KL."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from trl_rollout_corr.core.mismatch import mismatch_by_source
from trl_rollout_corr.cli.probe import _as_dtype, collect, analyse, format_report, probe, write_report
from trl_rollout_corr.rollout.emulated import EmulatedRolloutEngine

from trainer_utils import make_trainer


def k3(x: float) -> float:
    return math.expm1(x) - x


def test_the_split_by_hand():
    # two tokens of one sequence; the trainer's ratio renormalized by log M = -0.5 on both
    train = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    ratio = train + 0.5  # log pi_train^C
    engine_dtype = torch.tensor([[-1.1, -2.0]], dtype=torch.float64)  # delta_p = (0.1, 0)
    rollout = torch.tensor([[-0.4, -1.6]], dtype=torch.float64)  # log rho = (-0.1, 0.1)
    reshaped = torch.tensor([[-1.0, -2.02]], dtype=torch.float64)  # delta_b = (0, 0.02)
    r = mismatch_by_source(train, ratio, rollout, torch.ones(1, 2), engine_dtype, reshaped)
    total = (k3(-0.1) + k3(0.1)) / 2
    assert r["total"]["k3"] == pytest.approx(total)
    assert r["precision"]["k3"] == pytest.approx(k3(0.1) / 2)
    assert r["precision"]["share_of_k3"] == pytest.approx(k3(0.1) / 2 / total)
    assert r["batch_shape"]["k3"] == pytest.approx(k3(0.02) / 2)
    # remainder: log rho - delta_p = (-0.2, 0.1)
    assert r["remainder"]["k3"] == pytest.approx((k3(-0.2) + k3(0.1)) / 2)
    assert r["remainder"]["k1"] == pytest.approx(-(-0.2 + 0.1) / 2)
    empty = mismatch_by_source(train, ratio, rollout, torch.ones(1, 2))
    assert empty["precision"] is None and empty["batch_shape"] is None and empty["remainder"] is None


def test_the_engine_dtype_argument():
    assert _as_dtype("bf16") is torch.bfloat16 and _as_dtype("float16") is torch.float16 and _as_dtype(None) is None
    with pytest.raises(ValueError, match="probe_engine_dtype='int4'"):
        _as_dtype("int4")


def _plain_logps64(model, dtype, input_ids, attention_mask, width):
    """log p(a_t) of every completion token from a plain transformers forward of ``model`` cast to ``dtype`` (no TRL,
    no fused head), the logits taken to float64 before the softmax. (B, T)"""
    m = copy.deepcopy(model).to(dtype).eval()
    for module in m.modules():  # drop instance-level forwards patched by the trainer
        module.__dict__.pop("forward", None)
    with torch.no_grad():
        logits = m(input_ids=input_ids, attention_mask=attention_mask).logits[:, -width - 1:-1].double()
    return torch.log_softmax(logits, -1).gather(-1, input_ids[:, -width:, None]).squeeze(-1)  # (B, T)


def test_a_bf16_engine_is_precision_and_truncation_is_separate(tmp_path):
    """The engine is the policy cast to bf16, sampling with top-p 0.8; the trainer is fp32. The truncation is
    removed by renormalizing; of what stays, precision explains ~all (the rest is the engine's incremental decoding
    in bf16 against the full forward), and its k3 is that of an independent float64 derivation."""
    trainer, _ = make_trainer(tmp_path, rollout_sampler=EmulatedRolloutEngine("bf16"), max_completion_length=12,
                              top_p=0.8)
    torch.manual_seed(0)
    data = collect(trainer, 1)
    report = analyse(data, ())
    src = report["sources"]
    assert (src["engine_dtype"], src["trainer_dtype"], src["precision_note"]) == ("bfloat16", "float32", None)
    batch = data["batches"][0]
    policy = trainer.accelerator.unwrap_model(trainer.model)
    width = data["mask"].size(1)
    fp32 = _plain_logps64(policy, torch.float32, batch["input_ids"], batch["attention_mask"], width)  # (B, T)
    bf16 = _plain_logps64(policy, torch.bfloat16, batch["input_ids"], batch["attention_mask"], width)  # (B, T)
    d = (fp32 - bf16)[data["mask"].bool()]  # (N,) log pi_train - log pi_train@bf16
    expected = float((torch.expm1(d) - d).mean())
    assert expected > 1e-8
    assert src["precision"]["k3"] == pytest.approx(expected, rel=1e-2)
    assert 0.8 < src["precision"]["share_of_k3"] < 1.25
    assert src["remainder"]["k3"] < 0.5 * src["total"]["k3"]
    assert src["truncation_k3"] > 1e3 * src["precision"]["k3"]  # truncation dominates the raw mismatch
    assert src["batch_shape"]["k3"] < 1e-12  # CPU float32: the batch composition does not change a log-prob


def test_same_dtype_engine_the_remainder_is_all_and_batch_shape_zero(tmp_path):
    """A 4-bit engine in float32 (the trainer's dtype): nothing to separate by precision, the batch shape does not
    matter on the CPU, so the remainder is the whole mismatch; the table and the JSON carry the split."""
    trainer, _ = make_trainer(tmp_path, rollout_sampler=EmulatedRolloutEngine("wq4"), max_completion_length=12)
    torch.manual_seed(0)
    report = probe(trainer, 1, ("trl_default",))
    src = report["sources"]
    assert "already" in src["precision_note"] and src["precision"]["k3"] == 0
    assert src["batch_shape"]["k3"] < 1e-12 and src["batch_shape"]["max_abs_log_rho"] < 1e-5
    assert src["total"]["k3"] > 1e-6
    assert src["remainder"]["k3"] == pytest.approx(src["total"]["k3"], rel=1e-9)
    assert src["seconds"] > 0
    text = format_report(report)
    assert "mismatch by source" in text and "remainder" in text and "batch shape" in text
    saved = json.load(open(write_report(report, str(tmp_path / "out"))[0]))
    assert saved["sources"]["remainder"]["k3"] == pytest.approx(src["remainder"]["k3"])


def test_batch_shape_sees_a_composition_dependent_forward(tmp_path):
    """A backbone whose output moves with the batch size (a stand-in for batch-variant kernels): the batch-shape part
    is no longer 0, and it is the k3 of an independent re-derivation with the same perturbation."""
    trainer, _ = make_trainer(tmp_path, rollout_sampler=EmulatedRolloutEngine("none"), max_completion_length=12)
    policy = trainer.accelerator.unwrap_model(trainer.model)

    def batch_dependent(module, args, kwargs, output):
        if kwargs["input_ids"].size(0) > 1:
            output.last_hidden_state = output.last_hidden_state * 1.05
        return output

    torch.manual_seed(0)
    data = collect(trainer, 1)  # scored without the perturbation
    handle = policy.base_model.register_forward_hook(batch_dependent, with_kwargs=True)
    try:
        torch.manual_seed(0)
        data = collect(trainer, 1)
    finally:
        handle.remove()
    src = analyse(data, ())["sources"]
    batch = data["batches"][0]
    width = data["mask"].size(1)
    m = copy.deepcopy(policy).double().eval()
    for module in m.modules():
        module.__dict__.pop("forward", None)
    with torch.no_grad():
        hidden = m.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        logits = m.lm_head(hidden[:, -width - 1:-1])  # (B, T, V)
    target = batch["input_ids"][:, -width:, None]
    single = torch.log_softmax(logits, -1).gather(-1, target).squeeze(-1)  # (B, T) one per forward: unperturbed
    batched = torch.log_softmax(logits * 1.05, -1).gather(-1, target).squeeze(-1)  # (B, T) the batch of 8
    d = (batched - single)[data["mask"].bool()]
    assert src["batch_shape"]["k3"] == pytest.approx(float((torch.expm1(d) - d).mean()), rel=1e-3)
    assert src["batch_shape"]["k3"] > 1e-6
