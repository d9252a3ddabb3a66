import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import trl_rollout_corr  # noqa: E402,F401  first: its CPU-torch guard must run before transformers is imported


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test leaves ``os.environ`` as it found it. A trainer built in this process once a process group exists
    (a colocated vLLM engine's) has accelerate set RANK, WORLD_SIZE and MASTER_PORT here; a later test's subprocess
    would inherit them and rendezvous as if launched by torchrun (measured with pytest -n 2: EADDRINUSE in the demo,
    the minimal example and the one-process reference runs)."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)
