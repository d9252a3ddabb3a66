"""The asynchronous trainer's check that the vLLM server serves the model the trainer loads (``_check_served_model``):
a server that is not up, not JSON or not vLLM leaves the check to TRL; anything else (a bug) is not swallowed (#30)."""

from __future__ import annotations

import trl_rollout_corr  # noqa: F401  (first: its CPU-torch guard)

from types import SimpleNamespace

import pytest
import requests

from trl_rollout_corr.async_grpo.trainer import RolloutCorrAsyncGRPOTrainer, served_model_ids
from trl_rollout_corr.vllm.security import TOKEN_ENV, TOKEN_HEADER

ARGS = SimpleNamespace(vllm_server_base_url="http://127.0.0.1:1/", vllm_server_control_token_file=None)


class Answer:
    def __init__(self, body, status_code=200):
        self.body, self.status_code = body, status_code

    def json(self):
        if isinstance(self.body, Exception):
            raise self.body
        return self.body


def check(monkeypatch, answer_or_error, model="my/model"):
    def get(url, timeout, headers):
        assert url == "http://127.0.0.1:1/v1/models" and headers == {TOKEN_HEADER: "t"} and timeout > 0
        if isinstance(answer_or_error, Exception):
            raise answer_or_error
        return answer_or_error

    monkeypatch.setenv(TOKEN_ENV, "t")
    monkeypatch.setattr(requests, "get", get)
    asked = []
    monkeypatch.setattr(requests, "get", lambda *a, **k: asked.append(a) or get(*a, **k))
    RolloutCorrAsyncGRPOTrainer._check_served_model(ARGS, model)
    return len(asked)


def test_served_model_ids_reads_vllm_s_answer_and_nothing_else():
    assert served_model_ids({"object": "list", "data": [{"id": "a"}, {"id": "b"}]}) == ["a", "b"]
    for body in (None, [], "text", {"object": "list"}, {"data": "a"}, {"data": [{"name": "a"}]}, {"data": [3]},
                 {"data": [{"id": 3}]}):
        assert served_model_ids(body) is None, body


@pytest.mark.parametrize("answer", [requests.ConnectionError("refused"), requests.Timeout("slow"),
                                    Answer(ValueError("not JSON")), Answer(None, status_code=404),
                                    Answer({"object": "list"}), Answer({"data": [{"name": "x"}]})],
                         ids=["not_up", "timeout", "not_json", "404", "no_data", "no_ids"])
def test_a_server_that_is_not_up_or_not_vllm_leaves_it_to_trl(monkeypatch, answer):
    assert check(monkeypatch, answer) == 1  # asked once, then no error: TRL's own startup handles the server


def test_a_server_serving_another_model_is_a_clear_error(monkeypatch):
    with pytest.raises(ValueError, match=r"serves \['other/model'\], but the trainer loads 'my/model'"):
        check(monkeypatch, Answer({"data": [{"id": "other/model"}]}))
    check(monkeypatch, Answer({"data": [{"id": "other/model"}, {"id": "my/model"}]}))  # served: no error


@pytest.mark.parametrize("bug", [TypeError("get() got an unexpected keyword argument"), KeyError("data")],
                         ids=["TypeError", "KeyError"])
def test_a_bug_is_not_swallowed(monkeypatch, bug):
    """Only "not up" (requests' errors) and "not JSON" (ValueError) mean "leave it to TRL"."""
    with pytest.raises(type(bug)):
        check(monkeypatch, bug)
