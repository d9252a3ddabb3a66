"""What this package assumes about TRL's ``GRPOTrainer`` internals, each checked where it is used.

Written against TRL 1.16. What is assumed, and how it is checked:

* ``_generate(prompts)`` returns the tuple :data:`GENERATE_RESULT_FIELDS` names, in that order;
  :func:`unpack_generate_result` checks its length and the types of ``completion_ids`` and ``logprobs`` on every call.
* ``_generate_and_score_completions`` asks ``_get_per_token_logps_and_entropies`` for the pi_old forward (under
  TRL's own condition, :func:`trl_runs_pi_old_forward`) and then the reference-model forward (``beta != 0``), both
  without grad; ``_compute_loss`` asks it once for the micro-batch's policy forward.
  :class:`~trl_rollout_corr.trl_hooks.grpo_forwards.TrlForwardCalls` answers those calls from an explicit list of
  expected calls and raises on any other order, model or count.
* The model-input keyword arguments of a forward are the parameters of ``_get_per_token_logps_and_entropies``
  after its control arguments: :func:`forward_input_names` reads them from TRL's signature.
* The loss types whose ``_compute_loss`` divides by ``num_items_in_batch`` are :data:`KEPT_TOKEN_NORMALIZER_LOSSES`
  (``cispo``, ``dapo``, ``vespo``); ``tests/trl_hooks/test_trl_hooks.py`` checks it against the installed TRL's loss
  (every loss type, two values of ``num_items_in_batch``).
* Keys added to the output of ``_generate_and_score_completions`` (tensors with a leading batch dimension) reach
  ``compute_loss`` through TRL's shuffling and splitting: the trainer checks that they arrive.
* ``_generate_single_turn`` takes ``(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)`` and
  returns ``(completion_ids, logprobs)``: :func:`generate_single_turn` checks both.

The trainer calls TRL's private methods only through this module (:func:`generate_single_turn`, :func:`generate`,
:func:`per_token_logps`, :func:`generate_and_score`, :func:`save_checkpoint`, ...): ``super(owner, trainer)``, as the
trainer's own ``super()`` would. Its ``compute_loss`` asks this module for TRL's loss (:func:`trl_loss`), and its
override of ``_get_per_token_logps_and_entropies`` passes TRL's calls to :func:`answer_forward`. Nothing here calls a
method of the trainer (``tests/repo/test_layers.py``): only TRL's own, through ``super``.
:func:`check_hooks` checks at construction that every private method it overrides
(:data:`OVERRIDDEN_HOOKS`) is still defined by TRL: a renamed hook would otherwise never be called.

Every check that reads a TRL method (its signature, whether it is still defined) reads the method the trainer really
inherits (:func:`~trl_rollout_corr.trl_hooks.base.inherited_method`: the next definition after this package's class in
the instance's MRO, what ``super()`` calls), never ``trl.GRPOTrainer``: that name can be rebound (a patching library, a
test harness, this package's class swapped into TRL's namespace) without TRL having changed.
:data:`KEPT_TOKEN_NORMALIZER_LOSSES` and :data:`GENERATE_RESULT_FIELDS` are TRL 1.16's behaviour written down, not
read from any method: a patch in the MRO that reorders ``_generate``'s fields (keeping their types) or changes which
losses divide by ``num_items_in_batch`` is not seen.

A failed check raises :class:`~trl_rollout_corr.trl_hooks.base.TrlInternalsChanged`, naming the installed TRL
version.
"""

from __future__ import annotations

import inspect
from typing import Any

from ..config.plan import one_optimizer_step_per_generation_batch
from .base import TrlInternalsChanged, inherited_method, require_hooks, require_parameters

_FORWARD_CONTROL_ARGS = ("self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size",
                         "compute_entropy", "compute_aux_loss")
_FORWARD_NAMED = 5  # self, model, input_ids, attention_mask, logits_to_keep: named in the trainer's override
_SINGLE_TURN_PARAMS = ("self", "prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images")
# the private GRPOTrainer (and transformers.Trainer) methods RolloutCorrGRPOTrainer overrides
OVERRIDDEN_HOOKS = ("_generate_single_turn", "_generate", "_get_per_token_logps_and_entropies",
                    "_generate_and_score_completions", "_save_checkpoint", "_calculate_rewards")

KEPT_TOKEN_NORMALIZER_LOSSES = ("cispo", "dapo", "vespo")
"""The loss types whose ``GRPOTrainer._compute_loss`` divides by ``inputs["num_items_in_batch"]``.

In TRL 1.16, ``cispo``, ``dapo`` and ``vespo`` divide the masked sum of the per-token loss by
``num_items_in_batch / num_processes`` (times ``current_gradient_accumulation_steps / steps_per_generation`` in
training): TRL's count of the generation batch's loss tokens over all processes, which the trainer replaces by the
kept-token count when the correction rejects tokens. ``grpo``, ``sapo``, ``bnpo``, ``dr_grpo`` and ``luspo`` never
read it (they normalize per sequence, by the micro-batch's own token count or by ``max_completion_length``).
``tests/trl_hooks/test_trl_hooks.py`` runs the installed TRL's ``_compute_loss`` for every loss type with two values of
``num_items_in_batch`` and checks that exactly these losses scale by their ratio.
"""

GENERATE_RESULT_FIELDS = ("prompt_ids", "completion_ids", "tool_mask", "completions", "logprobs", "extra_fields",
                          "images", "tool_images")
"""What ``GRPOTrainer._generate(prompts)`` returns in TRL 1.16, in order: the prompt and completion token ids (lists
of lists), the tool mask (``None`` without tools or a rollout ``env_mask``), the decoded completions, the rollout
log-probs (lists, or ``None``), the rollout function's extra fields (a dict), the images and the tool images.
:func:`unpack_generate_result` checks the length and the types of ``completion_ids`` and ``logprobs`` on every call;
``tests/trl_hooks/test_trl_hooks.py`` checks each field's value on a real ``_generate``.
"""


def forward_input_names(owner: type, cls: type | None = None) -> tuple[str, ...]:
    """The model-input keyword arguments of ``GRPOTrainer._get_per_token_logps_and_entropies`` (pixel_values, ...)."""
    params = list(inspect.signature(inherited_method(owner, "_get_per_token_logps_and_entropies", cls)).parameters)
    if tuple(params[: len(_FORWARD_CONTROL_ARGS)]) != _FORWARD_CONTROL_ARGS:
        raise TrlInternalsChanged(f"GRPOTrainer._get_per_token_logps_and_entropies takes {params}, expected "
                                  f"{list(_FORWARD_CONTROL_ARGS)} first")
    return tuple(params[len(_FORWARD_CONTROL_ARGS):])


def checkpoint_dir(trainer: Any, owner: type, trial: Any) -> str:
    """The directory ``Trainer._save_checkpoint`` writes this step's checkpoint into (as TRL's own override reads
    it: ``Trainer._get_output_dir``, the one ``owner`` inherits)."""
    import os

    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    output_dir = super(owner, trainer)._get_output_dir(trial=trial)
    return os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}")


def trl_runs_pi_old_forward(trainer: Any) -> bool:
    """TRL's own condition for computing old_per_token_logps in ``_generate_and_score_completions``."""
    one_step = one_optimizer_step_per_generation_batch(trainer.args.gradient_accumulation_steps,
                                                       trainer.args.steps_per_generation, trainer.num_iterations)
    return not one_step or (trainer.use_vllm and trainer.vllm_importance_sampling_correction)


def unpack_generate_result(result: Any) -> dict[str, Any]:
    """``GRPOTrainer._generate``'s tuple as a dict named by :data:`GENERATE_RESULT_FIELDS`, after checking it."""
    names = GENERATE_RESULT_FIELDS
    if not isinstance(result, tuple) or len(result) != len(names):
        raise TrlInternalsChanged(f"GRPOTrainer._generate returned {type(result).__name__} of length "
                                  f"{len(result) if isinstance(result, tuple) else '?'}, expected the "
                                  f"{len(names)}-tuple {names} TRL 1.16 returns")
    fields = dict(zip(names, result))
    completion_ids, logprobs = fields["completion_ids"], fields["logprobs"]
    if not isinstance(completion_ids, list) or (logprobs is not None and not isinstance(logprobs, list)):
        raise TrlInternalsChanged(f"GRPOTrainer._generate returned completion_ids of type "
                                  f"{type(completion_ids).__name__} and logprobs of type {type(logprobs).__name__}, "
                                  "expected lists")
    return fields


def check_hooks(owner: type, cls: type) -> None:
    """Every private method in :data:`OVERRIDDEN_HOOKS` is still one ``owner`` inherits (see
    :func:`~trl_rollout_corr.trl_hooks.base.require_hooks`)."""
    require_hooks(owner, cls, OVERRIDDEN_HOOKS)


def forward_keywords(input_names: tuple[str, ...], args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments after ``logits_to_keep`` of a call to ``_get_per_token_logps_and_entropies``, all by name (the
    positional ones named by TRL's signature: its control arguments, then ``input_names``)."""
    return {**dict(zip((*_FORWARD_CONTROL_ARGS[_FORWARD_NAMED:], *input_names), args)), **kwargs}


def per_token_logps(trainer: Any, owner: type, model: Any, input_ids: Any, attention_mask: Any, logits_to_keep: int,
                    *args: Any, **kwargs: Any) -> tuple:
    """TRL's forward, ``GRPOTrainer._get_per_token_logps_and_entropies``: (log-probs, entropies, aux loss)."""
    return super(owner, trainer)._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                                    *args, **kwargs)


def answer_forward(trainer: Any, owner: type, forwards: Any, model: Any, input_ids: Any, attention_mask: Any,
                   logits_to_keep: int, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """TRL's call to ``_get_per_token_logps_and_entropies`` (overridden by the trainer): the answer ``forwards`` (a
    :class:`~trl_rollout_corr.trl_hooks.grpo_forwards.TrlForwardCalls`) has for it, else TRL's own forward
    (:func:`per_token_logps`). Returns (log-probs (B, T), entropies (B, T) or None, aux loss or None)."""
    answer = forwards.answer(model, input_ids, attention_mask, logits_to_keep,
                             forward_keywords(forwards.input_names, args, kwargs))
    if answer is not None:
        return answer
    return per_token_logps(trainer, owner, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)


def trl_loss(trainer: Any, owner: type, forwards: Any, model: Any, inputs: dict[str, Any], patched: dict[str, Any],
             forward: tuple, input_ids: Any, attention_mask: Any, return_outputs: bool = False,
             num_items_in_batch: Any = None) -> tuple[Any, Any]:
    """TRL's own ``GRPOTrainer.compute_loss`` on the ``patched`` micro-batch, its request for the policy forward
    answered with ``forward`` (the trainer's, for ``inputs`` and ``input_ids`` / ``attention_mask`` (B, P+T)).

    Returns:
        TRL's loss, and the 0-dim device flag of :meth:`TrlForwardCalls.take_mismatch` (None: no cached answer
        compared values), which the trainer reads with its metrics at the next log.
    """
    logits_to_keep = inputs["completion_ids"].size(1)
    with forwards.loss(model, input_ids, attention_mask, logits_to_keep, inputs, forward):
        loss = super(owner, trainer).compute_loss(model, patched, return_outputs, num_items_in_batch)
    return loss, forwards.take_mismatch()


def fused_lm_head(model: Any, temperature: float, cast_lm_head_to_fp32: bool) -> None:
    """TRL's ``trl.trainer.utils.add_fused_lm_head`` on ``model`` (what ``GRPOTrainer.__init__`` installs: log-probs
    and entropies at ``temperature``), with ``cast_lm_head_to_fp32`` as given: it replaces ``model.forward``. With
    ``fused_lm_head=True`` TRL's fused forward calls the backbone and the head itself, never the forward it wraps."""
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model, temperature=temperature, cast_lm_head_to_fp32=cast_lm_head_to_fp32,
                      outputs=("log_probs", "entropy"))


def generate_single_turn(trainer: Any, owner: type, args: tuple, kwargs: dict[str, Any]) -> tuple[list, Any]:
    """TRL's call to ``_generate_single_turn(*args, **kwargs)`` passed on to the method ``owner`` inherits, after
    checking that it takes the arguments ``owner``'s override was written for; returns (completion_ids, logprobs)."""
    require_parameters(owner, "_generate_single_turn", type(trainer), _SINGLE_TURN_PARAMS)
    result = super(owner, trainer)._generate_single_turn(*args, **kwargs)
    if not isinstance(result, tuple) or len(result) != 2:
        raise TrlInternalsChanged(f"GRPOTrainer._generate_single_turn returned {type(result).__name__}, expected the "
                                  "2-tuple (completion_ids, logprobs)")
    return result


def generate(trainer: Any, owner: type, prompts: list) -> dict[str, Any]:
    """``GRPOTrainer._generate(prompts)``'s result as a dict named by :data:`GENERATE_RESULT_FIELDS`, checked."""
    return unpack_generate_result(super(owner, trainer)._generate(prompts))


def generate_and_score(trainer: Any, owner: type, inputs: list) -> dict[str, Any]:
    """``GRPOTrainer._generate_and_score_completions(inputs)``: the scored generation batch."""
    return super(owner, trainer)._generate_and_score_completions(inputs)


def calculate_rewards(trainer: Any, owner: type, args: tuple, kwargs: dict[str, Any]) -> Any:
    """``GRPOTrainer._calculate_rewards(...)``: the rewards per reward function of the generation batch, gathered over
    every process, (N, F) (NaN: unscorable); checked to be a 2-D tensor."""
    import torch

    rewards = super(owner, trainer)._calculate_rewards(*args, **kwargs)
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 2:
        raise TrlInternalsChanged(f"GRPOTrainer._calculate_rewards returned {type(rewards).__name__}"
                                  f"{tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else ''}, expected the "
                                  "(N, F) tensor of rewards per function gathered over processes")
    return rewards


def advantage_settings(trainer: Any) -> dict[str, Any]:
    """What TRL 1.16's advantage formula reads (``_generate_and_score_completions``, training): the reward weights,
    the group size and the two modes, as :func:`trl_rollout_corr.core.group_baseline.group_advantages` takes them."""
    try:
        return dict(reward_weights=trainer.reward_weights, num_generations=trainer.num_generations,
                    scale_rewards=trainer.scale_rewards, aggregation=trainer.multi_objective_aggregation)
    except AttributeError as error:
        raise TrlInternalsChanged(f"GRPOTrainer no longer has {error.name!r}, which its advantage formula read in "
                                  "TRL 1.16") from None


def save_checkpoint(trainer: Any, owner: type, model: Any, trial: Any) -> None:
    """``Trainer._save_checkpoint(model, trial)``, as TRL's trainer inherits it."""
    super(owner, trainer)._save_checkpoint(model, trial)


def gradient_checkpointing_disabled(model: Any, gradient_checkpointing_kwargs: dict | None) -> Any:
    """TRL's context that switches gradient checkpointing off for a no-grad forward."""
    from trl.models.utils import disable_gradient_checkpointing

    return disable_gradient_checkpointing(model, gradient_checkpointing_kwargs)


def config_model_id(config: Any) -> str:
    """The model id TRL names a default ``output_dir`` after."""
    from trl.trainer.utils import get_config_model_id

    return get_config_model_id(config)
