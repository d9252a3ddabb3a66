"""The transformers-path capture of pi_rollout (trl_rollout_corr.rollout.capture).

Reference for every log-prob check: what the capture used to do, ``generate(output_scores=True,
return_dict_in_generate=True)`` and log_softmax of the kept processed scores at the sampled token, computed here from
the same seeded run (same tokens), independently of the capture's hooks.
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from transformers import GenerationConfig, GenerationMixin, LogitsProcessor, LogitsProcessorList, Qwen2ForCausalLM

from trl_rollout_corr.rollout.capture import capture_sampling_logprobs
from trl_rollout_corr.rollout.emulated import EmulatedRolloutEngine
from trl_rollout_corr.testing.toy_task import build_model

PROMPT_LEN, BATCH = 5, 6


@pytest.fixture(scope="module")
def model():
    return build_model(hidden_size=32).eval()


@pytest.fixture(scope="module")
def prompt():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 16, (BATCH, PROMPT_LEN), generator=g)  # (B, P)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def sampling_config(**overrides) -> GenerationConfig:
    return GenerationConfig(**{"do_sample": True, "max_new_tokens": 12, "pad_token_id": 0, "eos_token_id": 1,
                               **overrides})


def reference_logprobs(generate, prompt, config, seed):
    """The output_scores way: keep every step's processed scores, then log_softmax(z_t)[a_t].   (B, S)"""
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = generate(**prompt, generation_config=config, output_scores=True, return_dict_in_generate=True)
    generated = out.sequences[:, PROMPT_LEN:]  # (B, S)
    logprobs = torch.stack([torch.log_softmax(z.double(), -1)[torch.arange(len(z)), generated[:, t]]
                            for t, z in enumerate(out.scores)], dim=1)  # (B, S)
    return out.sequences, logprobs


def assert_same_logprobs(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == torch.float32
    finite = torch.isfinite(want)  # -inf: a pad token after EOS that top-k/p removed; must stay -inf
    assert torch.equal(torch.isfinite(got), finite)
    assert torch.equal(got[~finite], want[~finite].float())
    assert (got.double()[finite] - want[finite]).abs().max().item() <= 1e-6


SETTINGS = {
    "plain": {},
    "temperature": {"temperature": 0.7},
    "top_k": {"top_k": 5},
    "top_p": {"top_p": 0.8},
    "min_p": {"min_p": 0.1},
    "repetition_penalty": {"repetition_penalty": 1.3},
    "all": {"temperature": 0.7, "top_k": 8, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.3},
    "greedy": {"do_sample": False, "temperature": None},
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_capture_equals_output_scores_reference(model, prompt, setting):
    config = sampling_config(**SETTINGS[setting])
    sequences, want = reference_logprobs(model.generate, prompt, config, seed=1)
    torch.manual_seed(1)
    with capture_sampling_logprobs(model) as captured:
        out = model.generate(**prompt, generation_config=config)
    assert isinstance(out, torch.Tensor) and torch.equal(out, sequences)  # the return value is generate's own
    assert_same_logprobs(captured["logprobs"], want)


@pytest.mark.parametrize("kind", ["stale", "bf16", "int8", "wq4"])
def test_capture_with_emulated_engines(model, prompt, kind):
    engine = EmulatedRolloutEngine(kind, lag=1)
    engine.sync(model, step=0)
    config = sampling_config(**SETTINGS["all"])
    sequences, want = reference_logprobs(engine.generate, prompt, config, seed=2)
    torch.manual_seed(2)
    with capture_sampling_logprobs(model, engine.generate) as captured:
        out = model.generate(**prompt, generation_config=config)
    assert torch.equal(out, sequences)
    assert_same_logprobs(captured["logprobs"], want)


def test_caller_asking_for_a_generate_output_gets_it(model, prompt):
    """A caller's own output_scores / return_dict_in_generate still work; aligned on the same run's scores."""
    torch.manual_seed(4)
    with capture_sampling_logprobs(model) as captured, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(**prompt, generation_config=sampling_config(**SETTINGS["all"]), output_scores=True,
                             return_dict_in_generate=True)
    generated = out.sequences[:, PROMPT_LEN:]  # (B, S)
    want = torch.stack([torch.log_softmax(z.double(), -1)[torch.arange(len(z)), generated[:, t]]
                        for t, z in enumerate(out.scores)], dim=1)  # (B, S)
    assert_same_logprobs(captured["logprobs"], want)


class CountScoreBuffers(LogitsProcessor):
    """A user processor (it runs mid-chain, before the capture's): counts live (B, V) tensors at every step."""

    def __init__(self, shape):
        self.shape, self.counts = tuple(shape), []

    def __call__(self, input_ids, scores):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            live = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.shape == self.shape]
            self.counts.append(len(live))
        return scores


def test_capture_keeps_at_most_one_score_buffer(model, prompt):
    """Old capture (output_scores): step t sees t + const live (B, V) tensors; now at most plain generate's + 1."""
    config = sampling_config(max_new_tokens=12, min_new_tokens=12, temperature=0.7)
    shape = (BATCH, model.config.vocab_size)

    def counts(capture: bool):
        probe = CountScoreBuffers(shape)
        with capture_sampling_logprobs(model) if capture else torch.no_grad():
            model.generate(**prompt, generation_config=config, logits_processor=LogitsProcessorList([probe]))
        return probe.counts

    plain, captured = counts(capture=False), counts(capture=True)
    assert len(captured) == 12
    assert max(captured) <= max(plain) + 1, (plain, captured)


# ---------------------------------------------------------------- plain tensors, instance generate, beam search
class PlainTensorGenerate(Qwen2ForCausalLM):
    """A custom generate that always returns a plain tensor (remote-code / wrapped generate style)."""

    def generate(self, *args, **kwargs):
        out = super().generate(*args, **kwargs)
        return out if isinstance(out, torch.Tensor) else out.sequences


def plain_tensor_copy(model):
    custom = PlainTensorGenerate(model.config).eval()
    custom.load_state_dict(model.state_dict())
    custom.generation_config = model.generation_config
    return custom


def test_generate_returning_a_plain_tensor(model, prompt):
    custom = plain_tensor_copy(model)
    config = sampling_config(**SETTINGS["all"])
    sequences, want = reference_logprobs(model.generate, prompt, config, seed=3)
    torch.manual_seed(3)
    with capture_sampling_logprobs(custom) as captured:
        out = custom.generate(**prompt, generation_config=config)
    assert torch.equal(out, sequences)
    assert_same_logprobs(captured["logprobs"], want)


def test_generate_that_bypasses_transformers_leaves_every_row_unseen(model, prompt):
    fixed = torch.cat([prompt["input_ids"], torch.full((BATCH, 3), 5)], dim=1)  # (B, P + 3)
    model.generate = lambda *args, **kwargs: fixed  # a mock: never reaches GenerationMixin.generate
    try:
        with capture_sampling_logprobs(model) as captured:
            assert model.generate(**prompt) is fixed  # passed through unchanged
        assert captured["logprobs"].shape == (BATCH, 3) and captured["logprobs"].isnan().all()
    finally:
        del model.generate


def test_rows_whose_tokens_were_changed_after_sampling_are_unseen(model, prompt):
    """A wrapper that edits the sampled tokens: those rows' captured log-probs belong to other tokens (NaN)."""
    def editing_generate(*args, **kwargs):
        out = type(model).generate(model, *args, **kwargs).clone()  # (B, P + S)
        out[1, PROMPT_LEN] = (out[1, PROMPT_LEN] + 1) % 16  # a different first token in row 1
        return out

    model.generate = editing_generate
    try:
        torch.manual_seed(0)
        with capture_sampling_logprobs(model) as captured:
            model.generate(**prompt, generation_config=sampling_config())
    finally:
        del model.generate
    unseen = captured["logprobs"].isnan().all(-1)  # (B,)
    assert unseen.tolist() == [i == 1 for i in range(BATCH)]
    _, want = reference_logprobs(model.generate, prompt, sampling_config(), seed=0)
    assert_same_logprobs(captured["logprobs"][~unseen], want[~unseen])


def test_user_instance_generate_is_called_and_restored(model, prompt):
    calls = []

    def user_generate(*args, **kwargs):  # e.g. another library's wrapper on the instance
        calls.append(1)
        return type(model).generate(model, *args, **kwargs)

    model.generate = user_generate
    try:
        with capture_sampling_logprobs(model) as captured:
            model.generate(**prompt, generation_config=sampling_config())
        assert calls and captured["logprobs"].shape[0] == BATCH
        assert vars(model)["generate"] is user_generate
        with pytest.raises(ZeroDivisionError), capture_sampling_logprobs(model):
            raise ZeroDivisionError
        assert vars(model)["generate"] is user_generate
    finally:
        del model.generate
    with capture_sampling_logprobs(model):
        pass
    assert "generate" not in vars(model)  # a model without one gets its class method back
    assert GenerationMixin._get_logits_processor.__name__ == "_get_logits_processor"  # hooks removed


@pytest.mark.parametrize("where", ["call", "generation_config", "model_default"])
def test_beam_search_is_refused(model, prompt, where):
    config = sampling_config(**({"num_beams": 2} if where == "generation_config" else {}))
    kwargs = {"num_beams": 2} if where == "call" else {}
    saved = model.generation_config.num_beams
    if where == "model_default":
        model.generation_config.num_beams = 2
    try:
        with capture_sampling_logprobs(model), pytest.raises(ValueError, match="num_beams=2: beam search"):
            model.generate(**prompt, generation_config=config, **kwargs)
    finally:
        model.generation_config.num_beams = saved


def test_model_overriding_the_chain_builder_is_refused(model, prompt):
    class ExtraProcessor(Qwen2ForCausalLM):
        def _get_logits_processor(self, *args, **kwargs):
            processors = super()._get_logits_processor(*args, **kwargs)
            processors.append(lambda input_ids, scores: scores)  # would run after the capture's
            return processors

    custom = ExtraProcessor(model.config).eval()
    custom.generation_config = model.generation_config
    with capture_sampling_logprobs(custom), pytest.raises(RuntimeError, match="overrides _get_logits_processor"):
        custom.generate(**prompt, generation_config=sampling_config())


# ---------------------------------------------------------------------------------------------- through the trainer
def test_trainer_with_plain_tensor_generate_and_user_instance_generate(tmp_path):
    from tests.support.trainer_utils import make_trainer

    policy = plain_tensor_copy(build_model(hidden_size=32))
    calls = []

    def user_generate(*args, **kwargs):
        calls.append(1)
        return PlainTensorGenerate.generate(policy, *args, **kwargs)

    policy.generate = user_generate
    trainer, collector = make_trainer(tmp_path, model=policy, preset="decoupled_token_is", max_steps=1)
    trainer.train()
    assert calls and vars(policy)["generate"] is user_generate  # used for the rollout, still there afterwards
    log = [entry for entry in collector.logs if "loss" in entry][0]
    # on-policy fp32: the captured pi_rollout is the trainer's pi_old, token by token
    assert abs(log["rollout_corr/kl"]) < 1e-5 and log["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-4)


def test_trainer_refuses_beam_search(tmp_path):
    """generation_kwargs' num_beams is refused when the trainer is built; the model's own generation_config at the
    first rollout (generate merges it in), by the capture."""
    from tests.support.trainer_utils import make_trainer

    with pytest.raises(ValueError, match="num_beams=2: beam search"):
        make_trainer(tmp_path, preset="decoupled_token_is", max_steps=1, generation_kwargs={"num_beams": 2})
    trainer, _ = make_trainer(tmp_path, preset="decoupled_token_is", max_steps=1)
    trainer.accelerator.unwrap_model(trainer.model).generation_config.num_beams = 2
    with pytest.raises(ValueError, match="num_beams=2: beam search"):
        trainer.train()


def test_the_stale_engine_lags_exactly_k_optimizer_steps():
    policy = build_model(hidden_size=32)

    def engine_step(engine, step):
        with torch.no_grad():
            policy.lm_head.weight.fill_(float(step))  # the policy of optimizer step `step`, recognizable
        engine.sync(policy, step)
        engine.sync(policy, step)  # a second generation within the same step changes nothing
        return engine._engine.lm_head.weight[0, 0].item()

    every_step = EmulatedRolloutEngine("stale", lag=2)
    assert [engine_step(every_step, s) for s in range(7)] == [0, 0, 0, 1, 2, 3, 4]
    every_other = EmulatedRolloutEngine("stale", lag=3)  # generations at even steps only: the newest at or before s-3
    assert [engine_step(every_other, s) for s in (0, 2, 4, 6, 8)] == [0, 0, 0, 2, 4]
