"""The control token and the weight-sync checks without a server (the real server: tests/vllm/test_vllm.py)."""

from __future__ import annotations

import asyncio
import json
import os
import stat

import pytest

from trl_rollout_corr.vllm import security
from trl_rollout_corr.vllm.security import (TOKEN_ENV, TOKEN_HEADER, ControlTokenMiddleware, find_token,
                                            token_session_class, weight_file_prefix, weight_file_refusal, write_token)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    return tmp_path / "cache"


def test_the_token_file_is_private_and_found_in_order(cache, tmp_path, monkeypatch):
    path = write_token(8123, "from-the-server")
    assert path == cache / "trl_rollout_corr" / f"vllm-serve-{security.this_host()}-8123.token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    os.chmod(path, 0o644)
    write_token(8123, "rewritten")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == "rewritten"
    assert find_token(8123) == "rewritten"  # same machine: by the server's port
    assert find_token(9999) is None  # no server there: no token
    given = tmp_path / "token"
    given.write_text("from-a-file\n")
    assert find_token(8123, str(given)) == "from-a-file"
    monkeypatch.setenv(TOKEN_ENV, "from-the-environment")
    assert find_token(8123, str(given)) == "from-the-environment"
    given.write_text("  \n")
    monkeypatch.delenv(TOKEN_ENV)
    with pytest.raises(ValueError, match="is empty"):
        find_token(8123, str(given))


def test_only_files_written_for_this_server_may_be_loaded(tmp_path):
    sync = tmp_path / "sync"
    sync.mkdir()
    prefix = weight_file_prefix("tok")
    assert prefix.startswith("trl_rollout_corr_weights_") and "tok" not in prefix
    good = sync / f"{prefix}abc.safetensors"
    good.write_bytes(b"")
    assert weight_file_refusal(str(good), "tok", str(sync)) is None
    other = sync / f"{weight_file_prefix('another')}abc.safetensors"
    other.write_bytes(b"")
    (tmp_path / f"{prefix}x.safetensors").write_bytes(b"")
    link = sync / f"{prefix}link.safetensors"
    link.symlink_to(good)
    folder = sync / f"{prefix}dir.safetensors"
    folder.mkdir()
    cases = {
        str(other): "not written for this server",
        str(tmp_path / f"{prefix}x.safetensors"): "outside",
        str(sync / ".." / f"{prefix}x.safetensors"): "outside",
        str(link): "outside",  # resolves elsewhere
        str(folder): "not a regular file",
        str(sync / f"{prefix}abc.bin"): "not written for this server",
        "": "one path",
        None: "one path",
    }
    for path, why in cases.items():
        assert why in (weight_file_refusal(path, "tok", str(sync)) or ""), path


def run_asgi(app, path, method="GET", headers=(), body=b"", kind="http"):
    """Send one request through an ASGI app; return (status, body or close code, what the inner app received)."""
    sent, seen = [], {}

    async def inner(scope, receive, send):
        seen["path"] = scope["path"]
        if kind == "http":
            seen["body"] = (await receive())["body"]
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"inner"})

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": kind, "path": path, "method": method, "headers": [(k.lower().encode(), v.encode())
                                                                       for k, v in headers]}
    asyncio.run(_call(app, inner, scope, receive, send))
    if kind == "websocket":
        return None, sent[0].get("code") if sent else None, seen
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, data, seen


async def _call(middleware, inner, scope, receive, send):
    middleware.app = inner
    await middleware(scope, receive, send)


def test_the_middleware_guards_everything_but_health_and_generation(tmp_path, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "secret")
    monkeypatch.setenv(security.SYNC_DIR_ENV, str(tmp_path))
    app = ControlTokenMiddleware(None)
    for path in ("/health", "/ping", "/version", "/v1/completions", "/inference/v1/generate"):
        assert run_asgi(app, path)[0] == 200, path
    for path in ("/collective_rpc", "/pause", "/server_info", "/metrics", "/docs", "/v1", "/healthz"):
        status, data, seen = run_asgi(app, path, "POST")
        assert (status, json.loads(data), seen) == (401, {"error": "unauthorized"}, {}), path
        assert run_asgi(app, path, "POST", [(TOKEN_HEADER, "wrong")])[0] == 401
    assert run_asgi(app, "/pause", "POST", [(TOKEN_HEADER, "secret")])[0] == 200
    assert run_asgi(app, "/pause", "OPTIONS")[0] == 200  # CORS preflight: no endpoint runs, the real call needs it
    assert run_asgi(app, "/control", kind="websocket")[1] == 1008

    def rpc(payload):
        body = json.dumps(payload).encode()
        return run_asgi(app, "/collective_rpc", "POST", [(TOKEN_HEADER, "secret")], body)

    assert rpc({"method": "check_health"})[:2] == (403, b'{"error": "method not allowed"}')
    assert rpc({"method": "trl_rollout_corr_load_weights", "args": ["/etc/passwd"]})[0] == 403
    assert rpc({"method": "trl_rollout_corr_load_weights", "args": ["a", "b"]})[0] == 403
    good = tmp_path / f"{weight_file_prefix('secret')}w.safetensors"
    good.write_bytes(b"")
    status, _, seen = rpc({"method": "trl_rollout_corr_load_weights", "args": [str(good)]})
    assert status == 200 and json.loads(seen["body"])["args"] == [str(good)]  # the body reaches the server intact
    monkeypatch.delenv(TOKEN_ENV)
    with pytest.raises(RuntimeError, match="needs TRL_ROLLOUT_CORR_CONTROL_TOKEN"):
        ControlTokenMiddleware(None)


def test_the_trainer_sends_the_token_to_its_server_only():
    import requests

    captured = []

    class Recording(requests.Session):
        def request(self, method, url, *args, **kwargs):
            captured.append((url, dict(kwargs.get("headers") or {})))

    session = token_session_class(Recording, "secret", "http://10.0.0.5:8000/")()
    session.get("http://10.0.0.5:8000/server_info")
    session.post("http://elsewhere:8000/server_info", headers={"A": "b"})
    assert captured == [("http://10.0.0.5:8000/server_info", {TOKEN_HEADER: "secret"}),
                        ("http://elsewhere:8000/server_info", {"A": "b"})]
