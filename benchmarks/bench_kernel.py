"""Microbenchmark of the correction itself (weights + masks + every metric) against the memory-traffic floor.

The correction is elementwise work plus reductions over (B, T): its floor is reading pi_old, pi_rollout and the mask
and writing the weights and the kept mask once, 20 bytes per token in fp32. The script measures a copy's bandwidth
on the same device (the achievable memory bandwidth) and reports each configuration as a fraction of it.

    python benchmarks/bench_kernel.py                          # CPU: B=64, T=2048
    python benchmarks/bench_kernel.py --device cuda            # GPU: B=512, T=8192 (a long-context training batch)
    python benchmarks/bench_kernel.py --compile                # also torch.compile the core
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from trl_rollout_corr.core import compute_rollout_correction_stats

CONFIGS = {
    "token_is": dict(rollout_is="token", rollout_is_threshold=2.0),
    "seq_is_rs": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="sequence", rollout_rs_threshold=2.0),
    "all_on": dict(rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True, rollout_rs="token",
                   rollout_rs_threshold=2.0, rollout_token_veto_threshold=1e-4,
                   rollout_rs_criteria="seq_mean_k3,seq_max_k2", rollout_rs_criteria_threshold="0.01,0.5"),
}
FLOOR_BYTES_PER_TOKEN = 4 * 5  # read old, rollout, mask; write weights, kept mask (fp32)


def timed(fn, device, repeats):
    for _ in range(2):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--compile", action="store_true")
    opts = parser.parse_args()
    device = torch.device(opts.device)
    B = opts.batch or (512 if device.type == "cuda" else 64)
    T = opts.tokens or (8192 if device.type == "cuda" else 2048)
    g = torch.Generator(device="cpu").manual_seed(0)
    old = (-torch.rand(B, T, generator=g) * 3).to(device)  # (B, T)
    rollout = (old + 0.05 * torch.randn(B, T, generator=g).to(device)).clamp(max=0)  # (B, T)
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g).to(device)
    mask = (torch.arange(T, device=device)[None, :] < lengths[:, None]).float()  # (B, T)

    big = torch.empty(64 * 2 ** 20, device=device)  # 256 MB
    copy_t = timed(lambda: big.clone(), device, opts.repeats)
    bandwidth = 2 * big.numel() * 4 / copy_t  # read + write
    floor_t = FLOOR_BYTES_PER_TOKEN * B * T / bandwidth
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU x{torch.get_num_threads()} threads"
    print(f"device {name}; B={B}, T={T}; measured copy bandwidth {bandwidth / 1e9:.1f} GB/s; "
          f"floor ({FLOOR_BYTES_PER_TOKEN} B/token) {floor_t * 1e3:.2f} ms\n")
    print("| config | mode | ms / call | fraction of bandwidth floor |")
    print("|---|---|---|---|")
    for config_name, kwargs in CONFIGS.items():
        modes = [("eager", compute_rollout_correction_stats)]
        if opts.compile:
            modes.append(("compiled", torch.compile(compute_rollout_correction_stats, dynamic=False)))
        reference = compute_rollout_correction_stats(old, rollout, mask, **kwargs)
        for mode, fn in modes:
            if mode == "compiled":  # the eager path is the reference: same weights, mask and statistics
                got = fn(old, rollout, mask, **kwargs)
                assert torch.equal(got.modified_response_mask, reference.modified_response_mask)
                if reference.is_weights is not None:
                    assert torch.allclose(got.is_weights, reference.is_weights, rtol=1e-5, atol=1e-6)
                want, have = reference.stats.to_floats(), got.stats.to_floats()
                assert want.keys() == have.keys() and all(
                    abs(want[k] - have[k]) <= 1e-5 * max(1.0, abs(want[k])) for k in want), config_name
            run = functools.partial(compute_rollout_correction_stats if mode == "eager" else fn, old, rollout, mask,
                                    **kwargs)
            t = timed(run, device, opts.repeats)
            print(f"| {config_name} | {mode} | {t * 1e3:.2f} | {floor_t / t:.2f} |")


if __name__ == "__main__":
    main()
