"""How every multi-process test worker ends, once its results are written: as a user's script should."""

from __future__ import annotations


def end_worker() -> None:
    """Destroy the process group after a barrier, then let the interpreter exit normally (no ``os._exit``): the
    teardown abort gloo's threads caused now and then is prevented by the package's exit hook
    (trl_rollout_corr/runtime/distributed_exit.py), and these runs check that every rank exits 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
