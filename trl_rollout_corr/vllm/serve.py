"""``trl-rollout-corr vllm-serve``: TRL's ``vllm-serve`` (same arguments), ready for a CPU engine.

It builds the command line ``trl vllm-serve`` would run (``trl.scripts.vllm_serve.build_command``: dev-mode
endpoints, ``--logprobs-mode processed_logprobs``, ...) and runs vLLM's OpenAI server in this process, after the
CPU-torch guard. When vLLM runs on its CPU platform it adds, unless given:

- ``--worker-extension-cls trl_rollout_corr.vllm.worker.CPUWeightSyncExtension`` (the CPU weight sync; importing
  it in the worker applies the CPU linear fix before the model loads);
- ``--enforce-eager`` and ``--kv-cache-memory-bytes`` from ``--gpu_memory_utilization`` (a fraction of host memory,
  at most half of what is free; ``VLLM_CPU_KVCACHE_SPACE`` wins);
- host ``127.0.0.1`` when no ``--host`` is given, and ``VLLM_HOST_IP=127.0.0.1`` for a loopback host.

On every platform and bind address it protects the control plane (:mod:`trl_rollout_corr.vllm.security`): a
control token (``--control_token_file PATH``, else ``TRL_ROLLOUT_CORR_CONTROL_TOKEN``, else a new random one) is
required on every endpoint but health and generation, kept in a 0600 file per port for trainers on this machine;
``/collective_rpc`` runs only the weight-sync method, on files of ``--weight_sync_dir`` (default ``/dev/shm``).

The server is ``vllm serve``'s own, run in this process through vLLM's ``serve`` subcommand (:func:`run_vllm_serve`):
its dispatch to one API server, several front ends (``--api-server-count``, data parallelism), or ``--headless``
engines is vLLM's. (``trl vllm-serve`` itself cannot start the CPU build: its ``vllm`` CLI asks for the ``vllm``
distribution, which ``vllm-cpu`` is not; this command does not go through that CLI's ``main``.) Refused, since the
control token would not cover them: ``--grpc`` and the Rust front end (:func:`refuse_unprotected`).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

WORKER_EXTENSION = "trl_rollout_corr.vllm.worker.CPUWeightSyncExtension"
MIDDLEWARE = "trl_rollout_corr.vllm.security.ControlTokenMiddleware"
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def split_own_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This command's own options (control token, weight-sync directory) and the rest, for ``trl vllm-serve``."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--control_token_file", "--control-token-file", default=None)
    parser.add_argument("--weight_sync_dir", "--weight-sync-dir", default=None)
    return parser.parse_known_args(argv)


def build_server_argv(argv: list[str]) -> tuple[list[str], dict[str, str], int]:
    """The vLLM OpenAI-server arguments and environment for ``trl-rollout-corr vllm-serve ARGV``.

    The environment carries the control token (generated when none is given) and the weight-sync directory.
    """
    from trl.scripts.vllm_serve import build_command, make_parser

    from . import vllm_on_cpu
    from .cpu import kv_cache_bytes
    from .security import SYNC_DIR_ENV, TOKEN_ENV, default_sync_dir, new_token, read_token_file

    own, argv = split_own_args(argv)
    on_cpu = vllm_on_cpu()
    given = " ".join(argv)
    if on_cpu and "--host" not in given:
        argv = [*argv, "--host", "127.0.0.1"]
    if on_cpu and "--enforce_eager" not in given and "--enforce-eager" not in given:
        argv = [*argv, "--enforce_eager", "true"]
    parser = make_parser(prog="trl-rollout-corr vllm-serve")
    script_args, extra = parser.parse_args_and_config(args=argv, return_remaining_strings=True)
    command = build_command(script_args, extra)
    serve = command.index("serve")
    flags = ["--model", command[serve + 1], *command[serve + 2:]]
    token = read_token_file(own.control_token_file) if own.control_token_file else os.environ.get(TOKEN_ENV)
    env = {"VLLM_SERVER_DEV_MODE": "1", TOKEN_ENV: token or new_token(),
           SYNC_DIR_ENV: os.path.realpath(own.weight_sync_dir or default_sync_dir())}
    flags += ["--middleware", MIDDLEWARE]
    if on_cpu:
        if "--worker-extension-cls" not in flags:
            flags += ["--worker-extension-cls", WORKER_EXTENSION]
        if "--kv-cache-memory-bytes" not in flags and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            flags += ["--kv-cache-memory-bytes", str(kv_cache_bytes(script_args.gpu_memory_utilization))]
        if script_args.host in _LOOPBACK and not os.environ.get("VLLM_HOST_IP"):
            env["VLLM_HOST_IP"] = "127.0.0.1"
    return flags, env, script_args.port


def main(argv: list[str]) -> None:
    run_server(argv, build_server_argv, "trl_rollout_corr.vllm.serve", "trl-rollout-corr vllm-serve")


def run_server(argv: list[str], build, module: str, prog: str) -> None:
    """Run vLLM's OpenAI server in this process with the flags and environment ``build(argv)`` returns."""
    from ..runtime.versions import check_version

    check_version("trl")
    check_version("vllm")
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if main_spec is not None and main_spec.name.endswith(".__main__"):
        # vLLM's CPU engine process is spawned; spawn re-imports the parent's main module (and with it the guard)
        # except a package's __main__: re-run as this module so the engine process gets the guard too
        os.execv(sys.executable, [sys.executable, "-m", module, *argv])
    from ..runtime.cpu_guard import hide_cuda_only_extensions

    hide_cuda_only_extensions()
    from .security import TOKEN_ENV, write_token

    flags, env, port = build(argv)
    os.environ.update(env)
    token_file = write_token(port, env[TOKEN_ENV])
    print(f"{prog}: control token in {token_file} (0600). Trainers on this machine read it from "
          "there; on other machines set TRL_ROLLOUT_CORR_CONTROL_TOKEN or vllm_server_control_token_file.", flush=True)
    from . import vllm_on_cpu

    if vllm_on_cpu():
        from .cpu import guard_subprocesses

        guard_subprocesses()
    print(f"{prog}: vllm serve with", " ".join(flags), flush=True)
    run_vllm_serve(prog, flags)


#: vLLM's ``vllm serve`` subcommand: its parser, its validation and its dispatch (one API server in this process,
#: several front ends, data-parallel supervisors, ``--headless`` engines), the same module from vLLM 0.22 to 0.31
SERVE_MODULE = "vllm.entrypoints.cli.serve"


def refuse_unprotected(args: Any, prog: str = "trl-rollout-corr vllm-serve") -> None:
    """Refuse the ``vllm serve`` front ends the control token does not cover: ``--grpc`` (a gRPC server: the token is
    an HTTP middleware, and TRL's clients speak HTTP) and the Rust front end (``VLLM_USE_RUST_FRONTEND=1``: it does not
    run the Python middleware), each named with what to run instead."""
    if getattr(args, "grpc", False):
        raise SystemExit(f"{prog}: --grpc serves vLLM over gRPC, where the control token (an HTTP "
                         "middleware) does not apply and TRL's clients cannot connect: leave --grpc out (TRL's "
                         "trainers talk to the OpenAI HTTP server), or run `vllm serve --grpc` yourself on a network "
                         "only trusted processes reach.")
    if os.environ.get("VLLM_USE_RUST_FRONTEND", "0").strip().lower() not in ("", "0", "false"):
        raise SystemExit(f"{prog}: VLLM_USE_RUST_FRONTEND is set, and vLLM's Rust front end "
                         "does not run the control-token middleware: unset it (the Python front end serves TRL's "
                         "endpoints; --api-server-count N runs N of them).")


def run_vllm_serve(prog: str, flags: list[str]) -> None:
    """``vllm serve FLAGS`` in this process, through vLLM's own subcommand (``ServeSubcommand``: parser, validation,
    dispatch), so that ``--api-server-count``, data-parallel front ends and ``--headless`` behave as with ``vllm
    serve``. What vLLM's ``vllm`` CLI does around it is done here too: the ``spawn`` default for its worker processes
    and its logging options. Not through that CLI's ``main``: it asks for the ``vllm`` distribution's version, which
    vLLM's CPU build (the ``vllm-cpu`` distribution) does not have. ``--model M`` first is passed as ``vllm serve``'s
    positional model."""
    import importlib

    try:
        serve = importlib.import_module(SERVE_MODULE)
    except ModuleNotFoundError as error:
        if not (error.name and SERVE_MODULE.startswith(error.name) and error.name.startswith("vllm")):
            raise
        from . import installed_vllm_version

        raise RuntimeError(f"vLLM {installed_vllm_version()} has no {SERVE_MODULE} (vLLM's `vllm serve`): this "
                           "package cannot start its OpenAI server. Install a vLLM TRL 1.16 supports (pip install "
                           "\"vllm>=0.22.0,<=0.31.0\").") from error
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older layout
        from vllm.utils import FlexibleArgumentParser
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # what the `vllm` CLI sets (cli_env_setup)
    argv = ["serve", flags[1], *flags[2:]] if flags[:1] == ["--model"] and len(flags) > 1 else ["serve", *flags]
    parser = FlexibleArgumentParser(prog=prog)
    command = serve.ServeSubcommand()
    command.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(argv)
    refuse_unprotected(args, prog)
    import vllm.logger

    configure_logging = getattr(vllm.logger, "configure_logging_from_args", None)
    if configure_logging is not None:
        configure_logging(args)
    command.validate(args)
    sys.argv = [prog, *argv]
    command.cmd(args)


if __name__ == "__main__":
    main(sys.argv[1:])
