"""Test-only: run accelerate's FSDP (FSDP2 and FSDP1) on CPU processes (gloo). Never imported by the package.

accelerate 1.16 turns FSDP on only for GPU-type multi-process states: ``AcceleratorState.__init__`` sets
``DistributedType.FSDP`` and keeps the ``fsdp_plugin`` inside ``elif self.distributed_type in [MULTI_GPU, MULTI_MLU,
..., MULTI_NEURON]`` (accelerate/state.py:947-977), a list without ``MULTI_CPU``. A CPU process group
(``cpu=True`` under ``accelerate launch`` / ``torchrun``) is ``MULTI_CPU`` (state.py:769): the plugin is dropped
without an error and ``prepare`` wraps the model in DDP (accelerator.py:2031-2032). :func:`apply` wraps
``AcceleratorState.__init__`` to do for ``MULTI_CPU`` what those lines do for a GPU state (type FSDP, the plugin's
mixed precision, keep the plugin), and sets the device to plain ``cpu``: ``set_device`` gives ``cpu:0``
(state.py:805), which FSDP1 rejects as its ``device_id`` ("Inconsistent compute device and device_id: cpu vs
cpu:0", torch/distributed/fsdp/_init_utils.py). FSDP1 also needs ``fsdp_sync_module_states: false`` in the launch
config (accelerate raises for ``sync_module_states`` on a CPU, utils/dataclasses.py:1873-1880), and a full state dict
(``save_model``, a checkpoint) needs :func:`_keep_cpu_flat_param`: accelerate's FSDP1 ``get_state_dict`` always asks for
``FullStateDictConfig(offload_to_cpu=True)`` (accelerator.py:3977), and torch's ``FlatParamHandle.to_cpu`` "moves" the
unsharded flat parameter to the CPU (a no-op there) and then frees it (torch/distributed/fsdp/_flat_param.py:1750-1751):
``state_dict()`` then clones freed memory (SIGSEGV, measured with torch 2.13.0). FSDP1's full optimizer state dict
needs ``offload_to_cpu`` off (see :func:`apply`: on a CPU its ``.cpu()`` copy is no copy, and a parameter's optimizer
states alias one buffer).

The wrapper checks accelerate's state at run time and raises, naming the installed accelerate version, when it no
longer looks as described (a signature, an attribute or the ``MULTI_CPU`` outcome changed, or accelerate now runs
FSDP on a CPU itself: then this shim is no longer needed).
"""

from __future__ import annotations

import functools
import inspect

_APPLIED = "_trl_rollout_corr_fsdp_cpu_shim"


class AccelerateChanged(RuntimeError):
    """accelerate's state no longer looks as this shim was written against (accelerate 1.16.0)."""


def _fail(what: str) -> AccelerateChanged:
    import accelerate

    return AccelerateChanged(
        f"tests/support/fsdp_cpu.py was written against accelerate 1.16.0's AcceleratorState; with the installed "
        f"accelerate {accelerate.__version__}, {what}. Re-check accelerate/state.py (the FSDP branch for MULTI_* "
        "states) and update or delete the shim.")


def apply() -> None:
    """Enable accelerate's FSDP for a MULTI_CPU state that was given an FSDP plugin. Call it before the Accelerator
    (or the Trainer that builds one) exists; idempotent."""
    import torch
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__
    if getattr(original, _APPLIED, False):
        return
    if "fsdp_plugin" not in inspect.signature(original).parameters:
        raise _fail("AcceleratorState.__init__ has no fsdp_plugin parameter")
    if not hasattr(PartialState, "_shared_state") or not hasattr(AcceleratorState, "_shared_state"):
        raise _fail("PartialState / AcceleratorState have no _shared_state")
    if not {"MULTI_CPU", "FSDP"} <= set(DistributedType.__members__):
        raise _fail("DistributedType has no MULTI_CPU or FSDP member")

    @functools.wraps(original)
    def init(self, *args, **kwargs):
        bound = inspect.signature(original).bind(self, *args, **kwargs)
        fsdp_plugin = bound.arguments.get("fsdp_plugin")
        was_initialized = bool(AcceleratorState._shared_state)
        original(self, *args, **kwargs)
        if fsdp_plugin is None or was_initialized:
            return
        if self.distributed_type == DistributedType.FSDP:
            raise _fail("a CPU process group is FSDP without the shim (accelerate now enables FSDP on a CPU)")
        if self.distributed_type != DistributedType.MULTI_CPU:
            return  # one process, DeepSpeed, a GPU state: nothing to do
        if getattr(self, "fsdp_plugin", None) is not None:
            raise _fail("a MULTI_CPU state kept its fsdp_plugin")
        if not hasattr(self, "_mixed_precision") or self.device is None or self.device.type != "cpu":
            raise _fail(f"a MULTI_CPU state has no _mixed_precision or a non-CPU device ({self.device})")
        # what state.py:974-977 does for a GPU-type state
        self.distributed_type = DistributedType.FSDP
        if self._mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(self._mixed_precision)
        self.fsdp_plugin = fsdp_plugin
        if fsdp_plugin.fsdp_version == 1:
            # FSDP1's full optimizer state dict gathers every state (exp_avg, exp_avg_sq, ...) into one reused buffer
            # and, with offload_to_cpu (accelerate's default, utils/dataclasses.py:1928), copies each out with
            # .cpu() instead of .clone() (torch/distributed/fsdp/_optim_utils.py:1501-1507): on a CPU that is no
            # copy, and every state of a parameter is saved as the last one gathered (measured: exp_avg ==
            # exp_avg_sq in the checkpoint, the resumed Adam step off by 1/3 of the update). Clone instead.
            config = getattr(fsdp_plugin, "optim_state_dict_config", None)
            if config is None or not hasattr(config, "offload_to_cpu"):
                raise _fail("an FSDP1 plugin has no optim_state_dict_config.offload_to_cpu")
            config.offload_to_cpu = False
        # plain "cpu" (not "cpu:0") as FSDP1's device_id; the same device for the whole process
        self.device = torch.device("cpu")
        PartialState._shared_state["device"] = torch.device("cpu")
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    setattr(init, _APPLIED, True)
    AcceleratorState.__init__ = init
    _keep_cpu_flat_param()


def _keep_cpu_flat_param() -> None:
    """FSDP1's ``FlatParamHandle.to_cpu`` (the state dict's ``offload_to_cpu``) as a no-op when the compute device is
    the CPU already: the unsharded flat parameter stays where it is instead of being freed under its own views."""
    import contextlib

    import torch
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    original = FlatParamHandle.to_cpu
    if getattr(original, _APPLIED, False):
        return

    @functools.wraps(original)
    def to_cpu(self):
        if not isinstance(getattr(self, "device", None), torch.device):
            raise AccelerateChanged(f"torch {torch.__version__}'s FlatParamHandle has no compute device attribute: "
                                    "re-check tests/support/fsdp_cpu.py::_keep_cpu_flat_param")
        return contextlib.nullcontext() if self.device.type == "cpu" else original(self)

    setattr(to_cpu, _APPLIED, True)
    FlatParamHandle.to_cpu = to_cpu


def parameters_are_sharded(model) -> str | None:
    """How ``model``'s parameters are sharded over the processes: "DTensor" (FSDP2's ``fully_shard``: every
    parameter a DTensor), "FlatParameter" (FSDP1: every FSDP unit's flat parameter holds less than its original
    parameters' elements, with ``use_orig_params`` true or false), or None (whole parameters: DDP, one process)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    if params and all(isinstance(p, DTensor) for p in params):
        return "DTensor"
    flat = [m._handle.flat_param for m in FullyShardedDataParallel.fsdp_modules(model)
            if getattr(m, "_handle", None) is not None]
    if flat and all(f.numel() < sum(f._numels) for f in flat):
        return "FlatParameter"
    return None
