"""The truncated-support probe's cost at a real vocabulary: ms and peak memory of the probe's work per token
(projection + top-k/top-p/min-p kept mass, ``rollout/support.py`` / ``core/truncation.py``) against TRL 1.16's fused
LM head forward (its log-probs over the same tokens), each case in a fresh process.

    python benchmarks/probe_cost.py [--tokens 256] [--hidden 896] [--vocab 151936] [--device cpu]

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` above the inputs; on the CPU the process's peak resident
set (``ru_maxrss``) above its level once the inputs exist (a coarse measure: it includes allocator slack).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

CASES = {
    "trl_fused_head": None,
    "probe_top_p": dict(top_p=0.9),
    "probe_top_k": dict(top_k=50),
    "probe_min_p": dict(min_p=0.1),
    "probe_top_k_top_p": dict(top_k=50, top_p=0.9),
}


def run_case(name: str, tokens: int, hidden: int, vocab: int, device: str, repeats: int) -> dict:
    import torch

    from trl_rollout_corr.core.truncation import SamplingTruncation, log_kept_mass
    from trl_rollout_corr.rollout.support import probe_chunk_elements

    torch.manual_seed(0)
    dev = torch.device(device)
    h = torch.randn(tokens, hidden, device=dev)  # (N, H)
    w = torch.randn(vocab, hidden, device=dev) * hidden ** -0.5 * 4  # (V, H) logits of a few units
    targets = torch.randint(0, vocab, (tokens,), device=dev)  # (N,)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    if CASES[name] is None:
        from trl.kernels import ChunkedLogProbFunction

        def work():
            with torch.no_grad():
                return ChunkedLogProbFunction.apply(h, w, None, targets, 1.0, 32768, None, 1.0, ("log_probs",))
    else:
        truncation = SamplingTruncation(temperature=1.0, **CASES[name])
        chunk = probe_chunk_elements(dev)

        def work():  # the probe's loop (support.py): project a chunk of rows, then its kept mass
            rows = max(1, chunk // vocab)
            out = []
            with torch.no_grad():
                for start in range(0, tokens, rows):
                    logits = (h[start:start + rows] @ w.t()).float()  # (n, V)
                    out.append(log_kept_mass(logits, targets[start:start + rows], truncation, chunk)[0])
            return torch.cat(out)

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"case": name, "ms_min": 1e3 * min(times), "ms_median": 1e3 * sorted(times)[len(times) // 2],
            "peak_mib": peak / 2 ** 20, "tokens": tokens, "hidden": hidden, "vocab": vocab, "device": device}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one case, in this process
    opts = parser.parse_args()
    if opts.case:
        print(json.dumps(run_case(opts.case, opts.tokens, opts.hidden, opts.vocab, opts.device, opts.repeats)))
        return
    for name in CASES:
        cmd = [sys.executable, __file__, "--case", name, "--tokens", str(opts.tokens), "--hidden", str(opts.hidden),
               "--vocab", str(opts.vocab), "--device", opts.device, "--repeats", str(opts.repeats)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        row = json.loads(out)
        print(f"{row['case']:>20}: {row['ms_min']:9.1f} ms (min of {opts.repeats}), peak +{row['peak_mib']:7.0f} MiB  "
              f"N={row['tokens']} H={row['hidden']} V={row['vocab']} {row['device']}")


if __name__ == "__main__":
    main()
