"""The experiments beside the library (README.md here): each script is run as ``python experiments/<name>.py`` (or
``python -m experiments.<name>``); a package so that tests and scripts can do ``from experiments import stats``.
Nothing in ``trl_rollout_corr`` imports it."""
