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


def send_token_from_trl_client(base_url: str, token: str | None) -> None:
    """TRL's asynchronous ``VLLMClient`` (``/server_info``, ``/pause``, the NCCL weight-transfer endpoints, ...) sends
    no headers: from now on its requests to ``base_url`` carry the control token of a ``trl-rollout-corr
    vllm-serve-async`` server, and a 401 raises naming the token and where to put it (with no token as well)."""
    from ..trl_hooks.vllm import route_async_client_requests
    from ..vllm.security import with_token

    prefix = base_url.rstrip("/")

    def route(method, url, kwargs, send):  # noqa: ANN001
        return with_token(method, url, token, prefix, kwargs, send)

    route_async_client_requests(prefix, route)


def check_server_info(base_url: str, token: str | None) -> bool:
    """Check what the server at ``base_url`` reports in ``/server_info``: its log-probs must be those of the
    distribution it samples from (``--logprobs-mode processed_logprobs``), and a 401 names the control token. False
    when the server does not answer yet (checked again at the first weight sync), True once checked."""
    import requests

    from ..vllm.engine import require_processed_logprobs
    from ..vllm.security import ControlTokenRefused, TOKEN_HEADER, refusal_message

    url = base_url.rstrip("/")
    try:
        response = requests.get(f"{url}/server_info", params={"config_format": "json"}, timeout=30,
                                headers={TOKEN_HEADER: token} if token else {})
    except requests.RequestException:
        return False
    if response.status_code == 401:
        raise ControlTokenRefused(refusal_message(url, "/server_info", token is not None))
    if response.status_code != 200:  # no dev mode (404): TRL's own error says what to do
        return True
    try:
        model_config = response.json()["vllm_config"]["model_config"]
    except (ValueError, KeyError, TypeError):  # not vLLM's answer: TRL's own errors apply
        return True
    require_processed_logprobs(model_config, url)
    return True
