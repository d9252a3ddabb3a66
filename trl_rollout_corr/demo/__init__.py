"""The CPU demo (``trl-rollout-corr demo``): ``run``, on the toy task of :mod:`trl_rollout_corr.testing.toy_task`.

Apart from the library: nothing in ``trl_rollout_corr`` outside this package and the CLI's ``demo`` command imports
it (tests/repo/test_layers.py).
"""


def run_demo_cli(argv):
    from .run import run_demo_cli as run

    return run(argv)
