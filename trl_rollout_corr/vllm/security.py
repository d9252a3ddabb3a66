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
* the token is generated at start unless given, kept in a file only the user can read (0600), one per host and port
  (:func:`token_path`: two servers on the same port of two machines sharing ``$HOME`` keep their own files); a trainer
  on the same machine, or one that names the server by the host name it wrote into the file, reads it from there;
  otherwise from ``TRL_ROLLOUT_CORR_CONTROL_TOKEN`` or ``vllm_server_control_token_file``;
* a trainer answered 401 raises :class:`ControlTokenRefused`, naming the token and where to put it
  (:func:`token_session_class`, :func:`refusal_message`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
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


_LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "0.0.0.0", "::", "")


def this_host() -> str:
    """This machine's host name, as the token file names it."""
    return socket.gethostname() or "localhost"


def token_path(port: int, host: str | None = None) -> Path:
    """The file holding the control token of the server on ``host`` (default: this machine) and ``port``
    (``$XDG_CACHE_HOME/trl_rollout_corr/vllm-serve-<host>-<port>.token``)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    name = "".join(c if c.isalnum() or c in "-._" else "_" for c in (host or this_host()))
    return cache / "trl_rollout_corr" / f"vllm-serve-{name}-{int(port)}.token"


def _is_this_machine(host: str | None) -> bool:
    if host is None or host.lower() in _LOCAL_HOSTS:
        return True
    names = {this_host().lower(), socket.getfqdn().lower()}
    if host.lower() in names:
        return True
    try:
        return host == socket.gethostbyname(this_host())
    except OSError:
        return False


def token_paths(port: int, host: str | None = None) -> list[Path]:
    """Where a trainer looks for the token of the server at ``host:port``: the file a server on that host wrote (a
    shared ``$HOME``), and when ``host`` is this machine (or loopback), this machine's."""
    paths = [] if host is None or host.lower() in _LOCAL_HOSTS else [token_path(port, host)]
    if _is_this_machine(host) and token_path(port) not in paths:
        paths.append(token_path(port))
    return paths


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


def find_token(port: int | None, token_file: str | None = None, host: str | None = None) -> str | None:
    """The trainer's token: ``TRL_ROLLOUT_CORR_CONTROL_TOKEN``, else ``token_file``, else the file the server at
    ``host`` (default: this machine) and ``port`` wrote (:func:`token_paths`); None when there is none (an unprotected
    server needs none)."""
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    if token_file:
        return read_token_file(token_file)
    for path in token_paths(port, host) if port is not None else []:
        if path.is_file():
            return read_token_file(path)
    return None


class ControlTokenRefused(PermissionError):
    """A vLLM server started by ``trl-rollout-corr vllm-serve`` / ``vllm-serve-async`` refused a request without its
    control token."""


def refusal_message(base_url: str, path: str, sent: bool) -> str:
    """Why a server answered 401 to ``path``, which token it wants and where to put it."""
    from urllib.parse import urlparse

    port = urlparse(base_url).port or 8000
    host = urlparse(base_url).hostname
    where = (token_path(port) if _is_this_machine(host)
             else f"~/.cache/trl_rollout_corr/vllm-serve-<its host name>-{port}.token on the server's machine")
    given = ("the control token this trainer sent is not the server's (a server restarted with a new token, or the "
             "token of another server)" if sent else "this trainer found no control token")
    return (f"The vLLM server at {base_url} refused {path} (401): it was started by `trl-rollout-corr vllm-serve` or "
            f"`vllm-serve-async`, which protect its control endpoints with a control token, and {given}. The server "
            f"printed where it wrote the token ({where}). "
            f"Give it to the trainer: set {TOKEN_ENV} to it, or set vllm_server_control_token_file to a copy of that "
            "file (0600); or start the server with --control_token_file FILE and give the trainer the same FILE.")


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


def _guarded_path(url: str, prefix: str) -> str | None:
    """The path of ``url`` when it is a request to the server at ``prefix`` on an endpoint the token guards."""
    if not str(url).startswith(prefix):
        return None
    path = "/" + str(url)[len(prefix):].lstrip("/").split("?", 1)[0]
    return None if path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES) else path


def with_token(method, url, token: str | None, prefix: str, kwargs: dict, send):  # noqa: ANN001
    """``send(method, url, **kwargs)`` with the control token on a request to ``prefix``; a 401 from one of its
    guarded endpoints raises :class:`ControlTokenRefused` naming the token and where to put it."""
    if token is not None and str(url).startswith(prefix):
        kwargs = {**kwargs, "headers": {**(kwargs.get("headers") or {}), TOKEN_HEADER: token}}
    response = send(method, url, **kwargs)
    path = _guarded_path(url, prefix)
    if path is not None and getattr(response, "status_code", None) == 401:
        raise ControlTokenRefused(refusal_message(prefix, path, token is not None))
    return response


def token_session_class(base: type, token: str | None, base_url: str) -> type:
    """A ``requests.Session`` subclass that sends the control token (when there is one) with every request to
    ``base_url`` only, and raises :class:`ControlTokenRefused` on a 401 from the server's guarded endpoints."""
    prefix = base_url.rstrip("/")

    class TokenSession(base):
        def request(self, method, url, *args, **kwargs):  # noqa: ANN001
            send = super().request
            return with_token(method, url, token, prefix, kwargs, lambda m, u, **kw: send(m, u, *args, **kw))

    return TokenSession
