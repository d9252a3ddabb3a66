"""Rule-based rewards of this package (``train --reward_funcs math_answer_reward`` names this one)."""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")


def _last_number(text: str) -> str | None:
    if "####" in text:
        text = text.split("####")[-1]
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None


def math_answer_reward(completions, answer, **_) -> list[float]:
    """1.0 when the last number of the completion equals the reference's final number (GSM8K-style ``#### n``)."""
    rewards = []
    for completion, ref in zip(completions, answer):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        got, want = _last_number(text), _last_number(str(ref))
        rewards.append(1.0 if got is not None and got == want else 0.0)
    return rewards

