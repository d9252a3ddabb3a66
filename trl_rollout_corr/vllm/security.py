"""A token on the vLLM server's control plane, least privilege for the weight sync, and the trainer's side of it.

``trl-rollout-corr vllm-serve`` runs vLLM's OpenAI server in dev mode (as ``trl vllm-serve`` does), which exposes
endpoints that control the engine: ``/collective_rpc`` (any worker method, by name), ``/pause``, ``/resume``,
``/reset_prefix_cache``, sleep / wake, the weight-transfer endpoints, ``/server_info`` (the full engine config).
vLLM's ``--api-key`` guards only ``/v1``, ``/v2``, ``/inference`` and ``/cohere``. So:

* every path but ``/health``, ``/ping``, ``/version`` and the generation prefixes (left to ``--api-key``) needs the
  header ``X-TRL-Rollout-Corr-Token`` (:class:`ControlTokenMiddleware`, an ASGI middleware vLLM loads through
  ``--middleware``); without it, 401 with no detail;
* ``/collective_rpc`` runs only the methods this package's trainer calls (``ALLOWED_RPC_METHODS``; others: 403);
  the weight-sync method loads only a file inside the server's sync directory whose name carries this token's
  fingerprint (a file the trainer wrote for this server), checked at the HTTP layer and again in the worker;
* the token is generated at start unless given, kept in a file only the user can read (0600), one per port
  (:func:`token_path`); a trainer on the same machine reads it from there, across machines from
  ``TRL_ROLLOUT_CORR_CONTROL_TOKEN`` or ``vllm_server_control_token_file``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import tempfile
from pathlib import Path
from typing import Any

TOKEN_ENV = "TRL_ROLLOUT_CORR_CONTROL_TOKEN"
SYNC_DIR_ENV = "TRL_ROLLOUT_CORR_WEIGHT_SYNC_DIR"
TOKEN_HEADER = "X-TRL-Rollout-Corr-Token"
PUBLIC_PATHS = ("/health", "/ping", "/version")
PUBLIC_PREFIXES = ("/v1/", "/v2/", "/inference/", "/cohere/")  # vLLM's --api-key guards these
ALLOWED_RPC_METHODS = ("trl_rollout_corr_load_weights",)


def default_sync_dir() -> str:
    """Where the trainer writes weight files for a CPU server and where the server accepts them from."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def token_path(port: int) -> Path:
    """The file holding the control token of the server on ``port`` (``$XDG_CACHE_HOME/trl_rollout_corr``)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "trl_rollout_corr" / f"vllm-serve-{int(port)}.token"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def write_token(port: int, token: str) -> Path:
    """Write ``token`` to :func:`token_path` readable by this user only (directory 0700, file 0600)."""
    path = token_path(port)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token)
    os.chmod(path, 0o600)  # an existing file keeps its mode on O_CREAT: set it
    return path


def read_token_file(path: str | os.PathLike) -> str:
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"The control-token file {path} is empty.")
    return token


def find_token(port: int | None, token_file: str | None = None) -> str | None:
    """The trainer's token: ``TRL_ROLLOUT_CORR_CONTROL_TOKEN``, else ``token_file``, else the file a server on
    ``port`` of this machine wrote; None when there is none (an unprotected server needs none)."""
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    if token_file:
        return read_token_file(token_file)
    if port is not None and token_path(port).is_file():
        return read_token_file(token_path(port))
    return None


def weight_file_prefix(token: str | None) -> str:
    """File names of weight syncs start with this: a fingerprint of the token (not the token itself)."""
    if token is None:
        return "trl_rollout_corr_weights_"
    return f"trl_rollout_corr_weights_{hashlib.sha256(token.encode()).hexdigest()[:16]}_"


def weight_file_refusal(path: Any, token: str, sync_dir: str) -> str | None:
    """Why ``path`` may not be loaded as weights (None: it may): inside ``sync_dir``, a regular file (not a link),
    named with this token's fingerprint."""
    if not isinstance(path, str) or not path:
        return "the weight file must be given as one path"
    directory = os.path.realpath(sync_dir)
    name = os.path.basename(path)
    if os.path.dirname(os.path.abspath(path)) != directory or os.path.realpath(path) != os.path.join(directory, name):
        return "the weight file is outside the server's weight-sync directory"
    if not name.startswith(weight_file_prefix(token)) or not name.endswith(".safetensors"):
        return "the weight file was not written for this server"
    if os.path.islink(path) or not os.path.isfile(path):
        return "the weight file is not a regular file"
    return None


class ControlTokenMiddleware:
    """ASGI middleware (``--middleware trl_rollout_corr.vllm.security.ControlTokenMiddleware``): the control token on
    every non-generation path, the RPC allow-list, and the weight-file check. The token and the sync directory come
    from ``TRL_ROLLOUT_CORR_CONTROL_TOKEN`` and ``TRL_ROLLOUT_CORR_WEIGHT_SYNC_DIR`` (set by ``vllm-serve``)."""

    def __init__(self, app: Any) -> None:
        token = os.environ.get(TOKEN_ENV)
        if not token:
            raise RuntimeError(f"ControlTokenMiddleware needs {TOKEN_ENV}: start the server with "
                               "`trl-rollout-corr vllm-serve`, which sets it.")
        self.app = app
        self.token = token
        self.token_digest = hashlib.sha256(token.encode()).digest()
        self.sync_dir = os.environ.get(SYNC_DIR_ENV) or default_sync_dir()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES):
            return await self.app(scope, receive, send)
        if not self._authorized(scope):
            return await self._refuse(scope, send, 401, "unauthorized")
        if path != "/collective_rpc" or scope["type"] != "http":
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        why = self._rpc_refusal(body)
        if why is not None:
            return await self._refuse(scope, send, 403, why)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    def _authorized(self, scope: dict) -> bool:
        value = next((v for k, v in scope.get("headers", []) if k.decode("latin-1").lower() == TOKEN_HEADER.lower()),
                     b"")
        return hmac.compare_digest(hashlib.sha256(value).digest(), self.token_digest)

    def _rpc_refusal(self, body: bytes) -> str | None:
        try:
            request = json.loads(body or b"{}")
        except ValueError:
            return "malformed request"
        method = request.get("method") if isinstance(request, dict) else None
        if method not in ALLOWED_RPC_METHODS:
            return "method not allowed"
        args = request.get("args") or []
        if len(args) != 1 or request.get("kwargs"):
            return "unexpected arguments"
        return weight_file_refusal(args[0], self.token, self.sync_dir)

    @staticmethod
    async def _refuse(scope: dict, send: Any, status: int, reason: str) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": reason}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def token_session_class(base: type, token: str, base_url: str) -> type:
    """A ``requests.Session`` subclass that sends the control token with every request to ``base_url`` only."""
    prefix = base_url.rstrip("/")

    class TokenSession(base):
        def request(self, method, url, *args, **kwargs):  # noqa: ANN001
            if str(url).startswith(prefix):
                kwargs["headers"] = {**(kwargs.get("headers") or {}), TOKEN_HEADER: token}
            return super().request(method, url, *args, **kwargs)

    return TokenSession
