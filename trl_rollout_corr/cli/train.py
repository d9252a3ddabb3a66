"""``trl-rollout-corr train``: TRL's ``trl grpo`` with the rollout correction.

Every argument of ``trl grpo`` (TRL 1.16, ``trl/scripts/grpo.py``) means the same here: its script arguments
(``GRPOScriptArguments``: ``dataset_name``/``dataset_config``/splits/streaming, ``reward_funcs`` by TRL's built-in
name or import path, ``reward_model_name_or_path``), ``ModelConfig`` (dtype, attention implementation, PEFT/LoRA,
4/8-bit quantization), ``DatasetMixtureConfig`` (``datasets`` mixtures), the training config, and the arguments
``accelerate launch`` takes (``--num_processes``, ``--accelerate_config zero2``, ``--config_file``: the command then
relaunches itself under accelerate, as ``trl grpo`` does). Added: the correction fields of
:class:`~trl_rollout_corr.RolloutCorrGRPOConfig`, the monitor switch (``rollout_corr_monitor``), this package's
rewards by name (``reverse_reward``, ``math_answer_reward``), ``prompt_column``, an emulated rollout engine for the
transformers path (``rollout_engine``), and a local ``datasets.save_to_disk`` directory as ``dataset_name``.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trl.scripts.grpo import GRPOScriptArguments

from ..monitor.args import MonitorArguments


@dataclass
class TrainScriptArguments(GRPOScriptArguments):
    """``trl grpo``'s script arguments plus this package's."""

    prompt_column: str = field(default="prompt", metadata={"help": "Column renamed to 'prompt' (e.g. 'question')."})
    rollout_engine: str | None = field(default=None, metadata={
        "help": "Emulated engine on the transformers path: stale | bf16 | fp16 | int8 | wq<N>."})
    rollout_engine_lag: int = field(default=4, metadata={"help": "Optimizer steps a stale engine lags behind."})


def make_parser(prog: str = "trl-rollout-corr train"):
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser

    from ..grpo.config import RolloutCorrGRPOConfig

    # MonitorArguments before DatasetMixtureConfig keeps the first four positions of the old parser's result
    return TrlParser((TrainScriptArguments, RolloutCorrGRPOConfig, ModelConfig, MonitorArguments,
                      DatasetMixtureConfig), prog=prog)


def parse_train_args(argv: list[str]):
    """(script_args, training_args, model_args, monitor_args, dataset_args), strict: an unknown argument raises."""
    return make_parser().parse_args_and_config(args=argv)


def reward_registry() -> dict[str, Callable]:
    """The reward functions ``--reward_funcs`` names: TRL's (as ``trl grpo`` builds them) and this package's."""
    from trl.rewards import (accuracy_reward, get_soft_overlong_punishment, reasoning_accuracy_reward,
                             think_format_reward)

    from .rewards import math_answer_reward
    from ..testing.toy_task import reverse_reward

    return {
        "accuracy_reward": accuracy_reward,
        "reasoning_accuracy_reward": reasoning_accuracy_reward,
        "think_format_reward": think_format_reward,
        "get_soft_overlong_punishment": get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256),
        "reverse_reward": reverse_reward,
        "math_answer_reward": math_answer_reward,
    }


def resolve_reward_funcs(script_args: TrainScriptArguments) -> list[Any]:
    """The reward model (a path/id, loaded by TRL) and the reward functions, by registry name or import path."""
    rewards: list[Any] = []
    if script_args.reward_model_name_or_path:
        rewards.append(script_args.reward_model_name_or_path)
    registry = reward_registry()
    for name in script_args.reward_funcs or []:
        if name in registry:
            rewards.append(registry[name])
            continue
        if "." not in name:
            raise ValueError(f"--reward_funcs {name!r} is not a built-in reward ({', '.join(registry)}) nor an import "
                             "path such as my_rewards.count_yes (a module in the working directory or on PYTHONPATH).")
        module_name, attribute = name.rsplit(".", 1)
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # as trl grpo does: a reward module next to where the command runs
        try:
            module = importlib.import_module(module_name)
        except Exception as error:
            raise ValueError(f"--reward_funcs {name!r}: module {module_name!r} could not be imported "
                             f"({type(error).__name__}: {error}). Run from the directory that holds it or add it to "
                             "PYTHONPATH.") from error
        reward = getattr(module, attribute, None)
        if not callable(reward):
            raise ValueError(f"--reward_funcs {name!r}: module {module_name!r} ({module.__file__}) has no function "
                             f"{attribute!r}.")
        rewards.append(reward)
    if not rewards:
        raise ValueError("train needs a reward: --reward_funcs NAME or module.function (built-in: "
                         f"{', '.join(registry)}), and/or --reward_model_name_or_path.")
    return rewards


def load_train_dataset(script_args: TrainScriptArguments, dataset_args) -> Any:
    """A ``DatasetDict`` as ``trl grpo`` loads it (a mixture, else ``dataset_name``), or a ``save_to_disk``
    directory."""
    from datasets import DatasetDict, load_dataset, load_from_disk
    from trl import get_dataset

    name = script_args.dataset_name
    if dataset_args.datasets:
        if name:
            print("Both `datasets` and `dataset_name` are given: the `datasets` mixture is used (as trl grpo does).")
        dataset = get_dataset(dataset_args)
    elif name and os.path.isdir(name) and any(
            os.path.isfile(os.path.join(name, f)) for f in ("dataset_dict.json", "state.json")):
        dataset = load_from_disk(name)
        if not isinstance(dataset, DatasetDict):
            dataset = DatasetDict({script_args.dataset_train_split: dataset})
    elif name:
        dataset = load_dataset(name, name=script_args.dataset_config, streaming=script_args.dataset_streaming)
    else:
        raise ValueError("train needs data: --dataset_name (a Hub id, a local data directory or a save_to_disk "
                         "directory) or a `datasets` mixture in the --config YAML.")
    if script_args.prompt_column != "prompt":
        dataset = dataset.rename_column(script_args.prompt_column, "prompt")
    return dataset


def build_trainer(script_args: TrainScriptArguments, training_args, model_args, monitor_args, dataset_args,
                  monitor: bool = True):
    """The ``RolloutCorrGRPOTrainer`` a ``train`` run builds from its arguments (``probe`` builds the same one)."""
    from trl import get_peft_config, get_quantization_config

    from ..rollout.emulated import EmulatedRolloutEngine
    from ..grpo.trainer import RolloutCorrGRPOTrainer

    if not model_args.model_name_or_path:
        raise ValueError("train needs --model_name_or_path (a Hub id or a local directory). For the CPU demo on a "
                         "tiny local model, run `trl-rollout-corr demo`.")
    rewards = resolve_reward_funcs(script_args)
    model_init_kwargs = dict(revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code,
                             attn_implementation=model_args.attn_implementation, dtype=model_args.dtype)
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = model_init_kwargs
    dataset = load_train_dataset(script_args, dataset_args)
    if script_args.dataset_train_split not in dataset:
        raise ValueError(f"--dataset_train_split {script_args.dataset_train_split!r} is not a split of the dataset "
                         f"(its splits: {list(dataset)}).")
    sampler = EmulatedRolloutEngine(script_args.rollout_engine, lag=script_args.rollout_engine_lag) \
        if script_args.rollout_engine else None
    callback = monitor_args.build(script_args.rollout_engine, script_args.rollout_engine_lag) if monitor else None
    return RolloutCorrGRPOTrainer(
        model=model_args.model_name_or_path, reward_funcs=rewards, args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        quantization_config=get_quantization_config(model_args), peft_config=get_peft_config(model_args),
        rollout_sampler=sampler, callbacks=[callback] if callback else None)


def run(script_args: TrainScriptArguments, training_args, model_args, monitor_args, dataset_args) -> None:
    """Train in this process (one rank of it under ``accelerate launch`` / ``torchrun``)."""
    import transformers
    from packaging.version import Version

    trainer = build_trainer(script_args, training_args, model_args, monitor_args, dataset_args)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)  # the model or adapter, and rollout_correction_config.json
    trainer.accelerator.print(f"Model and rollout_correction_config.json saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    if Version(transformers.__version__) >= Version("5.18.0"):
        trainer.end()


def launched() -> bool:
    """Whether this process already runs under ``accelerate launch`` or ``torchrun``."""
    return "ACCELERATE_MIXED_PRECISION" in os.environ or "LOCAL_RANK" in os.environ


def _without(args: list[str], subsequence: list[str]) -> list[str]:
    """``args`` with the ordered subsequence ``subsequence`` removed (the launcher's arguments taken out)."""
    rest, items = [], iter(subsequence)
    current = next(items, None)
    for arg in args:
        if current is not None and arg == current:
            current = next(items, None)
        else:
            rest.append(arg)
    return rest


def _check_launch_args(launch_args: list[str]) -> None:
    from accelerate.commands.launch import launch_command_parser

    known = launch_command_parser()._option_string_actions
    unknown = [arg for arg in launch_args if arg.startswith("-") and arg.split("=", 1)[0] not in known]
    if unknown:
        raise ValueError(f"Some specified arguments are not used by trl-rollout-corr train nor accelerate launch: "
                         f"{unknown}. See `trl-rollout-corr train --help` and `accelerate launch --help`.")


def main(argv: list[str]) -> None:
    """Parse; with ``accelerate launch`` arguments (``--num_processes``, ``--accelerate_config``, ``--config_file``,
    also as keys of the YAML) or accelerate's default config file present, relaunch under accelerate as ``trl grpo``
    does; otherwise (or when already launched) train in this process."""
    from accelerate.commands.config import default_config_file
    from trl.cli.accelerate_config import resolve_accelerate_config_argument

    *parsed, config_remaining, cli_remaining = make_parser().parse_args_and_config(
        argv, return_remaining_strings=True, separate_remaining_strings=True)
    launch_args = resolve_accelerate_config_argument(config_remaining + cli_remaining)
    _check_launch_args(launch_args)
    if launched():
        if cli_remaining:
            raise ValueError(f"{cli_remaining}: this process already runs under a launcher, so launcher arguments "
                             "belong to `accelerate launch` / `torchrun` themselves, not to `train`.")
        run(*parsed[:5])  # the YAML's launcher keys were the launcher's business
        return
    if not launch_args and not os.path.isfile(default_config_file):
        run(*parsed[:5])
        return
    from accelerate.commands.launch import launch_command, launch_command_parser

    script_args = _without(argv, cli_remaining)
    launch_command(launch_command_parser().parse_args([*launch_args, "--module", "trl_rollout_corr", "train",
                                                       *script_args]))
