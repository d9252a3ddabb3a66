"""The main job (``trl-rollout-corr``, ``trl-rollout-corr demo``): :mod:`.truncation`, on :mod:`.task`.

Measure (the probe), decide (the verdict row the run falls on), train TRL's default next to what the row recommends,
watch (the trainer's advice, the monitor), and a picture: on the ``truncating-sampler`` row, on vLLM's CPU engine.
:mod:`.run` holds the command (the earlier demo's worker, ``run_worker``, is ``experiments/harness.py`` now).

Apart from the library: nothing in ``trl_rollout_corr`` outside this package and the CLI's ``demo`` command imports
it (tests/repo/test_layers.py).
"""


def run_demo_cli(argv):
    from .run import run_demo_cli as run

    return run(argv)
