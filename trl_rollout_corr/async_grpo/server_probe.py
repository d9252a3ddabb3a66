"""The vLLM server probe the async trainer runs while it waits for samples.

TRL's dataset and collator carry every sample's policy version through
:func:`trl_rollout_corr.trl_hooks.async_grpo_data.carrying_sample_versions`, which calls :meth:`ServerProbe.probe`
while the rollout queue is empty.
"""

from __future__ import annotations

import time


class ServerProbe:
    """``probe()`` raises once the server at ``base_url`` has not answered ``/health`` for ``timeout_s`` seconds."""

    def __init__(self, base_url: str, timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._last_ok = time.monotonic()

    def probe(self) -> None:
        import requests

        try:
            ok = requests.get(f"{self.base_url}/health", timeout=min(5.0, self.timeout_s)).status_code == 200
        except requests.RequestException:
            ok = False
        now = time.monotonic()
        if ok:
            self._last_ok = now
        elif now - self._last_ok >= self.timeout_s:
            raise RuntimeError(
                f"The vLLM server at {self.base_url} has not answered for {now - self._last_ok:.0f} s while the "
                "trainer waited for samples: it stopped or is unreachable. Restart it (trl-rollout-corr "
                "vllm-serve-async MODEL ...) and resume from the last checkpoint.")
