"""Experiment G (pre-registration 25): DPPO on a stale engine, against TRL's default run by TRL's own GRPOTrainer.

The question (issue 55): in the two scenarios where this package measured that the mismatch costs — an engine
``S2_LAG`` = 8 optimizer steps stale at T = 49 (``S2``, where ``ppo_is_bypass`` is the one confirmed row) and 16 steps
stale at T = 257 (``S2X`` at Z's lag, where TRL's default collapsed on some seeds) — does DPPO's trust region
(Qi et al., "Rethinking the Trust Region in LLM Reinforcement Learning", arXiv:2602.04879; prime-rl's default loss,
verl's ``dppo_tv`` / ``dppo_kl``) train better than TRL's default (``sequence_mask``, C = 3, by TRL's unmodified
``GRPOTrainer``)? The family: {DPPO-Binary-TV bypass (M5), DPPO-Binary-KL bypass (M6), ``ppo_is_bypass`` (M3)}, each
minus M1, Holm over the 3 within each scenario. The document, with the decision rules, is
``experiments/preregistrations/25-g-dppo-stale.md``; the constants below are the ones it fixes.

Every run is ``experiments/mismatch_train.py``'s (its task, base models, engine, score, 30 steps): this file adds the
two DPPO arms and the analysis. The reference arms M1 and M3 on the family seeds are the committed runs of experiments
C (``S2``, seeds 10-29) and Z (``S2X``, seeds 90-109): the runs are deterministic functions of (scenario, method,
seed), so each is re-run at one seed first (``G_REPRODUCE``) and must give the committed score; if either does not,
M1 and M3 run again on every seed and the re-runs are analysed instead.

    python experiments/dppo_stale.py run --scenario S2 --jobs 2          # the family arms (and the re-runs)
    python experiments/dppo_stale.py held_out --scenario S2 --jobs 2     # the rows the family leaves, and M1
    python experiments/dppo_stale.py report                              # the analysis (both scenarios)
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if not __package__:  # run as a script (python experiments/x.py): this checkout's root first, for experiments.*
    sys.path.insert(0, os.path.dirname(HERE))

from experiments import mismatch_train as mt  # noqa: E402

# -------------------- pre-registration 25: experiments/preregistrations/25-g-dppo-stale.md
G_METHODS = {  # this package's trainer, bypass mode (pi_old := pi_rollout), the presets' defaults (verl's example)
    "M5": ("ours", dict(rollout_correction_preset="dppo_tv_bypass")),  # Binary-TV, delta_low = delta_high = 0.15
    "M6": ("ours", dict(rollout_correction_preset="dppo_kl_bypass")),  # Binary-KL, delta_low = delta_high = 0.05
}
G_TEXT = {"M5": "DPPO-Binary-TV bypass (preset dppo_tv_bypass, delta 0.15)",
          "M6": "DPPO-Binary-KL bypass (preset dppo_kl_bypass, delta 0.05)"}
G_SCENARIOS = ("S2", "S2X")
G_LAG = {"S2": mt.S2_LAG, "S2X": mt.Y_LAG}  # 8 and 16 optimizer steps
G_SEEDS = {"S2": tuple(range(10, 30)), "S2X": tuple(range(90, 110))}  # experiment C's seeds; Z's first 20
G_HELD_OUT = {"S2": tuple(range(300, 310)), "S2X": tuple(range(310, 320))}  # never run in any experiment
G_COMMITTED = {"S2": "mismatch_train_confirm_results.csv", "S2X": "mismatch_train_target_z_results.csv"}
G_REUSED = ("M1", "M3")  # the committed runs (TRL's GRPOTrainer; ppo_is_bypass)
G_NEW = ("M5", "M6")
G_REPRODUCE = {"S2": 10, "S2X": 90}  # M1 and M3 re-run at this seed: must equal the committed score
G_REPRODUCE_TOL = 1e-9
G_FAMILY = {s: ((s, "M5"), (s, "M6"), (s, "M3")) for s in G_SCENARIOS}  # each - M1, Holm over the 3 per scenario
G_ALPHA = 0.05
G_DEADLINE_UTC = {"family": "12:20", "held_out": "12:45"}


RESULTS = os.path.join(HERE, "results", "dppo_stale_results.csv")
ANALYSIS = os.path.join(HERE, "results", "dppo_stale_analysis.md")
CSV_COLUMNS = ("scenario", "method", "seed", "trainer", "steps", "lr", "n_digits", "lag", "score", "initial",
               "final", "collapsed", "kl_token", "t_kl", "engine_reward", "seconds", "dppo_masked_fraction",
               "dppo_masked_fraction_pos", "dppo_masked_fraction_neg")


def out_dir(out: str, scenario: str) -> str:
    """Each scenario's runs in their own folder (mismatch_train's run paths do not name the lag)."""
    return os.path.join(out, scenario)


def _size() -> dict:
    size = mt.full_size()
    size.update(device="cpu", bf16=False, name="full")
    return size


def _use_lag(scenario: str) -> None:
    if scenario == "S2X":
        mt.X_LAG = G_LAG["S2X"]  # Z's lag (mismatch_train's --experiment Z does the same)
    assert mt.scenario_lag(scenario) == G_LAG[scenario], (scenario, mt.scenario_lag(scenario))


def _register() -> None:
    """G's arms into mismatch_train's method table, for the runs only (an import changes nothing there)."""
    mt.METHODS.update(G_METHODS)
    mt.METHOD_TEXT.update(G_TEXT)


def run_cells(scenario: str, cells: list, out: str, jobs: int) -> None:
    _register()
    _use_lag(scenario)
    size, folder = _size(), out_dir(out, scenario)
    mt.build_base(folder, mt.cell_size(scenario, size), mt.cell_base(folder, scenario, size))
    mt.run_all(cells, mt.X_STEPS, folder, jobs, size, None)


def committed(scenario: str) -> dict:
    """method -> seed -> committed row (scores as floats) of the reference arms."""
    table: dict = {}
    with open(os.path.join(HERE, "results", G_COMMITTED[scenario])) as f:
        for r in csv.DictReader(f):
            if r["scenario"] != scenario or r["method"] not in ("M1", "M3", "M0", "on_policy"):
                continue
            if r["method"] != "on_policy" and int(r["lag"]) != G_LAG[scenario]:
                continue
            table.setdefault(r["method"], {})[int(r["seed"])] = {
                "score": float(r["score"]), "kl_token": float(r["kl_token"]), "t_kl": float(r["t_kl"]),
                "collapsed": r["collapsed"] == "True", "source": G_COMMITTED[scenario]}
    return table


def runs_from_csv(path: str = RESULTS) -> list[dict]:
    """The committed runs (``RESULTS``) as run dicts: what :func:`fresh` reads instead of the JSONs (``out=None``)."""
    floats = ("score", "initial", "final", "kl_token", "t_kl", "engine_reward", "seconds", "lr",
              "dppo_masked_fraction", "dppo_masked_fraction_pos", "dppo_masked_fraction_neg")
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return [{**r, **{k: float(r[k]) if r[k] != "" else math.nan for k in floats}, "seed": int(r["seed"]),
             "collapsed": r["collapsed"] == "True"} for r in rows]


def fresh(out: str | None, scenario: str) -> dict:
    """method -> seed -> this experiment's run (its JSON under ``out``; ``out=None``: the committed ``RESULTS``),
    with its DPPO mask shares."""
    table: dict = {}
    if out is None:
        for r in runs_from_csv():
            if r["scenario"] == scenario:
                table.setdefault(r["method"], {})[r["seed"]] = r
        return table
    for r in mt.load_runs(out_dir(out, scenario)):
        if r["scenario"] != scenario:
            continue
        logs = r.get("logs", [])
        for key in ("masked_fraction", "masked_fraction_pos", "masked_fraction_neg"):
            vals = [g[f"rollout_corr/rollout_dppo_{key}"] for g in logs if f"rollout_corr/rollout_dppo_{key}" in g]
            r[f"dppo_{key}"] = statistics.fmean(vals) if vals else math.nan
        table.setdefault(r["method"], {})[r["seed"]] = r
    return table


def reproduced(scenario: str, out: str) -> dict:
    """method -> (committed score, re-run score or None, equal) at ``G_REPRODUCE[scenario]``."""
    seed, old, new = G_REPRODUCE[scenario], committed(scenario), fresh(out, scenario)
    res = {}
    for m in G_REUSED:
        a, b = old[m][seed]["score"], new.get(m, {}).get(seed, {}).get("score")
        res[m] = (a, b, b is not None and abs(a - b) <= G_REPRODUCE_TOL)
    return res


def reference_table(scenario: str, out: str) -> tuple[dict, str]:
    """The arms the family is analysed on: the committed M1 / M3 where both re-ran equal, else the re-runs."""
    rep = reproduced(scenario, out)
    new = fresh(out, scenario)
    table = {m: dict(v) for m, v in committed(scenario).items()}
    source = "committed"
    if not all(ok for _, _, ok in rep.values()):
        table.update({m: new.get(m, {}) for m in G_REUSED})
        source = "re-run"
    for m in G_NEW:
        table[m] = new.get(m, {})
    return table, source


def family_cells(scenario: str, out: str) -> list:
    """The re-runs at the reproduction seed first, then the DPPO arms seed by seed (all M1 / M3 seeds as well when
    the reproduction failed)."""
    seed = G_REPRODUCE[scenario]
    cells = [(scenario, m, seed) for m in G_REUSED]
    rep = reproduced(scenario, out) if all(os.path.exists(mt.run_path(out_dir(out, scenario), scenario, m, seed))
                                           for m in G_REUSED) else None
    methods = list(G_NEW) + (list(G_REUSED) if rep is not None and not all(ok for *_, ok in rep.values()) else [])
    return cells + [(scenario, m, s) for s in G_SEEDS[scenario] for m in methods]


def one_sided(diffs: list[float], direction: int) -> tuple[float, float]:
    """(paired t, exact sign-flip) one-sided p's of mean(diffs) in ``direction`` (+1: above 0, -1: below)."""
    st = mt._stats()
    d = [direction * x for x in diffs]
    t = st.paired_t(d, [0.0] * len(d))
    p_t = t.p / 2 if t.mean > 0 else 1 - t.p / 2
    return p_t, st.sign_flip_p_one_sided(d)


def analyse(scenario: str, out: str) -> tuple[list[str], dict]:
    st = mt._stats()
    table, source = reference_table(scenario, out)
    seeds = G_SEEDS[scenario]
    ref = table.get("M1", {})
    result: dict = {"scenario": scenario, "source": source, "reproduced": reproduced(scenario, out), "family": [],
                    "held_out": []}
    lines = [f"### Scenario {scenario}: the engine {G_LAG[scenario]} optimizer steps stale, T = "
             f"{mt.X_DIGITS + 1 if scenario == 'S2X' else 49}\n"]
    rep = result["reproduced"]
    lines.append(f"Reproduction of the committed reference arms at seed {G_REPRODUCE[scenario]}: " + "; ".join(
        f"{m} committed {a:.6f}, re-run " + ("not run" if b is None else f"{b:.6f}") + (" (equal)" if ok else
                                                                                      " (NOT equal)")
        for m, (a, b, ok) in rep.items()) + f". Family analysed on the {source} M1 / M3 runs.\n")
    lines += ["| arm | n | score mean | sd | per-token KL(engine‖policy) | T·KL | collapsed | DPPO masked share "
              "(A>0 / A<0) |", "|---|---|---|---|---|---|---|---|"]
    for m in ("on_policy", "M0", "M1", "M3", "M5", "M6"):
        rs = [table.get(m, {})[s] for s in seeds if s in table.get(m, {})]
        if not rs:
            continue
        xs = [r["score"] for r in rs]
        mask = "—" if m not in G_NEW else (
            f"{statistics.fmean(r['dppo_masked_fraction'] for r in rs):.2e} "
            f"({statistics.fmean(r['dppo_masked_fraction_pos'] for r in rs):.2e} / "
            f"{statistics.fmean(r['dppo_masked_fraction_neg'] for r in rs):.2e})")
        lines.append(f"| {m} | {len(rs)} | {statistics.fmean(xs):.4f} | "
                     f"{statistics.stdev(xs) if len(xs) > 1 else math.nan:.4f} | "
                     f"{statistics.fmean(r['kl_token'] for r in rs):.2e} | "
                     f"{statistics.fmean(r['t_kl'] for r in rs):.2f} | {sum(bool(r['collapsed']) for r in rs)} | "
                     f"{mask} |")
    rows = []
    for _, m in G_FAMILY[scenario]:
        common = [s for s in seeds if s in table.get(m, {}) and s in ref]
        if len(common) < 2:
            continue
        x, r0 = [table[m][s]["score"] for s in common], [ref[s]["score"] for s in common]
        floor, ceil = table.get("M0", {}), table.get("on_policy", {})
        gap_seeds = all(s in floor and s in ceil for s in common)
        row = st.compare_paired(x, r0, floor=[floor[s]["score"] for s in common] if gap_seeds else None,
                                ceiling=[ceil[s]["score"] for s in common] if gap_seeds else None)
        collapsed = sum(bool(table[m][s]["collapsed"]) for s in common)
        ref_collapsed = sum(bool(ref[s]["collapsed"]) for s in common)
        row.update(method=m, seeds=common, collapsed=collapsed, ref_collapsed=ref_collapsed,
                   fisher_p=st.fisher_exact([[collapsed, len(common) - collapsed],
                                             [ref_collapsed, len(common) - ref_collapsed]]).p)
        rows.append(row)
    st.add_holm(rows, "p")
    st.add_holm(rows, "p_sign_flip")
    fmt = lambda v: "—" if v is None or not math.isfinite(v) else f"{v:.2g}"  # noqa: E731
    lines += ["\n**The family** (each − M1 = TRL's default by TRL's GRPOTrainer; Holm over the 3):\n",
              "| arm − M1 | n | difference | 95% CI | p (t) | Holm | p (sign-flip) | Holm | gap closed [Fieller 95%] "
              "| collapsed (arm / M1, Fisher p) | held out |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        row["candidate"] = row["p_holm"] < G_ALPHA and row["p_sign_flip_holm"] < G_ALPHA
        gap = ("not computed (no M0 / on_policy on these seeds)" if "gap_closed" not in row else
               f"{row['gap_closed']:.2f} [{row['gap_closed_lo']:.2f}, {row['gap_closed_hi']:.2f}]")
        lines.append(f"| {row['method']} | {row['n']} | {row['diff']:+.4f} | [{row['diff_lo']:+.4f}, "
                     f"{row['diff_hi']:+.4f}] | {fmt(row['p'])} | {fmt(row['p_holm'])} | {fmt(row['p_sign_flip'])} | "
                     f"{fmt(row['p_sign_flip_holm'])} | {gap} | {row['collapsed']} / {row['ref_collapsed']}, "
                     f"{fmt(row['fisher_p'])} | {'runs' if row['candidate'] else 'no'} |")
    result["family"] = rows
    if source == "re-run" and any("gap_closed" in r for r in rows):
        lines.append("\nThe gap closed's floor (M0) and ceiling (on_policy) are the committed runs of the experiment "
                     "the seeds come from, on the machine that committed them; the compared arms ran here, and runs "
                     "do not reproduce across CPUs (the re-runs above): the gap closed is indicative only.")
    new = fresh(out, scenario)
    held = G_HELD_OUT[scenario]
    for row in rows:
        if not row["candidate"]:
            continue
        direction = 1 if row["diff"] > 0 else -1
        m = row["method"]
        common = [s for s in held if s in new.get(m, {}) and s in new.get("M1", {})]
        entry = {"method": m, "direction": direction, "n": len(common)}
        if len(common) >= 2:
            d = [new[m][s]["score"] - new["M1"][s]["score"] for s in common]
            t = st.paired_t([new[m][s]["score"] for s in common], [new["M1"][s]["score"] for s in common])
            p_t, p_sf = one_sided(d, direction)
            entry.update(diff=t.mean, lo=t.lo, hi=t.hi, p_t=p_t, p_sign_flip=p_sf,
                         confirmed=len(common) == len(held) and p_t < G_ALPHA and p_sf < G_ALPHA)
        result["held_out"].append(entry)
    if result["held_out"]:
        lines += [f"\n**Held out** (seeds {held[0]}-{held[-1]}, never run before; one-sided in the family's "
                  "direction; confirmed iff both p < 0.05 on all 10):\n",
                  "| arm − M1 | n | difference | 95% CI | p one-sided (t) | p one-sided (sign-flip) | confirmed |",
                  "|---|---|---|---|---|---|---|"]
        for e in result["held_out"]:
            if "diff" not in e:
                lines.append(f"| {e['method']} | {e['n']} | not run | | | | no |")
                continue
            lines.append(f"| {e['method']} | {e['n']} | {e['diff']:+.4f} | [{e['lo']:+.4f}, {e['hi']:+.4f}] | "
                         f"{fmt(e['p_t'])} | {fmt(e['p_sign_flip'])} | "
                         f"{('better' if e['direction'] > 0 else 'worse') if e['confirmed'] else 'no'} |")
    else:
        lines.append("\nNo family row has both Holm p's below 0.05: nothing runs on the held-out seeds.")
    return lines, result


def held_out_cells(scenario: str, out: str) -> list:
    _, result = analyse(scenario, out)
    methods = [r["method"] for r in result["family"] if r["candidate"]]
    if not methods:
        return []
    return [(scenario, m, s) for s in G_HELD_OUT[scenario] for m in ["M1", *methods]]


def write_results(out: str, path: str = RESULTS) -> None:
    rows = []
    for scenario in G_SCENARIOS:
        for _, by_seed in sorted(fresh(out, scenario).items()):
            rows += [{k: r.get(k, "") for k in CSV_COLUMNS} for _, r in sorted(by_seed.items())]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        w.writerows(rows)


def report(out: str) -> str:
    lines = ["## Experiment G: DPPO on a stale engine (pre-registration 25)\n"]
    for scenario in G_SCENARIOS:
        lines += analyse(scenario, out)[0] + [""]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("phase", choices=("run", "held_out", "report"))
    p.add_argument("--scenario", choices=G_SCENARIOS)
    p.add_argument("--out", default="outputs/dppo_stale")
    p.add_argument("--jobs", type=int, default=2)
    a = p.parse_args(argv)
    if a.phase == "report":
        text = report(a.out)
        write_results(a.out)
        with open(ANALYSIS, "w") as f:
            f.write(text + "\n")
        print(text)
        return
    if a.scenario is None:
        p.error(f"{a.phase} needs --scenario (one of {', '.join(G_SCENARIOS)})")
    if a.phase == "run":
        run_cells(a.scenario, family_cells(a.scenario, a.out)[:2], a.out, min(a.jobs, 2))
        run_cells(a.scenario, family_cells(a.scenario, a.out), a.out, a.jobs)
    else:
        cells = held_out_cells(a.scenario, a.out)
        print(f"held-out cells: {len(cells)}", flush=True)
        if cells:
            run_cells(a.scenario, cells, a.out, a.jobs)
    print("\n".join(analyse(a.scenario, a.out)[0]))


if __name__ == "__main__":
    main()
