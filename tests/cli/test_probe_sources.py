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

from tests.support.trainer_utils import make_trainer


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


# ---------------------------------------------------------------- the precision copy on a GPU (issue 37 remainder)
GIB = 1 << 30


def _scored_batch(trainer):
    torch.manual_seed(0)
    return trainer.score_generation_batch(next(iter(trainer.get_train_dataloader())))


def _fake_cuda(monkeypatch, free, total, reserved=0, allocated=0):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)


def test_the_precision_copy_is_built_only_when_it_fits_on_the_device(tmp_path, monkeypatch):
    """fp32 trainer, bf16 engine: the precision part needs a bf16 copy of the policy. On a CUDA device (faked: the
    copy's bytes reported on cuda:0, torch.cuda's memory queries monkeypatched) it is built when the copy plus the
    margin (max(1 GiB, 10% of the device)) fits in what is free (the driver's free plus the allocator's unused
    reserve), and otherwise skipped with the reason and the way out in the report, the other parts still measured."""
    from trl_rollout_corr.cli import probe as probe_module
    from trl_rollout_corr.cli.probe import SourceRescorer, copy_bytes_by_device, engine_dtype_copy, format_sources

    trainer, _ = make_trainer(tmp_path, rollout_sampler=EmulatedRolloutEngine("bf16"), max_completion_length=6)
    policy = trainer.accelerator.unwrap_model(trainer.model)
    # the copy's bytes: what the copy built on the CPU actually holds (independently of the estimate's arithmetic)
    built = engine_dtype_copy(policy, torch.bfloat16)
    held = sum(t.numel() * t.element_size() for t in [*built.parameters(), *built.buffers()])
    need = copy_bytes_by_device(policy, torch.bfloat16)
    assert need == {torch.device("cpu"): held}
    assert held == sum(t.numel() * (2 if t.is_floating_point() else t.element_size())
                       for t in policy.state_dict().values()) + sum(
        b.numel() * 2 for name, b in policy.named_buffers() if name not in policy.state_dict())
    del built
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(probe_module, "copy_bytes_by_device", lambda model, dtype: {cuda: held})
    batch = _scored_batch(trainer)
    total = 40 * GIB  # margin 4 GiB
    margin = 4 * GIB

    # one byte short: skipped, never built, the batch shape still measured
    _fake_cuda(monkeypatch, free=held + margin - 1, total=total)
    monkeypatch.setattr(probe_module, "engine_dtype_copy", lambda *a: pytest.fail("built a copy that does not fit"))
    rescorer = SourceRescorer(trainer)
    out = rescorer(batch)
    assert "engine_dtype_logps" not in out and "reshaped_logps" in out
    note = rescorer.describe()["precision_note"]
    assert note.startswith("not measured: the copy of the model in the engine's dtype needs")
    assert "cuda:0" in note and "--probe_split false" in note and "vllm_gpu_memory_utilization" in note
    rescorer(batch)  # the second batch does not try again
    report_sources = mismatch_by_source(batch["train_logps"], batch["train_logps"], batch["rollout_logps"],
                                        batch["mask"], out.get("engine_dtype_logps"), out["reshaped_logps"])
    assert report_sources["precision"] is None and report_sources["batch_shape"] is not None
    lines = format_sources({"sources": {**report_sources, **rescorer.describe()}})
    row = next(line for line in lines if "precision (bfloat16)" in line)
    assert " - " in row and "not measured: the copy" in row

    # exactly enough once the allocator's unused reserve counts as free: built and measured
    _fake_cuda(monkeypatch, free=held + margin - 2, total=total, reserved=10, allocated=8)
    monkeypatch.setattr(probe_module, "engine_dtype_copy", engine_dtype_copy)
    rescorer = SourceRescorer(trainer)
    out = rescorer(batch)
    assert rescorer.describe()["precision_note"] is None and rescorer._copy is not None
    assert out["engine_dtype_logps"].shape == batch["train_logps"].shape
    assert not torch.equal(out["engine_dtype_logps"], batch["train_logps"].float())  # bf16 moved something


def test_the_engine_dtype_copy_is_the_cast_model_and_leaves_the_policy_alone(tmp_path):
    """The copy built tensor by tensor scores exactly as the whole model deep-copied and then cast (what the probe
    did before, holding a full-precision copy on the way), and the policy keeps its float32 bits."""
    from trl_rollout_corr.cli.probe import SourceRescorer, engine_dtype_copy

    trainer, _ = make_trainer(tmp_path, rollout_sampler=EmulatedRolloutEngine("bf16"), max_completion_length=6)
    policy = trainer.accelerator.unwrap_model(trainer.model)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    batch = _scored_batch(trainer)
    rescorer = SourceRescorer(trainer)
    size = trainer.args.per_device_train_batch_size
    new = rescorer._forward(engine_dtype_copy(policy, torch.bfloat16), batch, size, autocast=False)  # (B, T)
    old = rescorer._forward(copy.deepcopy(policy).to(torch.bfloat16), batch, size, autocast=False)  # (B, T)
    assert torch.equal(new, old)
    after = policy.state_dict()
    assert all(after[k].dtype == torch.float32 and torch.equal(after[k], v) for k, v in before.items())
    assert {p.data_ptr() for p in policy.parameters()}.isdisjoint(
        p.data_ptr() for p in engine_dtype_copy(policy, torch.bfloat16).parameters())


# ---------------------------------------------------------------- cast_lm_head_to_fp32 (issue 38, F9)
def _tied_model():
    from transformers import Qwen2ForCausalLM

    from trl_rollout_corr.testing.toy_task import build_model

    config = build_model(hidden_size=32).config
    config.tie_word_embeddings = True
    torch.manual_seed(1)
    return Qwen2ForCausalLM(config)


def _reference_logps64(model, backbone_dtype, head_dtype, input_ids, attention_mask, width):
    """log p(a_t) (B, T) from a plain transformers forward (TRL's patched forwards and hooks dropped): the backbone
    in ``backbone_dtype``, the logits h W^T computed in ``head_dtype`` (bf16: rounded to bf16, as a bf16 engine's),
    then taken to float64 for the softmax."""
    m = copy.deepcopy(model).to(backbone_dtype).eval()
    for module in m.modules():
        module.__dict__.pop("forward", None)
        module._forward_hooks.clear()
    with torch.no_grad():
        hidden = m.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, -width - 1:-1]
        logits = hidden.to(head_dtype) @ model.lm_head.weight.detach().to(backbone_dtype).to(head_dtype).T
    return torch.log_softmax(logits.double(), -1).gather(-1, input_ids[:, -width:, None]).squeeze(-1)  # (B, T)


@pytest.mark.parametrize("tied", [False, True])
def test_cast_lm_head_to_fp32_puts_the_heads_rounding_in_the_precision_part(tmp_path, tied):
    """A float32 trainer with TRL's cast_lm_head_to_fp32 against a bf16 engine (the policy cast to bf16). The engine
    computes its logits in bf16; the precision part now re-scores that way (before: the copy projected its head in
    float32, leaving the head's rounding out). Its k3 is that of a float64 derivation with the head in bf16, and not
    that of one with a bf16 backbone and a float32 head. Tied embeddings (TRL then also hooks the embedding) too."""
    # the tied model samples with the float32 policy and states the engine's dtype (--probe_engine_dtype): the
    # emulated bf16 engine cannot run a tied model under cast_lm_head_to_fp32 (TRL's embedding hook goes along)
    trainer, _ = make_trainer(tmp_path, model=_tied_model() if tied else None,
                              rollout_sampler=EmulatedRolloutEngine("none" if tied else "bf16"),
                              max_completion_length=12, cast_lm_head_to_fp32=True)
    policy = trainer.accelerator.unwrap_model(trainer.model)
    assert policy.lm_head.weight.dtype == torch.float32
    torch.manual_seed(0)
    data = collect(trainer, 1, engine_dtype="bfloat16")
    src = analyse(data, ())["sources"]
    assert src["lm_head"].startswith("float32 in the trainer (cast_lm_head_to_fp32), bfloat16")
    assert "LM head too" in "\n".join(format_report({**analyse(data, ()), "seconds": 0.0}).splitlines())
    batch = data["batches"][0]
    width = data["mask"].size(1)
    args = (batch["input_ids"], batch["attention_mask"], width)
    fp32 = _reference_logps64(policy, torch.float32, torch.float32, *args)  # (B, T) the trainer
    valid = data["mask"].bool()
    assert torch.allclose(data["train_logps"].double()[valid], fp32[valid], atol=1e-5)

    def k3_of(other):
        d = (fp32 - other)[valid]
        return float((torch.expm1(d) - d).mean())

    engine = k3_of(_reference_logps64(policy, torch.bfloat16, torch.bfloat16, *args))
    head_fp32 = k3_of(_reference_logps64(policy, torch.bfloat16, torch.float32, *args))
    assert abs(engine - head_fp32) > 0.05 * engine  # the head's rounding is a visible part here
    assert src["precision"]["k3"] == pytest.approx(engine, rel=1e-2)
    # the policy is untouched: its float32 head is back, TRL's forward with it
    assert policy.lm_head.weight.dtype == torch.float32
    if tied:
        assert policy.lm_head.weight is policy.model.embed_tokens.weight


@pytest.mark.parametrize("tied", [False, True])
def test_cast_lm_head_to_fp32_on_a_model_in_the_engines_dtype(tmp_path, monkeypatch, tied):
    """A bf16 model under bf16 autocast with cast_lm_head_to_fp32, a bf16 engine: no copy of the model (tied too,
    whose embedding TRL made float32 with the head: the model's dtype is read outside the head), but the
    re-scoring still projects the head in bf16 (before: the policy's float32 head). The engine-dtype log-probs are a
    float64 derivation with everything in bf16; the policy's float32 head object is put back afterwards."""
    from trl_rollout_corr.cli import probe as probe_module
    from trl_rollout_corr.testing.toy_task import build_model

    model = _tied_model() if tied else build_model(hidden_size=32)
    trainer, _ = make_trainer(tmp_path, model=model.to(torch.bfloat16), bf16=True,
                              rollout_sampler=EmulatedRolloutEngine("bf16"), max_completion_length=12,
                              cast_lm_head_to_fp32=True)
    policy = trainer.accelerator.unwrap_model(trainer.model)
    head = policy.lm_head.weight
    assert head.dtype == torch.float32
    monkeypatch.setattr(probe_module, "engine_dtype_copy", lambda *a: pytest.fail("copied a bf16 model"))
    torch.manual_seed(0)
    data = collect(trainer, 1)
    assert data["split"]["lm_head"] is not None and data["split"]["precision_note"] is None
    assert data["split"]["trainer_dtype"] == "bfloat16 + autocast bfloat16"
    batch = data["batches"][0]
    width = data["mask"].size(1)
    args = (batch["input_ids"], batch["attention_mask"], width)
    valid = data["mask"].bool()
    engine = _reference_logps64(policy, torch.bfloat16, torch.bfloat16, *args)[valid]  # (N,)
    head_fp32 = _reference_logps64(policy, torch.bfloat16, torch.float32, *args)[valid]  # (N,)
    got = data["engine_dtype_logps"].double()[valid]
    assert (got - engine).abs().max() < 0.2 * (head_fp32 - engine).abs().max()
    assert policy.lm_head.weight is head and head.dtype == torch.float32 and "forward" in policy.__dict__


# ---------------------------------------------------------------- ZeRO-3 / FSDP: the row says why it is empty
def test_a_sharded_model_reports_the_precision_row_as_not_measured(tmp_path, monkeypatch):
    """ZeRO-3 (parameters with ds_id) and FSDP2 (DTensor parameters) shard the weights, so the probe makes no copy:
    the precision row is still in the table and the JSON, saying so and what to do; batch shape is measured."""
    from trl_rollout_corr.cli import probe as probe_module
    from trl_rollout_corr.cli.probe import SHARDED_NOTE, is_sharded

    assert SHARDED_NOTE == "not measured: ZeRO-3/FSDP shards the weights; run the probe without sharding"
    zero3 = torch.nn.Linear(2, 2)
    assert not is_sharded(zero3)
    zero3.weight.ds_id = 7  # what DeepSpeed ZeRO-3 puts on each parameter
    assert is_sharded(zero3)

    class DTensor(torch.nn.Parameter):  # FSDP2's parameters are torch.distributed.tensor.DTensor
        pass

    fsdp = torch.nn.Linear(2, 2)
    fsdp.weight = DTensor(fsdp.weight.detach())
    assert is_sharded(fsdp)

    trainer, _ = make_trainer(tmp_path, rollout_sampler=EmulatedRolloutEngine("bf16"), max_completion_length=6)
    monkeypatch.setattr(probe_module, "is_sharded", lambda model: True)
    torch.manual_seed(0)
    report = probe(trainer, 1, ("trl_default",))
    src = report["sources"]
    assert src["precision"] is None and src["remainder"] is None and src["precision_note"] == SHARDED_NOTE
    assert src["engine_dtype"] == "bfloat16" and src["batch_shape"] is not None
    row = next(line for line in format_report(report).splitlines() if "precision (bfloat16)" in line)
    assert row.split()[2] == "-" and row.endswith(SHARDED_NOTE)
    saved = json.load(open(write_report(report, str(tmp_path / "out"))[0]))
    assert saved["sources"]["precision"] is None and saved["sources"]["precision_note"] == SHARDED_NOTE
