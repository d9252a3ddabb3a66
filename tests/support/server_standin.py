"""A stand-in vLLM server on 127.0.0.1 for the server-path tests: the routes TRL's clients call, each answering a
fixed JSON body after an optional delay, served by uvicorn (as vLLM's own server) and optionally behind this package's
``ControlTokenMiddleware`` (as ``trl-rollout-corr vllm-serve`` / ``vllm-serve-async`` start it). Starts in well under a
second; no vLLM engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any


def server_info(dtype: str = "torch.float32", logprobs_mode: str | None = "processed_logprobs") -> dict:
    """``/server_info?config_format=json`` as vLLM 0.31 answers it (the parts TRL and this package read)."""
    model_config: dict[str, Any] = {"dtype": dtype}
    if logprobs_mode is not None:
        model_config["logprobs_mode"] = logprobs_mode
    return {"vllm_config": {"model_config": model_config}}


def vllm_routes(model: str = "my/model", **info: Any) -> dict[str, Any]:
    """Every route TRL 1.16's synchronous and asynchronous clients call, answering as vLLM does."""
    ok: dict = {}
    return {
        "/health": ok, "/v1/models": {"data": [{"id": model, "max_model_len": 64}]},
        "/server_info": server_info(**info), "/get_world_size": {"world_size": 1}, "/pause": ok, "/resume": ok,
        "/init_weight_transfer_engine": ok, "/start_weight_update": ok, "/update_weights": ok,
        "/finish_weight_update": ok, "/reset_prefix_cache": ok, "/v1/completions": {"choices": []},
    }


def _app(routes: dict[str, Any], delays: dict[str, float], seen: list):
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        seen.append((scope["method"], scope["path"], headers))
        await asyncio.sleep(delays.get(scope["path"], 0.0))
        status, body = (200, routes[scope["path"]]) if scope["path"] in routes else (404, {"detail": "Not Found"})
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})
    return app


@contextlib.contextmanager
def standin_server(routes: dict[str, Any], delays: dict[str, float] | None = None,
                   token_middleware: bool = False) -> Iterator[tuple[str, list]]:
    """Serve ``routes`` on a free port of 127.0.0.1; yields the base URL and the list of requests seen (method, path,
    headers). ``token_middleware``: behind ``ControlTokenMiddleware`` (``TRL_ROLLOUT_CORR_CONTROL_TOKEN`` set)."""
    import uvicorn

    seen: list = []
    app = _app(routes, delays or {}, seen)
    if token_middleware:
        from trl_rollout_corr.vllm.security import ControlTokenMiddleware

        app = ControlTokenMiddleware(app)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="error",
                                           timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the stand-in server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        server.should_exit = True
        thread.join(timeout=10)
