"""The project's toy task, for tests, benchmarks, examples and the CPU demo (no download).

``toy_task``: a locally built Qwen2-style model, a word-level tokenizer and the verifiable "reverse the digits" task
with its reward. The library proper (trainers, ``train``) does not need it; ``train --reward_funcs reverse_reward``
names its reward.
"""
