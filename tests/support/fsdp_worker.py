"""Every FSDP case of tests/grpo/test_fsdp.py in one process group: launched once per FSDP version by
``accelerate launch --config_file tests/data/fsdp{1,2}_cpu.yaml fsdp_worker.py OUT.pt --model DIR --modes a,b``.

Applies the test-only shim (tests/support/fsdp_cpu.py: accelerate's FSDP for a MULTI_CPU state) before any
Accelerator exists, then for each mode runs one real ``train()`` step (``one_sgd_step`` of the invariance suite at the
mode's split), then the two-step checkpoint / resume / save_model run, and (``--async_model``) the asynchronous
trainer. Rank 0 saves
{"modes": {mode: {update, grad_norm, metrics, distributed_type, fsdp_version, sharded, ref_sharded, world_size,
no_grad_forwards}}, "checkpoint": {...}}.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

import torch

if not __package__:  # run as a script (a test's subprocess): the repo root on sys.path, for the tests.* imports
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.support import fsdp_cpu  # noqa: E402
from tests.support.worker_exit import end_worker  # noqa: E402


def reference_vs_file(ref, model_dir: str) -> float:
    """max |reference model weight - the saved model's| over all parameters, gathered from the shards (a
    collective: every rank calls it)."""
    from safetensors.torch import load_file
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    saved = load_file(os.path.join(model_dir, "model.safetensors"))
    context = FSDP1.summon_full_params(ref, writeback=False) if isinstance(ref, FSDP1) else contextlib.nullcontext()
    worst = 0.0
    with context:
        for name, param in ref.named_parameters():
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            key = name.replace("_fsdp_wrapped_module.", "")
            worst = max(worst, (full.detach().float() - saved[key].float()).abs().max().item())
    return worst


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--model", required=True, help="a saved tiny model (the beta > 0 case loads it by path)")
    parser.add_argument("--modes", required=True)
    parser.add_argument("--workdir", required=True, help="output directories, shared by the ranks (checkpoints)")
    parser.add_argument("--async_model", default=None, help="a tiny model of tests/support/async_stub.py: then the "
                        "asynchronous trainer runs too (FSDP2)")
    opts = parser.parse_args()
    fsdp_cpu.apply()  # before any Accelerator: the Trainer builds one in its __init__

    from tests.grpo.test_fsdp import FSDP_CASES, FULL_LOADING, KNOWN_BUG, async_run, case_kwargs, two_step_run
    from tests.grpo.test_invariance import one_sgd_step
    from trl_rollout_corr.cli.probe import SourceRescorer

    root = Path(opts.workdir)
    results: dict = {"modes": {}}
    if os.environ.get("FSDP_VERSION") == "2" and os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING") == "true":
        # TRL 1.16 + FSDP2 + cpu_ram_efficient_loading + beta > 0: transformers loads zeros on rank > 0 (to be
        # broadcast from rank 0, modeling_utils.py), accelerate broadcasts into the policy, TRL's prepare_fsdp
        # shards the reference model without a broadcast: rank 1's shards of the reference stay zero
        trainer, *_ = one_sgd_step(root / KNOWN_BUG, 4, 1, disable_tqdm=True,
                                   **case_kwargs("reference_model", opts.model))
        results[KNOWN_BUG] = reference_vs_file(trainer.ref_model, opts.model)
        del trainer
    for mode in opts.modes.split(","):
        split = FSDP_CASES[mode][1]
        per_device, accumulation = (int(x) for x in split.split("x"))
        saved_env = dict(os.environ)
        if mode in FULL_LOADING:
            os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false"
        try:
            trainer, update, log, forwards = one_sgd_step(root / mode, per_device, accumulation, disable_tqdm=True,
                                                          **case_kwargs(mode, opts.model))
        finally:
            os.environ.clear()
            os.environ.update(saved_env)
        state = trainer.accelerator.state
        ref = getattr(trainer, "ref_model", None)
        results["modes"][mode] = {
            "update": update, "grad_norm": log["grad_norm"], "world_size": trainer.accelerator.num_processes,
            "metrics": {k: v for k, v in log.items() if k.startswith("rollout_corr/")},
            "distributed_type": state.distributed_type.name, "no_grad_forwards": forwards,
            "fsdp_version": getattr(getattr(state, "fsdp_plugin", None), "fsdp_version", None),
            "sharded": fsdp_cpu.parameters_are_sharded(trainer.model),
            "ref_sharded": None if ref is None else fsdp_cpu.parameters_are_sharded(ref),
            "ref_vs_file": None if ref is None else reference_vs_file(ref, opts.model),
            # the probe's precision split must see the sharding (no copy of a shard): its note says why
            "probe_precision_note": SourceRescorer(trainer, "bfloat16").precision_note}
        del trainer
    results["checkpoint"] = two_step_run(root / "checkpoint")
    if opts.async_model:
        results["async"] = async_run(opts.async_model, root / "async", 4)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(results, opts.out)
    end_worker()


if __name__ == "__main__":
    main()
