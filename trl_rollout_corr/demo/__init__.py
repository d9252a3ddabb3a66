"""The CPU demo and its tiny task (a locally built model, a tokenizer and a verifiable reward; no download).

Apart from the library: nothing in ``trl_rollout_corr`` outside this package and the CLI imports it.
``run`` the demo (``trl-rollout-corr demo``); ``tiny`` the model, tokenizer, task and reward it trains on.
"""


def run_demo_cli(argv):
    from .run import run_demo_cli as run

    return run(argv)
