"""check_rollout_logprobs (rollout/logprobs.py): a row of plain numbers is checked at once (no Python loop over its
tokens); every other row through the per-token loop. Both name the same first offending token."""

from __future__ import annotations

import math

import pytest
import torch

from trl_rollout_corr.rollout.logprobs import check_rollout_logprobs

IDS = [[5, 6, 7, 8, 9]]


@pytest.mark.parametrize("row,token", [
    ([-0.1, -2.0, -0.3, 0.5, 0.7], 3),  # plain floats: the vectorized check
    ([-0.1, None, -0.3, 0.5, 0.7], 3),  # an unscored token (None): the loop
    ([-1, -2, 0, 2, -1], 3),  # ints
    ([torch.tensor(-0.1), -2.0, -0.3, 0.5, 0.7], 3),  # a 0-d tensor among floats
])
def test_a_positive_log_prob_is_named_at_its_token(row, token):
    with pytest.raises(ValueError, match=rf"Sample 0, token {token}: rollout log-prob .* > 0 is not a log-prob"):
        check_rollout_logprobs(IDS, [row], "test", require=False)


@pytest.mark.parametrize("bad", [[-0.1, -0.2], "x"])
def test_a_top_k_list_or_a_string_is_not_a_float(bad):
    with pytest.raises(ValueError, match=r"Sample 0, token 2: rollout log-prob .* is not a float"):
        check_rollout_logprobs(IDS, [[-0.1, -0.2, bad, -0.3, -0.4]], "test", require=False)


def test_valid_rows_pass_through_unchanged():
    rows = [[-0.1, -2.0, -0.3, 0.0, -1e-4], [-0.1, None, float("nan"), -math.inf, 1e-4]]
    checked, seen = check_rollout_logprobs(IDS * 2, rows, "test", require=False)
    assert checked == rows and seen == [True, True]
