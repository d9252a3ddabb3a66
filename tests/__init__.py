"""The tests, a package tree mirroring trl_rollout_corr/ (docs/testing.md): every test module has a
unique dotted name (tests.core.test_x), helpers live in tests/support/."""
