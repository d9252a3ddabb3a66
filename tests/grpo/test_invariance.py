"""Exact in every shape: one optimizer step does not depend on how its generation batch is split.

A generation batch of 8 samples runs as 8x1, 2x4 and 1x8 (per_device_train_batch_size x gradient_accumulation_steps,
steps_per_generation = gradient_accumulation_steps as in TRL's default). One plain SGD step (lr 0.5, no clipping) must
give the same parameter update (relative difference <= 1e-5) and the same rollout_corr/* metrics, for every option
whose statistics span the generation batch: IS batch normalization (token / sequence), RS and the veto with the
kept-token normalizer of dapo / cispo / vespo, in decoupled and in bypass mode, with non-finite and missing rollout
log-probs. The sampler is a fixed mismatched engine (a ``rollout_func``): the policy's own log-probs plus seeded
noise, so the same samples and the same pi_rollout reach every split.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from datasets import Dataset

from tests.support.trainer_utils import LogCollector, count_policy_forwards, tiny_model_dir
from trl_rollout_corr import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer
from trl_rollout_corr.testing.toy_task import build_model, build_tokenizer, reverse_prompts, reverse_reward

TOK = build_tokenizer()
SPLITS = [(8, 1), (2, 4), (1, 8)]  # (per_device_train_batch_size, gradient_accumulation_steps)
ROWS = {"prompt": reverse_prompts(64, n_digits=4)}


def mismatched_engine(noise=0.4, nan_every=0, missing_every=0):
    """rollout_func: seeded completions; pi_rollout = the initial policy's log-prob + seeded noise (a fixed engine).

    The engine is its own copy of the initial tiny model (``build_model(hidden_size=32)``, the policy every test here
    starts from), so it never touches the trainer's (possibly sharded) parameters. ``nan_every``: every k-th sample
    gets one token the engine could not score (None); ``missing_every``: every k-th sample comes without log-probs.
    """
    engine = []

    def rollout_func(prompts, trainer):
        seen: dict[str, int] = {}
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        if not engine:
            engine.append(build_model(hidden_size=32).eval())
        model = engine[0]
        for prompt in prompts:
            copy_index = seen.get(prompt, 0)
            seen[prompt] = copy_index + 1
            gen = torch.Generator().manual_seed(zlib.crc32(f"{prompt}|{copy_index}".encode()))
            length = int(torch.randint(2, 7, (1,), generator=gen))
            ids = torch.randint(4, 14, (length,), generator=gen).tolist()
            prompt_ids = TOK(prompt)["input_ids"]
            with torch.no_grad():
                logits = model(torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1:-1].double()
            policy = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)  # (S,)
            lps = (policy + noise * torch.randn(length, generator=gen, dtype=torch.float64)).clamp(max=-1e-4).tolist()
            key = zlib.crc32(f"{prompt}|{copy_index}|k".encode())
            if nan_every and key % nan_every == 0:
                lps[length // 2] = None
            if missing_every and key % missing_every == 1:
                lps = None
            out["prompt_ids"].append(prompt_ids)
            out["completion_ids"].append(ids)
            out["logprobs"].append(lps)
        return out
    return rollout_func


CASES = {
    "disabled": dict(preset="disabled"),
    "seq_is_bn": dict(preset="decoupled_seq_is", rollout_is_batch_normalize=True),
    "token_is_bn": dict(preset="decoupled_token_is", rollout_is_batch_normalize=True),
    "token_is_token_rs_dapo": dict(preset="decoupled_token_is", rollout_rs="token", rollout_rs_threshold=2.0),
    "geo_rs_veto_dapo": dict(preset="decoupled_geo_rs", rollout_rs_threshold=1.25, rollout_rs_threshold_lower=0.8,
                             rollout_token_veto_threshold=0.3),
    "token_is_bn_token_rs_cispo": dict(preset="decoupled_token_is", rollout_is_batch_normalize=True,
                                       rollout_rs="token", rollout_rs_threshold=2.0, loss_type="cispo"),
    "token_is_seq_rs_vespo": dict(preset="decoupled_token_is", rollout_rs="sequence", rollout_rs_threshold=3.0,
                                  loss_type="vespo"),
    "gspo_seq_is_bn": dict(preset="decoupled_seq_is", rollout_is_batch_normalize=True,
                           importance_sampling_level="sequence", loss_type="grpo"),
    "divergence_rs_dapo_beta": dict(preset="decoupled_token_is", rollout_rs_criteria="token_k3",
                                    rollout_rs_criteria_threshold="0.05", beta=0.05),
    "nan_rollout_dapo": dict(preset="decoupled_token_is", engine=dict(nan_every=3)),
    "missing_rollout_bn_rs": dict(preset="decoupled_token_is", rollout_is_batch_normalize=True, rollout_rs="token",
                                  rollout_rs_threshold=2.0, engine=dict(missing_every=4)),
    "bypass_pg_rs_dapo": dict(preset="pg_rs", rollout_rs_threshold=1.25, rollout_rs_threshold_lower=0.8,
                              rollout_token_veto_threshold=0.3),
    "bypass_pg_is_bn": dict(preset="pg_is", rollout_is_batch_normalize=True),
    "bypass_ppo_token_rs_dapo": dict(preset="ppo_is_bypass", rollout_rs="token", rollout_rs_threshold=2.0),
    "trl_default_dapo": dict(preset="trl_default"),
    "token_mask_two_sided_bn": dict(preset="trl_default", rollout_is="token", rollout_is_threshold=2.0,
                                    rollout_is_threshold_lower=0.5, rollout_is_batch_normalize=True),
    "second_moment_mask_grpo": dict(preset="decoupled_token_is", rollout_m2_threshold=0.02, loss_type="grpo"),
    "icepop_dapo": dict(preset="icepop", rollout_is_threshold=1.5, rollout_is_threshold_lower=0.7),
    "m2po_trust_region_dapo": dict(preset="m2po", rollout_m2_threshold=0.02),
    "m2po_trust_region_token_is_grpo": dict(preset="m2po", rollout_is="token", rollout_m2_threshold=0.02,
                                            loss_type="grpo"),
    "seq_rs_out_of_baseline_dapo": dict(preset="decoupled_seq_is_rs", rollout_rs_threshold=3.0,
                                        rollout_rs_threshold_lower=0.5, rollout_rs_exclude_from_baseline=True),
    "dppo_tv_bypass_dapo": dict(preset="dppo_tv_bypass", rollout_dppo_mask_low=0.01, rollout_dppo_mask_high=0.01,
                                rollout_is_threshold=1.5),  # also over two processes (TWO_PROCESS_CASES)
    # two optimizer steps on one generation batch (num_iterations=2): at the second pi_theta has left pi_old, so the
    # DPPO mask (pi_theta vs pi_old) fires; the update compared is both steps', the metrics the second step's (the
    # first step is the one-step decoupled case: pi_old = pi_theta, nothing masked); also over two processes
    "decoupled_dppo_tv_two_steps_dapo": dict(preset="decoupled_dppo_tv", rollout_dppo_mask_low=0.01,
                                             rollout_dppo_mask_high=0.01, rollout_dppo_clip_ratio_c=1.5,
                                             num_iterations=2, max_steps=2),
    "decoupled_dppo_kl_grpo": dict(preset="decoupled_dppo_kl", rollout_dppo_mask_low=0.002,
                                   rollout_dppo_mask_high=0.002, loss_type="grpo"),
}


def flat_parameters(trainer) -> torch.Tensor:
    """All parameters as one flat float32 vector (gathered from their shards under DeepSpeed ZeRO-3, FSDP2, FSDP1)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    if isinstance(trainer.model, FSDP1):  # FSDP1: the original parameters, unsharded for the read
        with FSDP1.summon_full_params(trainer.model, writeback=False):
            return torch.cat([p.detach().flatten().clone() for p in trainer.model.parameters()])
    params = list(trainer.model.parameters())
    if any(hasattr(p, "full_tensor") for p in params):  # FSDP2: DTensor shards
        return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().clone()
                          for p in params])
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return torch.cat([p.detach().flatten().clone() for p in params])
    return torch.cat([p.detach().flatten().clone() for p in params])


def one_sgd_step(out_dir, per_device, accumulation, model=None, preset=None, engine=None, **overrides):
    """Parameters before and after one real ``train()`` step, the logs, and the policy's no-grad forwards.

    Plain SGD, no clipping (``max_grad_norm`` so large it never clips, so that ``grad_norm`` is still logged). A case
    may ask for more steps (``max_steps``): then the update is all of them, the log the last step's, with an earlier
    step's rollout_corr/* metrics in it as ``name@step<n>`` (with two optimizer steps per generation batch the
    generation's metrics are logged at its first step, the policy loss's at each).
    """
    args = RolloutCorrGRPOConfig(**{
        "output_dir": str(out_dir), "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": accumulation, "num_generations": 4, "max_completion_length": 6,
        "max_steps": 1, "learning_rate": 0.5, "optim": "sgd", "lr_scheduler_type": "constant",
        "max_grad_norm": 1e9, "logging_steps": 1, "save_strategy": "no", "report_to": "none", "use_cpu": True,
        "bf16": False, "seed": 0, "dataloader_num_workers": 0, "rollout_correction_preset": preset, **overrides})
    collector = LogCollector()
    trainer = RolloutCorrGRPOTrainer(
        model=model or build_model(hidden_size=32), reward_funcs=reverse_reward, args=args,
        train_dataset=Dataset.from_dict(ROWS), processing_class=TOK, rollout_func=mismatched_engine(**(engine or {})),
        callbacks=[collector])
    forwards = count_policy_forwards(trainer.model)
    before = flat_parameters(trainer)
    trainer.train()
    after = flat_parameters(trainer)
    logs = [entry for entry in collector.logs if "loss" in entry]
    log = dict(logs[-1])
    for n, entry in enumerate(logs[:-1], 1):
        log.update({f"{k}@step{n}": v for k, v in entry.items() if k.startswith("rollout_corr/")})
    return trainer, after - before, log, forwards["no_grad"]


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / a.double().norm()).item()


@pytest.mark.parametrize("case", list(CASES))
def test_one_step_is_the_same_for_every_split(tmp_path_factory, case):
    overrides = dict(CASES[case])
    model = tiny_model_dir(tmp_path_factory.mktemp("model")) if overrides.get("beta") else None
    runs = {}
    for per_device, accumulation in SPLITS:
        runs[(per_device, accumulation)] = one_sgd_step(tmp_path_factory.mktemp(case), per_device, accumulation,
                                                        model=model, **overrides)
    (base_trainer, base_update, base_log, _) = runs[SPLITS[0]]
    assert base_update.abs().max() > 1e-4  # the step really moves the policy
    metrics = {k: v for k, v in base_log.items() if k.startswith("rollout_corr/")}
    assert len(metrics) >= 20
    for split, (trainer, update, log, no_grad_forwards) in runs.items():
        assert relative_difference(base_update, update) <= 1e-5, (split, relative_difference(base_update, update))
        for name, value in metrics.items():
            if not name.startswith("rollout_corr/all_rejected_micro_batches"):  # micro-batches: split by definition
                assert log[name] == pytest.approx(value, rel=1e-5, abs=1e-7), (split, name)
        # the pi_old forward runs only where pi_theta detached cannot give the generation batch's statistics
        plan = trainer.correction_plan
        assert no_grad_forwards == (split[1] if plan.at_generation else 0), split  # 8 rows in chunks of per_device
        # (in decoupled mode a generation batch feeding two optimizer steps needs pi_old from a forward in any split)
        several_steps = overrides.get("num_iterations", 1) > 1 and not trainer.rollout_correction.bypass_mode
        assert plan.at_generation == (several_steps or bool(plan.batch_scope) and (
            split[1] > 1 or "baseline" in case)), (split, plan)
    if "rs" in case or "veto" in case:
        assert 0 < metrics["rollout_corr/rejected_token_fraction"] < 1, metrics  # the masks really act
    if "nan" in case:
        assert metrics["rollout_corr/invalid_logprob_fraction"] > 0
    if "missing" in case:
        assert 0 < metrics["rollout_corr/missing_rollout_logprobs_fraction"] < 1
    if "bn" in case:
        assert not math.isclose(metrics["rollout_corr/rollout_is_batch_norm_factor"], 1.0, abs_tol=1e-3)
    if "icepop" in case:  # weights zeroed, nothing rejected (the tokens stay in the count)
        assert metrics["rollout_corr/rollout_is_masked_fraction"] > 0
        assert metrics["rollout_corr/rejected_token_fraction"] == 0
    if "baseline" in case:  # some samples, not all, left out of their group's baseline
        assert 0 < metrics["rollout_corr/rollout_rs_baseline_excluded_fraction"] < 1
    if "dppo" in case:  # the mask bites, not everywhere; in decoupled mode only once pi_theta has left pi_old
        fires = base_trainer.rollout_correction.bypass_mode or overrides.get("num_iterations", 1) > 1
        masked = metrics["rollout_corr/rollout_dppo_masked_fraction"]
        assert 0 < masked < 1 if fires else masked == 0, metrics
        if overrides.get("num_iterations", 1) > 1 and not base_trainer.rollout_correction.bypass_mode:
            assert metrics["rollout_corr/rollout_dppo_masked_fraction@step1"] == 0  # pi_theta = pi_old there
    if "m2po" in case:  # advantages zeroed on the trust region's active side, nothing rejected
        assert 0 < metrics["rollout_corr/rollout_m2_masked_fraction"] < metrics[
            "rollout_corr/rollout_m2_trust_region_fraction"]
        assert metrics["rollout_corr/rejected_token_fraction"] == 0


TWO_PROCESS_CASES = ["seq_is_bn", "token_is_token_rs_dapo", "geo_rs_veto_dapo", "bypass_pg_rs_dapo",
                     "missing_rollout_bn_rs", "token_mask_two_sided_bn", "second_moment_mask_grpo",
                     "m2po_trust_region_token_is_grpo", "seq_rs_out_of_baseline_dapo", "dppo_tv_bypass_dapo",
                     "decoupled_dppo_tv_two_steps_dapo"]
# where the correction is computed at 4x1, 2x2, 1x4 per process: at generation time where a generation-batch statistic
# spans micro-batches (the default), in every split where it shapes the baselines or pi_old needs a forward (a batch
# feeding two optimizer steps, decoupled), in none for a per-token mask in the loss (bypass DPPO)
AT_GENERATION = {"seq_rs_out_of_baseline_dapo": [True] * 3, "decoupled_dppo_tv_two_steps_dapo": [True] * 3,
                 "dppo_tv_bypass_dapo": [False] * 3}


def run_worker(tmp_path, launcher: list[str], args: list[str], extra_env: dict | None = None) -> dict:
    import os
    import subprocess
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    out = tmp_path / "out.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "TRL_ROLLOUT_CORR_NO_VLLM": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(tests.parent), os.environ.get("PYTHONPATH", "")) if p),
           **(extra_env or {})}
    cmd = [*launcher, str(tests / "support" / "invariance_worker.py"), str(out), *args]
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and out.exists(), f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return torch.load(out)


def assert_same_step(case, tmp_path, runs):
    """Each recorded run (any world size, split or engine) equals the one-process 8x1 step of ``case``."""
    _, base_update, base_log, _ = one_sgd_step(tmp_path / case, 8, 1, disable_tqdm=True, **CASES[case])
    base = {k: v for k, v in base_log.items() if k.startswith("rollout_corr/")}
    for split, run in runs.items():
        assert run["world_size"] == 2
        assert relative_difference(base_update, run["update"]) <= 1e-5, (case, split)
        assert run["grad_norm"] == pytest.approx(base_log["grad_norm"], rel=1e-5), (case, split)
        for name, value in base.items():
            if not name.startswith("rollout_corr/all_rejected_micro_batches"):
                assert run["metrics"][name] == pytest.approx(value, rel=1e-5, abs=1e-7), (case, split, name)


def test_two_processes_give_the_one_process_step(tmp_path):
    """The same global generation batch of 8 over two gloo processes, split 4x1, 2x2 and 1x4 per process. DPPO
    (issue 55) in both modes: bypass (the mask against pi_rollout in the loss) and decoupled over two optimizer steps on
    the generation batch, so that pi_theta has left pi_old at the second and the mask fires (the update both steps',
    the metrics the second step's and the first's as name@step1)."""
    import sys

    from tests.grpo.test_distributed import _free_port

    results = run_worker(tmp_path, [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                    "--master_port", str(_free_port())], ["--cases", ",".join(TWO_PROCESS_CASES)])
    for case in TWO_PROCESS_CASES:
        assert set(results[case]) == {"4x1", "2x2", "1x4"}
        assert all("MULTI_CPU" in run["distributed_type"] for run in results[case].values())
        assert [results[case][s]["at_generation"] for s in ("4x1", "2x2", "1x4")] == AT_GENERATION.get(
            case, [False, True, True])
        if "dppo" in case:  # the mask bites in every split
            assert all(run["metrics"]["rollout_corr/rollout_dppo_masked_fraction"] > 0
                       for run in results[case].values())
        assert_same_step(case, tmp_path, results[case])


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_gives_the_one_process_step(tmp_path, stage):
    """ZeRO-2 and ZeRO-3 (parameters really sharded) on two processes: the update, grad_norm and metrics of one."""
    import json
    import sys
    from pathlib import Path

    import yaml

    pytest.importorskip("deepspeed", reason="pip install -e '.[dev]' installs deepspeed")
    from tests.grpo.test_distributed import _free_port

    root = Path(__file__).resolve().parents[2]
    ds_config = json.loads((root / "recipes" / "accelerate" / f"ds_zero{stage}.json").read_text())
    if stage == 3:
        ds_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    (tmp_path / "ds.json").write_text(json.dumps(ds_config))
    launch = yaml.safe_load((root / "recipes" / "accelerate" / f"deepspeed_zero{stage}.yaml").read_text())
    launch.update(num_processes=2)
    launch["deepspeed_config"]["deepspeed_config_file"] = str(tmp_path / "ds.json")
    (tmp_path / "launch.yaml").write_text(yaml.safe_dump(launch))
    accelerate = str(Path(sys.executable).parent / "accelerate")
    case = "token_is_token_rs_dapo"
    results = run_worker(tmp_path, [accelerate, "launch", "--config_file", str(tmp_path / "launch.yaml"),
                                    "--main_process_port", str(_free_port())],
                         ["--cases", case, "--splits", "4x1,2x2", "--engine", "deepspeed"], {"DS_ACCELERATOR": "cpu"})
    assert all("DEEPSPEED" in run["distributed_type"] for run in results[case].values())
    assert_same_step(case, tmp_path, results[case])


def test_the_fsdp2_recipe_is_trl_s():
    """recipes/accelerate/fsdp2.yaml is the FSDP2 config TRL 1.16 ships (values; comments aside)."""
    from pathlib import Path

    import trl
    import yaml

    ours = yaml.safe_load((Path(__file__).resolve().parents[2] / "recipes" / "accelerate" / "fsdp2.yaml").read_text())
    theirs = yaml.safe_load((Path(trl.__file__).parent / "accelerate_configs" / "fsdp2.yaml").read_text())
    assert ours == theirs


FSDP_PROBE = """
from accelerate import Accelerator
accelerator = Accelerator(cpu=True)
print(f"TYPE {accelerator.distributed_type.name} {accelerator.num_processes}", flush=True)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU limit: with CUDA, accelerate runs FSDP")
def test_accelerate_leaves_fsdp_off_on_a_cpu(tmp_path):
    """The documented limit, tested: two CPU processes launched with accelerate's FSDP2 settings (the environment
    `accelerate launch --config_file recipes/accelerate/fsdp2.yaml` sets) run as MULTI_CPU without FSDP. (Without
    `use_cpu` they run as two separate DistributedType.NO processes, measured.) When this fails, accelerate runs FSDP
    on a CPU itself: the test-only shim tests/support/fsdp_cpu.py (which tests/grpo/test_fsdp.py applies) can go."""
    import os
    import subprocess
    import sys

    from tests.grpo.test_distributed import _free_port

    script = tmp_path / "probe.py"
    script.write_text(FSDP_PROBE)
    env = {**os.environ, "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "OMP_NUM_THREADS": "1",
           "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}  # as torchrun sets
    ranks = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outputs = [proc.communicate(timeout=300)[0] for proc in ranks]
    types = sorted(line for out in outputs for line in out.splitlines() if line.startswith("TYPE"))
    assert types == ["TYPE MULTI_CPU 2"] * 2, [out[-2000:] for out in outputs]
