"""The kept-mass probe (rollout/support.py) projects the LM head as TRL 1.16's fused head does: its logit multiplier,
its compute dtype (cast_lm_head_to_fp32), an FSDP2 DTensor head, a ZeRO-3 head already gathered (tied). Numbers
against float64 hand computations. ZeRO-3 with a tied head on two processes: tests/grpo/test_distributed.py; held
AVAILABLE under real DeepSpeed in one process: tests/support/zero3_tied_head_worker.py."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from trl_rollout_corr.core.truncation import DEFAULT_CHUNK_ELEMENTS, SamplingTruncation
from trl_rollout_corr.rollout.support import KeptMassProbe, logit_multiplier, probe_chunk_elements

VOCAB, K = 50, 5
TOP_P = SamplingTruncation(temperature=0.7, top_p=0.8)


def tiny_model(**config_fields) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                         tie_word_embeddings=False)
    for name, value in config_fields.items():
        setattr(config, name, value)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # logits of a few units: top-p keeps a real subset
    return model


def probe_run(model, truncation=TOP_P, backbone_only=False, **probe_kwargs):
    """(log M (1, K), in_support (1, K)) from the probe, and the last hidden states (1, L, H) it saw."""
    input_ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(1))  # (1, L)
    seen = {}
    handle = model.base_model.register_forward_hook(lambda m, a, out: seen.update(h=out.last_hidden_state))
    try:
        with KeptMassProbe(model, truncation, K, **probe_kwargs) as probe:
            (model.base_model if backbone_only else model)(input_ids=input_ids)
    finally:
        handle.remove()
    log_mass, in_support = probe.result()
    return log_mass, in_support, seen["h"], input_ids


def hand_log_mass(hidden, weight, scale, truncation=TOP_P, logits=None):
    """float64, by hand: logits = h W^T (or ``logits`` (K, V)) * scale / T; top-p keeps tokens (most likely first)
    while the mass before them is < top_p; log M = log of the kept probabilities' sum. Returns (K,)."""
    if logits is None:
        logits = hidden[0, -K - 1:-1].double() @ weight.double().t()  # (K, V)
    out = []
    for row in logits.double():  # (V,)
        p = torch.softmax(row * scale / truncation.temperature, 0).tolist()
        kept, before = 0.0, 0.0
        for q in sorted(p, reverse=True):
            if before < truncation.top_p:
                kept += q
            before += q
        out.append(math.log(kept))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("fields,factor", [
    ({}, 1.0),
    ({"logit_scale": 0.5}, 0.5),
    ({"output_multiplier": 2.0}, 2.0),  # Muse Glimmer
    ({"lm_head_multiplier": 0.25}, 0.25),  # Falcon-H1
    ({"logits_scaling": 4.0}, 0.25),  # Granite, MiniCPM3: logits / logits_scaling
    ({"logits_scaling": 4.0, "model_type": "hyperclovax"}, 4.0),  # HyperCLOVA X: logits * logits_scaling
    ({"logit_scale": 0.5, "output_multiplier": 2.0}, 0.5),  # logit_scale first, as TRL reads them
], ids=["none", "logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling_divides",
        "logits_scaling_hyperclovax", "logit_scale_first"])
def test_every_logit_multiplier_of_trls_fused_head(fields, factor):
    model = tiny_model(**fields)
    assert logit_multiplier(model.config) == factor
    log_mass, _, hidden, _ = probe_run(model)
    expected = hand_log_mass(hidden, model.lm_head.weight, factor)
    assert (expected < -1e-3).all()  # top-p cuts real mass at every position
    torch.testing.assert_close(log_mass[0].double(), expected, rtol=0, atol=2e-6)


def test_a_zero_logit_scale_is_kept_not_read_as_one():
    """logit_scale = 0.0 (TRL keeps it): every logit is 0, the distribution uniform, and top-p = 0.8 keeps the
    V - floor(0.2 V) = 40 most likely of 50 tokens (ties in sort order): M = 40 / 50 exactly."""
    model = tiny_model(logit_scale=0.0)
    assert logit_multiplier(model.config) == 0.0
    log_mass, _, _, _ = probe_run(model)
    torch.testing.assert_close(log_mass, torch.full((1, K), math.log(40 / 50)), rtol=0, atol=1e-6)


def test_cast_lm_head_to_fp32_projects_in_float32_outside_autocast():
    """Under bf16 autocast TRL's fused head projects in bf16, or in float32 with cast_lm_head_to_fp32: the probe
    follows (float32: the float64 hand value to 2e-6; bf16: off by more than 1e-3 on this head)."""
    model = tiny_model()
    weight = model.lm_head.weight.detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fp32, _, hidden32, _ = probe_run(model, cast_lm_head_to_fp32=True)
        bf16, _, hidden16, _ = probe_run(model)
    torch.testing.assert_close(fp32[0].double(), hand_log_mass(hidden32.float(), weight, 1.0), rtol=0, atol=2e-6)
    rounded = (hidden16[0, -K - 1:-1].bfloat16() @ weight.bfloat16().t()).double()  # (K, V) bf16 logits
    torch.testing.assert_close(bf16[0].double(), hand_log_mass(None, None, 1.0, logits=rounded), rtol=0, atol=2e-6)
    assert (bf16[0].double() - hand_log_mass(hidden16.float(), weight, 1.0)).abs().max() > 1e-4


def test_an_fsdp2_dtensor_head_is_read_through_full_tensor(tmp_path):
    """FSDP2 makes the head's weight a DTensor: plain @ DTensor raises "mixed torch.Tensor and DTensor"; the probe
    reads weight.full_tensor() as TRL's fused head does (a 1-process gloo mesh stands in for the shards)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    model = tiny_model()
    reference, _, _, _ = probe_run(model, backbone_only=True)
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model.lm_head.weight = torch.nn.Parameter(distribute_tensor(model.lm_head.weight.detach(), mesh, [Shard(0)]))
        log_mass, in_support, _, _ = probe_run(model, backbone_only=True)  # the backbone: the hook is the reader
    finally:
        if started:
            dist.destroy_process_group()
    assert type(log_mass) is torch.Tensor
    torch.testing.assert_close(log_mass, reference, rtol=0, atol=0)
    assert in_support.dtype == torch.bool


def test_a_zero3_head_already_available_is_not_gathered_again(monkeypatch):
    """TRL's maybe_gather_lm_head_ctx: a tied head that embed_tokens holds AVAILABLE must not be gathered (and so
    re-partitioned on exit); a partitioned one is gathered once, even when passed twice."""
    import enum

    from trl_rollout_corr.rollout import support

    class Status(enum.Enum):
        AVAILABLE = 1
        NOT_AVAILABLE = 2

    gathered = []

    class FakeDeepSpeed:
        class zero:
            @staticmethod
            def GatheredParameters(params, modifier_rank=None):
                gathered.append(list(params))
                return torch.no_grad()

    monkeypatch.setitem(__import__("sys").modules, "deepspeed", FakeDeepSpeed)
    weight = torch.nn.Parameter(torch.zeros(3))
    weight.ds_id, weight.ds_status = 0, Status.AVAILABLE
    with support._gathered(weight, None):
        pass
    assert gathered == []
    weight.ds_status = Status.NOT_AVAILABLE
    with support._gathered(weight, weight):
        pass
    assert len(gathered) == 1 and len(gathered[0]) == 1 and gathered[0][0] is weight


def test_the_chunk_is_the_default_on_cpu_and_grows_with_free_cuda_memory(monkeypatch):
    assert probe_chunk_elements(torch.device("cpu")) == DEFAULT_CHUNK_ELEMENTS
    gib = 1024 ** 3
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 * gib, 80 * gib))
    big = probe_chunk_elements(torch.device("cuda", 0))
    assert big == 20 * gib // 4 // 40 > DEFAULT_CHUNK_ELEMENTS  # a quarter of the free memory at 40 bytes a logit
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 * gib, 80 * gib))
    assert probe_chunk_elements(torch.device("cuda", 0)) == DEFAULT_CHUNK_ELEMENTS
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1000 * gib, 2000 * gib))
    assert probe_chunk_elements(torch.device("cuda", 0)) == 8 * DEFAULT_CHUNK_ELEMENTS


def test_a_zero3_tied_head_held_available_under_real_deepspeed(tmp_path):
    """Real DeepSpeed ZeRO-3 in one CPU process (tests/support/zero3_tied_head_worker.py): from the second step
    DeepSpeed keeps the tied head AVAILABLE after the backbone, and with embed_tokens counting it active (TRL's reason
    for its guard; that mark is the one stand-in) a gather would re-partition it on exit and DeepSpeed's free_param
    refuses. The probe leaves it alone and its log M equals that of a plain copy of the same weights. Before the F6 fix
    (a1f2fa5) this failed at step 2 with "Cannot free a ZeRO-3 parameter while it is still active in submodules". 8-22
    s: a process of its own (DeepSpeed's process group and zero.Init patches stay out of the test process)."""
    import json
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("deepspeed", reason="pip install -e '.[dev]' installs deepspeed")
    root = Path(__file__).resolve().parents[2]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_ROLLOUT_CORR_NO_VLLM": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([sys.executable, str(root / "tests" / "support" / "zero3_tied_head_worker.py"), str(out),
                           str(port)],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    result = json.loads(out.read_text())
    steps = result["steps"]
    assert [s.get("error") for s in steps] == [None, None, None], steps
    assert [s["status"] for s in steps] == ["NOT_AVAILABLE", "AVAILABLE", "AVAILABLE"]  # DeepSpeed's own tracking
    assert max(result["plain_log_mass"]) < -1e-3  # top-p 0.8 cuts real mass at every position
    for s in steps:
        torch.testing.assert_close(torch.tensor(s["log_mass"]), torch.tensor(result["plain_log_mass"]),
                                   rtol=0, atol=1e-6)
