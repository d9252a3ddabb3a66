"""Multi-process training: 2-process DDP (torchrun, gloo) and DeepSpeed ZeRO-2/3 on CPU.

Each run is a real launch of tests/support/dist_worker.py; the world size is asserted from inside the run, never
trusted from launcher flags (``accelerate launch --cpu --num_processes 2`` silently starts one process).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests" / "support" / "dist_worker.py")
GLOBAL_BATCH = 16

# A token-level decoupled correction with RS, batch normalization and the veto, on the path with a pi_old forward
# per generation batch (num_iterations=2), two steps at a real learning rate. Sequence-level IS with BN and a bypass
# policy-gradient loss with geometric RS on two processes: tests/grpo/test_invariance.py (TWO_PROCESS_CASES, exact
# against one process); the seq_rs_bn and bypass_pg_geo_rs_bn cases that ran here too were cut for suite time.
CASES = {
    "token_rs_bn_veto_forward": dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token",
                                     rollout_rs_threshold=3.0, rollout_is_batch_normalize=True,
                                     rollout_token_veto_threshold=0.05),
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(cmd: list[str], out: Path, extra_env: dict | None = None) -> dict:
    # the workers run in tmp_path: put this checkout first on the path, not whatever copy is installed in the venv
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": path,
           "TRL_ROLLOUT_CORR_NO_VLLM": "1",
           **(extra_env or {})}
    proc = subprocess.run(cmd, cwd=str(out.parent), env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(f"{' '.join(cmd)} failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


def _metric_logs(result: dict) -> list[dict]:
    return [{k: v for k, v in log.items() if k.startswith("rollout_corr/") or k in ("loss", "grad_norm")}
            for log in result["logs"] if "loss" in log]


@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_log_the_same_metrics_as_one(tmp_path, case):
    # a real learning rate: step 2 runs on the weights step 1 produced, so the gradients must agree too (grad_norm)
    common = ["--correction", json.dumps(CASES[case]), "--learning_rate", "1e-3"]
    if case.endswith("_forward"):
        common += ["--num_iterations", "2"]
    one = _run([sys.executable, WORKER, str(tmp_path / "one.json"), "--per_device", str(GLOBAL_BATCH), *common],
               tmp_path / "one.json")
    two = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(_free_port()), WORKER, str(tmp_path / "two.json"), "--per_device", str(GLOBAL_BATCH // 2),
                *common], tmp_path / "two.json")
    assert one["world_size"] == 1 and two["world_size"] == 2, (one["world_size"], two["world_size"])
    assert "MULTI_CPU" in two["distributed_type"]
    logs_one, logs_two = _metric_logs(one), _metric_logs(two)
    assert len(logs_one) == len(logs_two) == 2
    assert len(logs_one[0]) >= 40 and logs_one[0].keys() == logs_two[0].keys()
    assert "rollout_corr/rollout_is_batch_norm_factor" in logs_one[0]
    assert logs_one[0]["rollout_corr/rejected_token_fraction"] > 0  # RS really acts on this data
    assert one["rollout_forward_calls"] == (1 if case.endswith("_forward") else 0)  # pi_old forwards
    assert "grad_norm" in logs_one[0]
    for step in range(2):  # every metric, the globally normalized loss and the gradient norm, same global batch
        for name, value in logs_one[step].items():
            assert logs_two[step][name] == pytest.approx(value, rel=1e-5, abs=1e-8), (step, name)


# ZeRO-3 with a stale emulated engine gathering the sharded policy and a decoupled preset's pi_old forward on sharded
# parameters (both stages through the shipped recipes, exact against one process: tests/grpo/test_invariance.py)
DEEPSPEED_CASES = [(3, "decoupled_seq_is_rs")]  # ZeRO-2 through the same recipe: tests/grpo/test_invariance.py


def _launch_deepspeed(tmp_path: Path, stage: int, worker_args: list[str], persistence_threshold: int = 0) -> dict:
    """dist_worker.py under ``accelerate launch`` with the shipped ZeRO recipe, made CPU-sized (2 processes, ZeRO-3
    sharding every parameter above ``persistence_threshold`` elements: 0 shards even the tiny ones)."""
    pytest.importorskip("deepspeed", reason="pip install -e '.[dev]' installs deepspeed")
    if shutil.which("accelerate") is None and not (Path(sys.executable).parent / "accelerate").exists():
        pytest.skip("accelerate CLI not on PATH")
    ds_config = json.loads((ROOT / "recipes" / "accelerate" / f"ds_zero{stage}.json").read_text())
    if stage == 3:
        ds_config["zero_optimization"]["stage3_param_persistence_threshold"] = persistence_threshold
    (tmp_path / "ds.json").write_text(json.dumps(ds_config))
    launch = yaml.safe_load((ROOT / "recipes" / "accelerate" / f"deepspeed_zero{stage}.yaml").read_text())
    launch["num_processes"] = 2
    launch["deepspeed_config"]["deepspeed_config_file"] = str(tmp_path / "ds.json")
    (tmp_path / "launch.yaml").write_text(yaml.safe_dump(launch))
    accelerate = str(Path(sys.executable).parent / "accelerate")
    for attempt in range(2):  # one retry with a fresh rendezvous port (a port taken between probe and bind)
        try:
            return _run([accelerate, "launch", "--config_file", str(tmp_path / "launch.yaml"), "--main_process_port",
                         str(_free_port()), WORKER, str(tmp_path / "out.json"), "--engine", "deepspeed",
                         *worker_args], tmp_path / "out.json", {"DS_ACCELERATOR": "cpu"})
        except AssertionError as error:
            if attempt == 1 or not any(s in str(error) for s in ("EADDRINUSE", "address already in use", "Connection")):
                raise
    raise AssertionError("unreachable")


@pytest.mark.parametrize("stage,preset", DEEPSPEED_CASES, ids=[f"zero{s}-{p}" for s, p in DEEPSPEED_CASES])
def test_deepspeed_zero_trains_with_two_processes(tmp_path, stage, preset):
    # decoupled with num_iterations=2 keeps the pi_old forward (with 1, pi_old = pi_theta at the loss: no forward)
    iterations = [] if preset == "ppo_is_bypass" else ["--num_iterations", "2", "--max_steps", "4"]
    result = _launch_deepspeed(tmp_path, stage, ["--rollout", "generate", "--per_device", str(GLOBAL_BATCH // 2),
                                                 "--preset", preset, *iterations])
    assert result["world_size"] == 2 and "DEEPSPEED" in result["distributed_type"]
    assert result["zero_stage"] == stage
    if stage == 3:  # parameters really partitioned: this rank holds no full tensor
        assert result["local_param_numel"] == 0 < result["full_param_numel"]
    # decoupled runs num_iterations=2: one pi_old forward per generation batch (under sharding); bypass: none
    assert result["rollout_forward_calls"] == (0 if preset == "ppo_is_bypass" else 2)
    logs = [log for log in result["logs"] if "loss" in log]
    assert len(logs) == (2 if preset == "ppo_is_bypass" else 4)
    for log in logs:
        assert math.isfinite(log["loss"]) and math.isfinite(log["grad_norm"])
        assert all(math.isfinite(log[k]) for k in log if k.startswith("rollout_corr/"))
    # with num_iterations=2 the correction's metrics arrive with each generation batch (steps 1 and 3)
    generation_logs = [log for log in logs if "rollout_corr/kl" in log]
    assert len(generation_logs) == 2 and all("rollout_corr/rollout_is_mean" in log for log in generation_logs)
    assert generation_logs[-1]["rollout_corr/kl"] != 0.0  # the stale engine (a gathered full copy) lags one step behind


def test_zero3_tied_head_under_a_truncating_sampler(tmp_path):
    """The kept-mass probe reads the LM head directly. With tied embeddings (Qwen2.5-0.5B, the recipes' model) the
    head is the embedding matrix, which ZeRO-3 can hold AVAILABLE (here: persistent, 16 x 32 = 512 elements under the
    threshold of 1000, while every layer's matrices are partitioned): TRL's guard leaves such a parameter alone."""
    result = _launch_deepspeed(tmp_path, 3, ["--rollout", "generate", "--per_device", str(GLOBAL_BATCH // 2),
                                             "--preset", "decoupled_token_is", "--tied", "--top_p", "0.8",
                                             "--num_iterations", "2", "--max_steps", "2"], persistence_threshold=1000)
    assert result["world_size"] == 2 and result["zero_stage"] == 3 and result["tied"]
    assert 0 < result["local_param_numel"] < result["full_param_numel"]  # partitioned but for the small ones
    assert result["rollout_forward_calls"] >= 1  # the pi_old forward: the probe ran on the sharded, tied head
    logs = [log for log in result["logs"] if "loss" in log]
    assert len(logs) == 2 and all(math.isfinite(log["loss"]) and math.isfinite(log["grad_norm"]) for log in logs)
    first = logs[0]
    assert 0.0 < first["rollout_corr/kept_mass_mean"] < 1.0  # top_p = 0.8 cuts real mass: the probe really ran
    assert 0.0 < first["rollout_corr/kept_mass_min"] <= first["rollout_corr/kept_mass_mean"]
