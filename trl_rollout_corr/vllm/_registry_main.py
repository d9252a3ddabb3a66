"""vLLM's model-inspection subprocess, behind the CPU-torch guard (see ``_cpu_guard`` and
``cpu.guard_subprocesses``)."""

from trl_rollout_corr.runtime.cpu_guard import hide_cuda_only_extensions

hide_cuda_only_extensions()

if __name__ == "__main__":
    from vllm.model_executor.models.registry import _run

    _run()
