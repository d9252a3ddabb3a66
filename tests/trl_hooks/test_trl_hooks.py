"""Hooks that cannot drift: every assumption about TRL's internals fails loudly, naming TRL's version, when broken.

Each test breaks one assumption the way a TRL release could (call order, an extra or a missing forward, the result
of ``_generate``, the loss not asking for the forward, keys lost in buffering, the signature of
``_generate_single_turn``, the async trainer's forward timer, the vLLM weight iterator, the vLLM generation's methods
this package replaces, its client's requests session) and expects TrlInternalsChanged.
"""

from __future__ import annotations

import inspect
import re
from collections import defaultdict
from types import SimpleNamespace
from unittest.mock import patch

import pytest
import torch
import trl
from trl import GRPOConfig, GRPOTrainer

import trl_rollout_corr.grpo.trainer as trainer_module
from tests.grpo.test_trl_equivalence import LOSS_TYPES, ROWS, TOK, build, one_micro_batch
from tests.support.trainer_utils import tiny_model_dir
from trl_rollout_corr import RolloutCorrGRPOTrainer
from trl_rollout_corr.testing.toy_task import build_model
from trl_rollout_corr.trl_hooks import TrlInternalsChanged
from trl_rollout_corr.trl_hooks.grpo import (GENERATE_RESULT_FIELDS, KEPT_TOKEN_NORMALIZER_LOSSES, forward_input_names,
                                             unpack_generate_result)

VERSION = re.escape(f"installed TRL {trl.__version__}")


def trainer(tmp_path, **overrides):
    return build(RolloutCorrGRPOTrainer, tmp_path, build_model(hidden_size=32), **overrides)


def test_forward_inputs_are_read_from_trl():
    """The model inputs TRL's loss passes to the forward are exactly the names read from its signature."""
    source = inspect.getsource(GRPOTrainer._compute_loss)
    call = source[source.index("self._get_per_token_logps_and_entropies("):]
    call = call[:call.index("\n        )")]  # the policy forward's argument list
    passed = set(re.findall(r"(\w+)=inputs\.get\(\"(\w+)\"\)", call))
    assert passed and all(a == b for a, b in passed)
    assert {a for a, _ in passed} == set(forward_input_names(RolloutCorrGRPOTrainer))


def trl_loss(args, loss_type, num_items_in_batch):
    """The installed TRL's own ``GRPOTrainer._compute_loss`` (called unbound) on a stand-in trainer with TRL's default
    config and a crafted micro-batch of 2 completions x 3 tokens (one padded): no model, the forward is given."""
    logps = torch.tensor([[-0.5, -1.0, -1.5], [-0.25, -0.75, -2.0]])  # (B, T)
    stand_in = SimpleNamespace(
        args=args, loss_type=loss_type, importance_sampling_level="token", beta=0.0, use_vllm=False,
        epsilon_low=args.epsilon, epsilon_high=args.epsilon, max_completion_length=args.max_completion_length,
        top_entropy_quantile=args.top_entropy_quantile, off_policy_mask_threshold=None, aux_loss_enabled=False,
        _entropy_bonus_enabled=False, current_gradient_accumulation_steps=1, model=SimpleNamespace(training=True),
        _metrics=defaultdict(lambda: defaultdict(list)), get_gamma_weights=GRPOTrainer.get_gamma_weights,
        accelerator=SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x),
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logps, torch.ones_like(logps), None))
    inputs = {"prompt_ids": torch.zeros(2, 1, dtype=torch.long), "prompt_mask": torch.ones(2, 1, dtype=torch.long),
              "completion_ids": torch.zeros(2, 3, dtype=torch.long),
              "completion_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]), "advantages": torch.tensor([1.0, -0.5]),
              "num_items_in_batch": torch.tensor(float(num_items_in_batch))}
    return GRPOTrainer._compute_loss(stand_in, None, inputs)


def test_the_kept_token_normalizer_losses_are_those_whose_trl_loss_divides_by_num_items_in_batch(tmp_path):
    """Checked against TRL's behaviour, not its source: for every loss type, TRL's loss with num_items_in_batch = 2
    and = 8. Those that divide by it are exactly 4 times larger at 2; the others are unchanged."""
    help_text = GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    supported = re.search(r"Supported values are (.*?)\. ", help_text).group(1)
    assert set(re.findall(r"'(\w+)'", supported)) == set(LOSS_TYPES)  # every TRL loss type is tried
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    dividing = []
    for loss_type in LOSS_TYPES:
        at_2, at_8 = trl_loss(args, loss_type, 2), trl_loss(args, loss_type, 8)
        assert torch.isfinite(at_2) and at_2 != 0, loss_type
        if not torch.equal(at_2, at_8):
            assert torch.equal(at_2, 4 * at_8), (loss_type, at_2, at_8)  # divided by it, exactly
            dividing.append(loss_type)
    assert tuple(sorted(dividing)) == KEPT_TOKEN_NORMALIZER_LOSSES


def test_a_pi_old_forward_trl_no_longer_makes_is_an_error(tmp_path, monkeypatch):
    t = trainer(tmp_path, preset="ppo_is_bypass", num_iterations=2)  # TRL runs its pi_old forward here
    one_micro_batch(t, ROWS[:8])  # the expected call happens: fine
    monkeypatch.setattr(trainer_module, "trl_runs_pi_old_forward", lambda trainer: False)
    with pytest.raises(TrlInternalsChanged, match=f"unexpected forward.*{VERSION}"):
        one_micro_batch(t, ROWS[:8])


def test_a_missing_pi_old_forward_is_an_error(tmp_path, monkeypatch):
    t = trainer(tmp_path, preset="ppo_is_bypass")  # TRL runs no pi_old forward here
    monkeypatch.setattr(trainer_module, "trl_runs_pi_old_forward", lambda trainer: True)
    with pytest.raises(TrlInternalsChanged, match=f"did not request the pi_old forward.*{VERSION}"):
        one_micro_batch(t, ROWS[:8])


def test_a_reference_forward_in_place_of_pi_old_is_an_error(tmp_path_factory, monkeypatch):
    model_dir = tiny_model_dir(tmp_path_factory.mktemp("model"))
    t = build(RolloutCorrGRPOTrainer, tmp_path_factory.mktemp("run"), model_dir, preset="ppo_is_bypass", beta=0.04)
    one_micro_batch(t, ROWS[:8])  # the reference forward only: fine
    monkeypatch.setattr(trainer_module, "trl_runs_pi_old_forward", lambda trainer: True)  # TRL's order changed
    with pytest.raises(TrlInternalsChanged, match=f"forward of .* where this package expects the pi_old.*{VERSION}"):
        one_micro_batch(t, ROWS[:8])


def test_trls_generate_returns_the_fields_named_and_a_changed_result_is_an_error(tmp_path, monkeypatch):
    """TRL's real ``_generate`` result (rollout_func path, with an env_mask) is GENERATE_RESULT_FIELDS in order, each
    field the value it names; a result with one field less raises."""
    t = trainer(tmp_path, env_mask=True)
    original, results, rollouts = GRPOTrainer._generate, [], []
    rollout_func = t.rollout_func
    t.rollout_func = lambda prompts, trainer: rollouts.append(rollout_func(prompts, trainer)) or rollouts[-1]

    def generate_returning_one_field_less(self, prompts):
        results.append(original(self, prompts))
        return results[-1][:7]

    monkeypatch.setattr(GRPOTrainer, "_generate", generate_returning_one_field_less)
    with pytest.raises(TrlInternalsChanged, match=f"_generate returned tuple of length 7.*{VERSION}"):
        one_micro_batch(t, ROWS[:8])
    (result,), (rollout,) = results, rollouts
    assert isinstance(result, tuple) and len(result) == len(GENERATE_RESULT_FIELDS)
    fields = dict(zip(GENERATE_RESULT_FIELDS, result))
    assert fields["prompt_ids"] == rollout["prompt_ids"]
    assert fields["completion_ids"] == rollout["completion_ids"]
    assert fields["tool_mask"] == rollout["env_mask"]
    assert fields["completions"] == TOK.batch_decode(rollout["completion_ids"], skip_special_tokens=True)
    assert fields["logprobs"] == rollout["logprobs"]
    assert fields["extra_fields"] == {}  # env_mask became the tool mask
    assert fields["images"] is None and fields["tool_images"] == []
    assert len({repr(value) for value in result}) == len(result)  # no two fields alike: the order is pinned


def test_a_generate_result_of_other_types_is_an_error():
    result = dict.fromkeys(GENERATE_RESULT_FIELDS, [])
    assert unpack_generate_result(tuple(result.values())) == result
    with pytest.raises(TrlInternalsChanged, match=f"completion_ids of type Tensor.*{VERSION}"):
        unpack_generate_result(tuple({**result, "completion_ids": torch.zeros(2, 3)}.values()))


def test_the_cached_forward_is_handed_over_once_and_only_for_the_same_tensors(tmp_path, monkeypatch):
    t = trainer(tmp_path, preset="decoupled_token_is")
    batch = one_micro_batch(t, ROWS[:8])
    seen = []
    original = GRPOTrainer._compute_loss

    def compute_loss_with_an_extra_forward(self, model, inputs):
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)  # (B, P+T)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)  # (B, P+T)
        # same shapes, same model, other rows: must not be answered with the cached forward of this micro-batch
        other = self._get_per_token_logps_and_entropies(model, ids.flip(0), mask.flip(0),
                                                         inputs["completion_ids"].size(1))
        seen.append(other)
        return original(self, model, inputs)

    monkeypatch.setattr(GRPOTrainer, "_compute_loss", compute_loss_with_an_extra_forward)
    loss = t.compute_loss(t.model, batch)
    assert torch.isfinite(loss)
    # matched without a host sync (same shapes): the values are compared on the device and read at the next log
    assert len(seen) == 1 and seen[0][1] is not None  # the cached forward (entropies asked) answered it
    with pytest.raises(TrlInternalsChanged, match=f"same shape but other values.*{VERSION}"):
        t.log({})


def test_the_cached_forward_is_matched_without_a_host_sync(tmp_path):
    """Two micro-batches: no host sync in the forward matching (torch.equal was one per micro-batch); the log's
    one transfer finds no mismatch."""
    from benchmarks.profiling import count_host_syncs

    t = trainer(tmp_path, preset="decoupled_token_is")
    batch = one_micro_batch(t, ROWS[:8])
    with count_host_syncs() as syncs, patch.object(torch, "equal", side_effect=AssertionError("torch.equal")):
        for _ in range(2):
            assert torch.isfinite(t.compute_loss(t.model, batch))
    assert sum(syncs.values()) == 0, dict(syncs)
    logs = {}
    t.log(logs)  # the deferred check passes: TRL asked for the same values
    assert "rollout_corr/kl" in logs


def test_a_loss_that_does_not_ask_for_the_forward_is_an_error(tmp_path, monkeypatch):
    t = trainer(tmp_path, preset="decoupled_token_is")
    batch = one_micro_batch(t, ROWS[:8])
    monkeypatch.setattr(GRPOTrainer, "_compute_loss", lambda self, model, inputs: torch.zeros((), requires_grad=True))
    with pytest.raises(TrlInternalsChanged, match=f"did not request the micro-batch's policy forward.*{VERSION}"):
        t.compute_loss(t.model, batch)


def test_correction_lost_in_buffering_is_an_error(tmp_path, monkeypatch):
    import trl.trainer.grpo_trainer as grpo

    t = trainer(tmp_path, preset="decoupled_token_is", num_iterations=2)  # corrected at generation time
    original = grpo.split_tensor_dict
    monkeypatch.setattr(grpo, "split_tensor_dict", lambda d, n: [
        {k: v for k, v in part.items() if not k.startswith("rc_")} for part in original(d, n)])
    batch = one_micro_batch(t, ROWS[:8])
    with pytest.raises(TrlInternalsChanged,
                       match=f"rc_rollout_seen, rc_keep_mask.*did not reach compute_loss.*{VERSION}"):
        t.compute_loss(t.model, batch)


def test_a_changed_generate_single_turn_signature_is_an_error_not_a_type_error(monkeypatch):
    """TRL calling ``_generate_single_turn`` with other arguments reaches the override's check, not a TypeError."""
    def single_turn_with_other_arguments(self, prompts, num_generations):
        return [[1]], None

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", single_turn_with_other_arguments)
    bare = object.__new__(RolloutCorrGRPOTrainer)
    bare.__dict__["use_vllm"] = True
    with pytest.raises(TrlInternalsChanged, match=f"GRPOTrainer._generate_single_turn takes \\['self', 'prompts', "
                                                  f"'num_generations'\\].*written for.*{VERSION}"):
        bare._generate_single_turn(["p"], 2)


def test_the_async_forward_timer_and_the_vllm_weight_iterator_are_checked():
    from types import SimpleNamespace

    from trl_rollout_corr.trl_hooks.async_grpo import add_forward_time
    from trl_rollout_corr.trl_hooks.vllm import named_parameters

    timed = SimpleNamespace(_step_forward_s=0.5)
    add_forward_time(timed, 1.0)
    assert timed._step_forward_s == 1.5
    with pytest.raises(TrlInternalsChanged, match=f"no float _step_forward_s.*{VERSION}"):
        add_forward_time(SimpleNamespace(), 1.0)
    assert list(named_parameters(SimpleNamespace(_iter_named_params=lambda: iter([("w", 1)])))) == [("w", 1)]
    with pytest.raises(TrlInternalsChanged, match=f"_iter_named_params is gone.*{VERSION}"):
        named_parameters(SimpleNamespace())


def test_the_vllm_generation_methods_replaced_are_checked():
    """``sync_weights`` / ``generate`` on TRL's ``VLLMGeneration`` instance: replaced or wrapped when there (and, for
    ``sync_weights``, still called with no argument), TrlInternalsChanged when gone or changed; vllm/engine.py goes
    through these checks (its sync schedule on a stand-in without ``sync_weights``)."""
    from types import SimpleNamespace

    from trl_rollout_corr.trl_hooks.vllm import replace_vllm_generation_method, wrap_vllm_generation_method
    from trl_rollout_corr.vllm.engine import _install_sync_schedule

    class Generation:  # TRL's VLLMGeneration, as far as these checks look
        def sync_weights(self):
            return "trl's sync"

        def generate(self, prompts, images, num_generations, profiler=None):
            return prompts

    gen = Generation()
    wrap_vllm_generation_method(gen, "sync_weights", lambda sync: lambda: ("scheduled", sync()))
    assert gen.sync_weights() == ("scheduled", "trl's sync")
    wrap_vllm_generation_method(gen, "generate", lambda generate: lambda *a, **kw: ("guarded", generate(*a, **kw)))
    assert gen.generate(["p"], None, 2) == ("guarded", ["p"])
    replace_vllm_generation_method(gen, "sync_weights", lambda: "file sync")
    assert gen.sync_weights() == "file sync"
    with pytest.raises(ValueError, match="'llm' is not one of"):
        replace_vllm_generation_method(gen, "llm", lambda: None)

    for name in ("sync_weights", "generate"):
        with pytest.raises(TrlInternalsChanged, match=f"SimpleNamespace.{name} is gone.*{VERSION}"):
            replace_vllm_generation_method(SimpleNamespace(), name, lambda: None)
        with pytest.raises(TrlInternalsChanged, match=f"SimpleNamespace.{name} is gone.*{VERSION}"):
            wrap_vllm_generation_method(SimpleNamespace(**{name: None}), name, lambda method: method)

    class SyncWithAnArgument:  # TRL calling sync_weights(model): the no-argument replacements would break
        def sync_weights(self, model):
            pass

    with pytest.raises(TrlInternalsChanged, match=f"SyncWithAnArgument.sync_weights takes \\['model'\\]; its "
                                                  f"replacement was written for \\[\\].*{VERSION}"):
        replace_vllm_generation_method(SyncWithAnArgument(), "sync_weights", lambda: None)
    untouched = SimpleNamespace(mode="colocate")
    with pytest.raises(TrlInternalsChanged, match=f"sync_weights is gone.*{VERSION}"):
        _install_sync_schedule(SimpleNamespace(vllm_generation=untouched), 2)
    assert vars(untouched) == {"mode": "colocate"}


def test_what_is_read_of_trl_s_vllm_generation_is_checked():
    """``trainer.vllm_generation`` (its mode), the colocated ``LLM`` and the server's ``VLLMClient``: each read
    through trl_hooks/vllm.py, TrlInternalsChanged naming TRL's version when TRL's object no longer has it."""
    from types import SimpleNamespace

    from trl_rollout_corr.trl_hooks.vllm import colocated_llm, server_client, vllm_generation

    gen = SimpleNamespace(mode="server", vllm_client=SimpleNamespace(base_url="http://127.0.0.1:8000"),
                          llm=SimpleNamespace(llm_engine=object()))
    trainer = SimpleNamespace(vllm_generation=gen)
    assert vllm_generation(trainer) is gen and server_client(gen) is gen.vllm_client and colocated_llm(gen) is gen.llm
    for broken, read, message in (
            (SimpleNamespace(), vllm_generation, "GRPOTrainer.vllm_generation is NoneType with mode None"),
            (SimpleNamespace(vllm_generation=SimpleNamespace(mode="remote")), vllm_generation,
             "with mode 'remote': expected TRL's VLLMGeneration"),
            (SimpleNamespace(llm=None), colocated_llm, "SimpleNamespace.llm is NoneType, not vLLM's LLM"),
            (SimpleNamespace(vllm_client=SimpleNamespace()), server_client,
             "SimpleNamespace.vllm_client is SimpleNamespace without a base_url")):
        with pytest.raises(TrlInternalsChanged, match=f"{message}.*{VERSION}"):
            read(broken)


def test_the_vllm_client_session_is_checked():
    """TRL's ``VLLMClient.session``: a requests.Session, on which the package sends its requests and mounts its
    adapter; TrlInternalsChanged when it is gone or something else. vllm/engine.py mounts through the check."""
    from types import SimpleNamespace

    import requests
    from requests.adapters import HTTPAdapter

    from trl_rollout_corr.trl_hooks.vllm import client_session, mount_client_adapter
    from trl_rollout_corr.vllm.engine import _bound_server_requests

    client = SimpleNamespace(session=requests.Session())
    assert client_session(client) is client.session
    adapter = HTTPAdapter()
    mount_client_adapter(client, adapter)
    assert client.session.get_adapter("http://127.0.0.1:8000/x") is adapter
    assert client.session.get_adapter("https://example.org/x") is adapter
    _bound_server_requests(client, 30.0)
    assert client.session.get_adapter("http://127.0.0.1:8000/x") is not adapter

    class HttpxLikeSession:  # a client that moved to another HTTP library
        def get(self, url, **kwargs): ...
        def post(self, url, **kwargs): ...
        def mount(self, prefix, transport): ...

    for broken in (SimpleNamespace(), SimpleNamespace(session=HttpxLikeSession())):
        with pytest.raises(TrlInternalsChanged, match=f"SimpleNamespace.session is \\w+, not a requests.Session.*"
                                                      f"{VERSION}"):
            client_session(broken)
        with pytest.raises(TrlInternalsChanged, match=f"not a requests.Session.*{VERSION}"):
            mount_client_adapter(broken, adapter)
        with pytest.raises(TrlInternalsChanged, match=f"not a requests.Session.*{VERSION}"):
            _bound_server_requests(broken, 30.0)


def test_a_hook_trl_no_longer_defines_is_an_error_at_construction(tmp_path, monkeypatch):
    """A private method the trainer overrides, renamed in TRL, would never be called: construction fails instead."""
    from trl_rollout_corr.trl_hooks.grpo import check_hooks

    check_hooks(RolloutCorrGRPOTrainer, RolloutCorrGRPOTrainer)
    monkeypatch.delattr(GRPOTrainer, "_generate_and_score_completions")
    with pytest.raises(TrlInternalsChanged, match=f"defines _generate_and_score_completions.*{VERSION}"):
        trainer(tmp_path, preset="decoupled_token_is")
