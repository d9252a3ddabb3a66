"""Host synchronizations: the correction adds at most one per optimizer step to what TRL's own trainer does.

The loss is TRL's own ``_compute_loss``, which reads its metrics (entropy, clip ratios, kl, ...) with ``.item()``
per micro-batch; those syncs are TRL's and are the same in both trainers. This package's own code syncs once per
log (all rollout_corr/* metrics in one transfer), nothing per micro-batch; in the asynchronous trainer, the forward
on TRL's packed row needs the row's sizes on the host, as TRL's own compute_loss does, and nothing else syncs.
The counter (benchmarks/profiling.py) sees every blocking call Python code can make (torch.equal, .item, boolean-mask
indexing, ...): a planted one is caught.
"""

from pathlib import Path

import pytest
from trl import GRPOConfig, GRPOTrainer

from tests.grpo.test_rollout_func import build, make_rollout_func
from trl_rollout_corr.testing.toy_task import reverse_reward

from benchmarks.profiling import count_host_syncs  # a measuring tool: it patches torch.Tensor while open

STEPS = 4


def trl_syncs(trainer, tmp_path):
    """TRL's GRPOTrainer on the same model, data, rollouts and batch shape: its syncs, every caller."""
    a = trainer.args
    kwargs = dict(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=a.per_device_train_batch_size,
                  gradient_accumulation_steps=a.gradient_accumulation_steps, num_generations=a.num_generations,
                  max_completion_length=a.max_completion_length, max_steps=STEPS, learning_rate=a.learning_rate,
                  logging_steps=a.logging_steps, save_strategy="no", report_to="none", use_cpu=True, bf16=False,
                  seed=a.seed, temperature=a.temperature, dataloader_num_workers=0, loss_type=a.loss_type,
                  steps_per_generation=a.steps_per_generation, num_iterations=a.num_iterations,
                  vllm_importance_sampling_correction=False)
    theirs = GRPOTrainer(model=trainer.model, reward_funcs=reverse_reward, args=GRPOConfig(**kwargs),
                         train_dataset=trainer.train_dataset, processing_class=trainer.processing_class,
                         rollout_func=make_rollout_func())
    with count_host_syncs(everywhere=True) as syncs:
        theirs.train()
    return sum(syncs.values())


# DPPO: 4 micro-batches per optimizer step (a sync per micro-batch would count 16 over the 4 steps), thresholds low
# enough that the mask bites; decoupled over two steps per generation batch, so that pi_theta leaves pi_old and the
# policy loss masks against the pi_old forward (TRL's own trainer runs the same shape for the comparison)
MICRO_BATCHES_4 = dict(per_device_train_batch_size=2, gradient_accumulation_steps=4)
DPPO_LOW = dict(rollout_dppo_mask_low=1e-3, rollout_dppo_mask_high=1e-3)


@pytest.mark.parametrize("preset,fields", [
    ("decoupled_seq_is_rs", {}), ("pg_rs", {}), ("dppo_tv_bypass", {**MICRO_BATCHES_4, **DPPO_LOW}),
    ("decoupled_dppo_tv", {**MICRO_BATCHES_4, **DPPO_LOW, "num_iterations": 2})])
def test_at_most_one_host_sync_per_optimizer_step_over_trl(tmp_path, preset, fields):
    trainer, logs = build(tmp_path, make_rollout_func(), preset, **fields)
    trainer.args.max_steps = STEPS
    trainer.args.logging_steps = 1
    with count_host_syncs(everywhere=True) as everything:
        trainer.train()
    ours = {site: n for site, n in everything.items() if not site.startswith("ext:")}
    steps = trainer.state.global_step
    assert steps == STEPS
    assert 0 < sum(ours.values()) <= steps, dict(ours)  # the one transfer per log, nothing per micro-batch
    assert all("stats.py" in site for site in ours), dict(ours)  # e.g. no torch.equal in the forward matching
    assert sum(everything.values()) <= trl_syncs(trainer, tmp_path) + steps, dict(everything)
    if "dppo" in preset:  # the mask really acted (at the later step of each generation batch, decoupled)
        assert trainer.args.gradient_accumulation_steps * steps == 16
        assert any(log.get("rollout_corr/rollout_dppo_masked_fraction", 0) > 0 for log in logs.logs), logs.logs


def test_no_host_sync_per_micro_batch_in_the_async_trainer(tmp_path):
    """TRL's AsyncGRPOTrainer with the correction, on the stub queue (tests/support/async_stub.py): package code makes
    no host sync per micro-batch. The packed forward slices the row with sizes the collator read on the CPU (no
    boolean mask, no tolist), and the correction (layout, weights, kept count, the answered forward's check) reads
    nothing; what remains is the one transfer per log and the policy version per weight sync. TRL's compute_loss makes
    its own mask reads for its own call (ext:)."""
    from tests.support.async_stub import build_model_dir, build_trainer, make_samples

    model_dir = build_model_dir(str(tmp_path / "model"))
    samples = make_samples(model_dir, n_groups=4, noise=0.3, seed=0)
    trainer, _ = build_trainer(model_dir, samples, str(tmp_path / "run"), max_steps=3, gradient_accumulation_steps=1,
                               rollout_correction_preset="decoupled_seq_is_rs")
    tolists = package_tolists()  # the counter skips tolist of a CPU tensor: here every batch tensor is on the CPU
    with count_host_syncs(everywhere=True) as everything, tolists:
        trainer.train()
    ours = {site: n for site, n in everything.items() if not site.startswith("ext:")}
    steps = trainer.state.global_step
    per_log = {site: n for site, n in ours.items() if site.startswith("stats.py:") and " to_floats " in site}
    per_sync = {site: n for site, n in ours.items() if " _sync_weight " in site}  # the policy version, per step
    rest = {site: n for site, n in ours.items() if site not in {**per_log, **per_sync}}
    assert steps == 3 and rest == {}, rest  # nothing per micro-batch
    assert 0 < sum(per_log.values()) <= steps and sum(per_sync.values()) <= steps + 1, (per_log, per_sync)
    # the log's transfer, and the CPU stand-in for TRL's flash-attn3 kernel (trl_hooks/tree_attention.py, CPU only:
    # on a GPU TRL's kernel runs)
    assert all((site.startswith("stats.py:") and " to_floats " in site) or site.startswith("tree_attention.py:")
               for site in tolists.sites), tolists.sites
    trl_side = {site: n for site, n in everything.items() if site.startswith("ext:async_grpo_trainer.py:")
                and (" compute_loss " in site or " <dictcomp> " in site) and "__getitem__" in site}
    assert sum(trl_side.values()) >= 6 * steps, trl_side  # TRL's own: 3 reads of the row, 3 of its tree tensors


class package_tolists:  # noqa: N801 (used as a context manager)
    """Records the package's ``Tensor.tolist`` calls (of CPU tensors too) made outside the CPU collator
    (``trl_hooks/async_grpo_data.py`` and what it calls), by site as the counter names them."""

    def __init__(self) -> None:
        self.sites: dict[str, int] = {}

    def __enter__(self):
        import os
        import sys

        import torch

        import trl_rollout_corr

        package = os.path.dirname(os.path.abspath(trl_rollout_corr.__file__))
        collator = os.path.join(package, "trl_hooks", "async_grpo_data.py")
        original = self._original = torch.Tensor.tolist

        def in_collator(frame) -> bool:
            while frame is not None and frame.f_code.co_filename != collator:
                frame = frame.f_back
            return frame is not None

        def tolist(tensor, *args, **kwargs):
            frame = sys._getframe(1)
            name = frame.f_code.co_filename
            if name.startswith(package) and not in_collator(frame):
                site = f"{os.path.basename(name)}:{frame.f_lineno} {frame.f_code.co_name} tolist"
                self.sites[site] = self.sites.get(site, 0) + 1
            return original(tensor, *args, **kwargs)

        torch.Tensor.tolist = tolist
        return self

    def __exit__(self, *exc) -> None:
        import torch

        torch.Tensor.tolist = self._original


def test_the_counter_sees_a_sync_in_package_code():
    import torch

    from trl_rollout_corr.core.stats import RolloutStats

    with count_host_syncs() as syncs:
        RolloutStats(sums={"a": torch.tensor(1.0)}).to_floats()
        torch.tensor(2.0).item()  # not package code: not counted
    assert sum(syncs.values()) == 1
    with count_host_syncs(everywhere=True) as syncs:
        torch.tensor(2.0).item()
    assert sum(syncs.values()) == 1


def test_the_counter_catches_every_blocking_call_planted_in_package_code(tmp_path, monkeypatch):
    """A module inside the package's directory calls each kind of blocking operation once; each is counted once,
    with its site; the non-blocking forms (three-argument where, a boolean fill) are not."""
    import importlib.util

    import torch

    from trl_rollout_corr.core import stats

    planted = Path(stats.__file__).parent / "_planted_sync_test.py"
    planted.write_text(
        "import torch\n"
        "def run(x, mask):\n"
        "    torch.equal(x, x)\n"
        "    x.equal(x)\n"
        "    x.sum().item()\n"
        "    int(x.sum())\n"
        "    float(x.sum())\n"
        "    bool(x.sum() > 0)\n"
        "    x[mask]\n"
        "    x.nonzero()\n"
        "    torch.nonzero(x)\n"
        "    torch.where(mask)\n"
        "    x.cpu()\n"
        "    range(10)[x.sum().long()]\n"
        "    torch.where(mask, x, x)\n"
        "    y = x.clone(); y[mask] = 0.0\n")
    try:
        spec = importlib.util.spec_from_file_location("trl_rollout_corr.core._planted_sync_test", planted)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        x, mask = torch.arange(4.0), torch.tensor([True, False, True, False])
        with count_host_syncs() as syncs:
            module.run(x, mask)
    finally:
        planted.unlink()
    methods = sorted(site.split(" ", 2)[2] for site in syncs)
    assert methods == sorted(["torch.equal", "equal", "item", "__int__", "__float__", "__bool__", "__getitem__",
                              "nonzero", "torch.nonzero", "torch.where", "cpu", "__index__"]), dict(syncs)
    assert all(n == 1 for n in syncs.values()) and all(site.startswith("_planted_sync_test.py:") for site in syncs)
