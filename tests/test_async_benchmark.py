"""The asynchronous-trainer table (docs/async.md) is the benchmark's: ``benchmarks/results/async_staleness_results.csv``
is the output of ``python benchmarks/async_staleness.py ... --results`` (the command is on that page). Checked: the
page's table is what the benchmark's own ``markdown`` generates from it; >= 5 seeds per row, TRL's trainer as is
at both staleness bounds; the statistics follow from the per-seed values (an independent recomputation)."""

import math
import os
from statistics import fmean, stdev, variance

import pytest

from bench_utils import doc_block, load_benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results", "async_staleness_results.csv")
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def bench():
    return load_benchmark("async_staleness")


@pytest.fixture(scope="module")
def rows():
    return bench().read_results(RESULTS)


def test_docs_table_is_generated_from_the_results(rows):
    assert doc_block("async-table", "docs/async.md") == bench().markdown(rows)


def test_trl_s_trainer_at_both_bounds_and_five_seeds_per_row(rows):
    assert {r["max_staleness"] for r in rows if r["variant"] == "trl_as_is"} >= {4, 16}
    for r in rows:
        assert r["n_seeds"] >= 5 and len(r["per_seed"].split()) == r["n_seeds"], r["variant"]


def test_recomputed_statistics_match_the_csv(rows):
    by = {(r["variant"], r["max_staleness"]): [float(x) for x in r["per_seed"].split()] for r in rows}
    for r in rows:
        xs = by[(r["variant"], r["max_staleness"])]
        assert r["reward_mean"] == pytest.approx(fmean(xs), abs=1e-6)
        assert r["reward_ci95"] == pytest.approx(T975[len(xs) - 1] * stdev(xs) / math.sqrt(len(xs)), rel=1e-4)
        base = by.get(("trl_as_is", r["max_staleness"] or 4))
        if r["variant"] == "trl_as_is":
            assert math.isnan(r["vs_trl_as_is"])
            continue
        assert r["vs_trl_as_is"] == pytest.approx(fmean(xs) - fmean(base), abs=1e-6)
        va, vb = variance(xs) / len(xs), variance(base) / len(base)
        dof = (va + vb) ** 2 / (va ** 2 / (len(xs) - 1) + vb ** 2 / (len(base) - 1))
        assert r["vs_trl_as_is_ci95"] == pytest.approx(T975[max(1, round(dof))] * math.sqrt(va + vb), rel=1e-4)
