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

(``trl vllm-serve`` itself cannot start the CPU build: its ``vllm`` CLI asks for the ``vllm`` distribution, which
``vllm-cpu`` is not.) On a GPU it serves what ``trl vllm-serve`` serves, through vLLM's single API server in this
process (:func:`vllm_server_main`, by the installed vLLM's module layout) rather than ``vllm serve``'s dispatch: no
``--api-server-count`` / data-parallel front ends, ``--headless``, ``--grpc`` (docs/engines.md, "What vllm-serve does
not pass through").
"""

from __future__ import annotations

import argparse
import os
import sys

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
    print(f"{prog}: vLLM OpenAI server with", " ".join(flags), flush=True)
    serve = vllm_server_main()
    sys.argv = [prog, *flags]
    serve()


# vLLM's single OpenAI API server, by module layout: vLLM 0.29+ moved it to ``launchers`` (0.31 keeps
# ``openai.api_server`` as a deprecated shim over it); before, ``python -m vllm.entrypoints.openai.api_server`` ran it
# from the module's ``if __name__ == "__main__"`` block. Both parse the same ``vllm serve`` options from sys.argv.
LAUNCHER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
LEGACY_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def vllm_server_main():
    """A callable that runs vLLM's OpenAI API server in this process with the options in ``sys.argv``, for the
    installed vLLM's module layout."""
    import importlib
    import importlib.util

    try:
        return importlib.import_module(LAUNCHER_MODULE).main
    except ModuleNotFoundError as error:  # an older vLLM: the module (or its package) is not there
        if not (error.name and LAUNCHER_MODULE.startswith(error.name) and error.name.startswith("vllm.")):
            raise
    try:
        legacy = importlib.util.find_spec(LEGACY_SERVER_MODULE)
    except ModuleNotFoundError:
        legacy = None
    if legacy is None:
        from . import installed_vllm_version

        raise RuntimeError(f"vLLM {installed_vllm_version()} has neither {LAUNCHER_MODULE} nor "
                           f"{LEGACY_SERVER_MODULE}: this package cannot start its OpenAI server. Install a vLLM "
                           "TRL 1.16 supports (pip install \"vllm>=0.22.0,<=0.31.0\").")

    def run_legacy() -> None:
        import runpy

        # the module's own ``__main__`` block; ``alter_sys=False`` keeps this module as ``__main__`` for the
        # processes vLLM spawns (they re-import it, with the CPU-torch guard)
        runpy.run_module(LEGACY_SERVER_MODULE, run_name="__main__", alter_sys=False)

    return run_legacy


if __name__ == "__main__":
    main(sys.argv[1:])
