"""The report on synthetic experiment directories: numbers recomputed here, figures written."""
import json
import re

import numpy as np
import pytest
from scipy.stats import pearsonr

from dtpshard.cli import main
from dtpshard.core.owned import ID, mark
from dtpshard.studies.report import load_study, write_report

STEPS = [0, 50, 100]
# layout -> (kind, J, {seed: KL curve}); ppl = exp(3 + KL) so it is known too
PLAN = {
    "optimised": ("optimised", 9.0, {0: [1.0, 0.50, 0.30], 1: [1.1, 0.52, 0.32], 2: [1.0, 0.49, 0.31]}),
    "contiguous": ("contiguous", 5.0, {0: [1.2, 0.70, 0.42], 1: [1.3, 0.72, 0.40], 2: [1.2, 0.69, 0.41]}),
    "random-0": ("random", 5.2, {0: [1.2, 0.66, 0.38]}),
    "random-1": ("random", 5.1, {0: [1.3, 0.68, 0.39]}),
    "anti": ("anti", 2.0, {}),  # scored only: zero-shot KL
}
ZERO = {"optimised": 1.0, "contiguous": 1.2, "random-0": 1.2, "random-1": 1.3, "anti": 1.9}


def make_experiment(d, unfinished=None, plan=PLAN, zero_kl=ZERO):
    (d / "layouts").mkdir(parents=True)
    dir_id = mark(d, "experiment")  # an experiment directory is dtpshard's: its report may be replaced
    (d / "config.json").write_text(json.dumps({"model": "synthetic", "devices": 4, "delay": 1, ID: dir_id,
                                               "training": {"steps": 100, "micro_batch": 2, "grad_accum": 1,
                                                            "seq_len": 64}}))
    zero = {}
    for name, (kind, J, seeds) in plan.items():
        up = [J / 10, J / 12, J / 9]
        layout = {"format": "dtpshard.layout/1", "kind": kind, "score": {
            "J": J, "ratio_to_random": J / 5, "layers": [{"layer": i, "up": u, "down": 0.3} for i, u in enumerate(up)]}}
        (d / "layouts" / f"{name}.json").write_text(json.dumps(layout))
        zero[name] = {"kl": zero_kl[name], "ppl": float(np.exp(3 + zero_kl[name])), "tokens": 100}
        for seed, kl in seeds.items():
            run = d / "runs" / f"{name}-s{seed}"
            run.mkdir(parents=True)
            rows = [{"kind": "train", "step": 1, "loss": 1.0}]
            n = 2 if unfinished == run.name else len(STEPS)
            rows += [{"kind": "eval", "step": s, "tokens": s * 128, "eval_kl": k, "eval_ppl": float(np.exp(3 + k)),
                      "wall": s} for s, k in zip(STEPS[:n], kl[:n])]
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            if unfinished != run.name:
                (run / "final").mkdir()
                (run / "DONE").write_text("{}\n")
    (d / "zeroshot.json").write_text(json.dumps(zero))
    return d


def _row(md, first_cell):
    line = next(li for li in md.splitlines() if li.startswith(f"| {first_cell} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_report_tables_and_figures(tmp_path, capsys):
    d = make_experiment(tmp_path / "exp")
    assert main(["report", str(d)]) == 0
    assert capsys.readouterr().out.strip() == str(d / "report.md")  # stdout: the path alone
    md = (d / "report.md").read_text()
    for fig in ("curves", "j_vs_kl", "up_edge"):
        png = d / "figures" / f"{fig}.png"
        assert png.read_bytes()[:4] == b"\x89PNG" and f"figures/{fig}.png" in md

    opt_end = [c[2] for c in PLAN["optimised"][2].values()]
    cont_mid = [c[1] for c in PLAN["contiguous"][2].values()]
    row = _row(md, "optimised")
    assert row[5] == f"{np.mean(opt_end):.3f} ± {np.std(opt_end, ddof=1):.3f}"
    assert _row(md, "contiguous")[4] == f"{np.mean(cont_mid):.3f} ± {np.std(cont_mid, ddof=1):.3f}"
    rnd = _row(md, "random")
    assert rnd[1:3] == ["2", "2"]  # two random layouts pooled, one run each
    assert rnd[5] == f"{np.mean([0.38, 0.39]):.3f} ± {np.std([0.38, 0.39], ddof=1):.3f}"
    ppl = [np.exp(3 + k) for k in opt_end]
    assert row[6] == f"{min(opt_end):.3f}–{max(opt_end):.3f}"  # the spread of single runs
    assert row[7] == f"{np.mean(ppl):.2f} ± {np.std(ppl, ddof=1):.2f}"

    # step matching: contiguous mean at 100 is 0.41; optimised mean curve crosses it between 50 and 100
    opt_mean = np.mean([c for c in PLAN["optimised"][2].values()], axis=0)
    target = 0.41
    reached = 50 + 50 * (opt_mean[1] - target) / (opt_mean[1] - opt_mean[2])
    assert row[8] == f"{reached:.0f} ({100 / reached:.1f}×)"

    # Pearson at the end over the trained layouts (the anti layout has no step-100 KL)
    names = ["optimised", "contiguous", "random-0", "random-1"]
    J = [PLAN[n][1] for n in names]
    kl = [np.mean([c[2] for c in PLAN[n][2].values()]) for n in names]
    r_end = pearsonr(J, kl).statistic
    assert f"KL step 100 against J over 4 layouts: Pearson r = {r_end:+.3f}" in md
    r0 = pearsonr([PLAN[n][1] for n in PLAN], [np.mean([c[0] for c in PLAN[n][2].values()]) if PLAN[n][2] else ZERO[n]
                                               for n in PLAN]).statistic
    assert f"untrained (step 0) against J over 5 layouts: Pearson r = {r0:+.3f}" in md
    anti = _row(md, "anti")
    assert anti[4] == f"{ZERO['anti']:.4f}" and anti[7] == "–"


def test_partial_experiment_is_reported(tmp_path):
    d = make_experiment(tmp_path / "exp", unfinished="contiguous-s1")
    study = load_study(d)
    assert sum(not r.done for r in study.runs) == 1
    md = write_report(d).read_text()
    assert "Partial results" in md
    assert re.search(r"\| contiguous \| contiguous \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| 3 \(1 running\)", md)
    # the unfinished seed has no step-100 value: the end mean is over the two finished seeds
    assert _row(md, "contiguous")[5] == f"{np.mean([0.42, 0.41]):.3f} ± {np.std([0.42, 0.41], ddof=1):.3f}"


def test_report_refuses_a_non_experiment(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "no such experiment directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "not an experiment directory" in err and len(err.strip().splitlines()) == 1


def _png_width(path):
    import struct

    return struct.unpack(">I", path.read_bytes()[16:20])[0]


def test_j_figure_has_a_panel_only_where_there_is_data(tmp_path):
    from dtpshard.studies.figures import draw_j_vs_kl

    full = load_study(make_experiment(tmp_path / "full"))
    untrained = load_study(make_experiment(tmp_path / "untrained"))
    for info in untrained.layouts.values():  # as if no run had got past its step-0 evaluation
        for r in info.runs:
            r.kl = type(r.kl)(r.kl.steps[:1], r.kl.values[:1])
    w3 = _png_width(draw_j_vs_kl(full, tmp_path / "a.png"))
    w1 = _png_width(draw_j_vs_kl(untrained, tmp_path / "b.png"))
    assert 2.5 < w3 / w1 < 3.5  # three panels (untrained, middle, end) against the untrained one alone


def test_identical_layouts_count_once(tmp_path):
    d = make_experiment(tmp_path / "exp")
    opt = json.loads((d / "layouts" / "optimised.json").read_text())
    opt.update(devices=2, delay=1, model={"layers": 1, "kv_groups": 4, "heads_per_group": 1, "neurons": 6},
               layers=[{"kv_perm": [1, 0, 2, 3], "ffn_perm": [0, 1, 2, 3, 4, 5]}])
    (d / "layouts" / "optimised.json").write_text(json.dumps(opt))
    # the same function: the two devices swapped, units reordered within a device
    same = {**opt, "kind": "neurons-only", "layers": [{"kv_perm": [3, 2, 0, 1], "ffn_perm": [5, 3, 4, 2, 0, 1]}]}
    (d / "layouts" / "neurons-only.json").write_text(json.dumps(same))
    zero = json.loads((d / "zeroshot.json").read_text())
    (d / "zeroshot.json").write_text(json.dumps({**zero, "neurons-only": zero["optimised"]}))
    md = write_report(d).read_text()
    assert _row(md, "neurons-only")[1] == "neurons-only (= optimised)"
    assert "count once in every correlation: neurons-only = optimised" in md
    assert "untrained (step 0) against J over 5 layouts" in md  # 6 layout files, 5 distinct


def test_report_of_a_run_that_has_not_evaluated_yet(tmp_path, capsys):
    """`dtpshard report` while an experiment runs: a run started but with no evaluation row yet."""
    d = make_experiment(tmp_path / "exp")
    (d / "runs" / "optimised-s9").mkdir()
    (d / "runs" / "optimised-s9" / "metrics.jsonl").write_text("")
    assert main(["report", str(d)]) == 0
    md = (d / "report.md").read_text()
    assert _row(md, "optimised")[2] == "4"  # counted as a run (running), left out of the curves
    assert "optimised's mean curve reaches it at step" in md


def test_head_start_and_side_by_side_sections(tmp_path):
    """[report] steps/log_steps/compare: the gap and multiplier at every evaluation and at the chosen
    steps (recomputed here), top-1 where the runs recorded it, and another study side by side."""
    from dtpshard.studies.compare import rolling_median

    other = make_experiment(tmp_path / "other")
    d = make_experiment(tmp_path / "exp")
    cfg = json.loads((d / "config.json").read_text())
    cfg["report"] = {"steps": [50, 100], "log_steps": True, "compare": str(other)}
    (d / "config.json").write_text(json.dumps(cfg))
    for run in (d / "runs").iterdir():  # top-1 agreement recorded: 0.5 + KL-free constant per step
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        for r in rows:
            if r["kind"] == "eval":
                r["eval_top1"] = 0.9 - r["eval_kl"] / 10
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name in ("optimised", "contiguous"):  # the edges' co-located fractions (δ = 1: up and down)
        p = d / "layouts" / f"{name}.json"
        lay = json.loads(p.read_text())
        lay["score"]["edges"] = [{"src": 0, "dst": 1, "colocated": 0.6}, {"src": 1, "dst": 2, "colocated": 0.4}]
        p.write_text(json.dumps(lay))
    md = (write_report(d)).read_text()
    assert (d / "figures" / "head_start.png").read_bytes()[:4] == b"\x89PNG"
    opt = np.mean([c for c in PLAN["optimised"][2].values()], axis=0)
    cont = np.mean([c for c in PLAN["contiguous"][2].values()], axis=0)
    section = _section(md, "The head start over training")
    rows = [ln for ln in section.splitlines() if ln.startswith("| 100 |")]
    assert len(rows) == 2  # the chosen steps' table and the every-evaluation one
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    gap = cont[2] - opt[2]
    assert cells[1:5] == [f"{opt[2]:.4f}", f"{cont[2]:.4f}", f"{gap:.4f}", f"{100 * gap / cont[2]:.1f}%"]
    reached = 50 + 50 * (opt[1] - cont[2]) / (opt[1] - opt[2])
    assert cells[5] == f"{100 / reached:.2f}×"
    assert cells[7] == f"{0.9 - opt[2] / 10:.4f}"  # top-1 of the seed-mean curve
    assert "top-1@100" in md
    assert rolling_median([1, None, 3, 10, 2, 4]) == [2, 3, 2.5, 3.5, 3.5, 4]  # of the known, centred
    side = md[md.index("## Side by side with"):]
    assert "| this study (δ = 1) | optimised | 3 | 0.600 | 0.400 |" in side
    assert f"{other} (δ = 1) | contiguous |" in side


# four random layouts: random-1 beats optimised-s1, random-2 stalls with one of its two seeds
RIVALS = {
    "optimised": ("optimised", 9.0, {0: [1.0, 0.50, 0.30], 1: [1.0, 0.55, 0.36]}),
    "contiguous": ("contiguous", 5.0, {0: [1.2, 0.60, 0.40], 1: [1.2, 0.62, 0.42]}),
    "random-0": ("random", 5.2, {0: [1.3, 0.70, 0.45]}),
    "random-1": ("random", 5.1, {0: [1.3, 0.52, 0.35]}),
    "random-2": ("random", 5.15, {0: [1.3, 1.0, 0.9], 1: [1.3, 0.6, 0.38]}),
    "random-3": ("random", 4.9, {0: [1.25, 0.65, 0.44]}),
    "anti": ("anti", 2.0, {0: [1.9, 1.5, 1.2]}),
}
RIVALS_ZERO = {name: seeds[0][0] for name, (_, _, seeds) in RIVALS.items()}
UP_DOWN = {"random-0": (0.34, 0.33), "random-1": (0.33, 0.32), "random-2": (0.30, 0.36), "random-3": (0.35, 0.34)}


def _rivals(d, plan=RIVALS):
    make_experiment(d, plan=plan, zero_kl=RIVALS_ZERO)
    for name, (up, down) in UP_DOWN.items():
        p = d / "layouts" / f"{name}.json"
        lay = json.loads(p.read_text())
        lay["score"]["edges"] = [{"src": 0, "dst": 1, "colocated": up}, {"src": 1, "dst": 2, "colocated": down}]
        p.write_text(json.dumps(lay))
    return write_report(d).read_text()


def _section(md, title):
    part = md[md.index(f"## {title}") + 3:]
    return part[:part.index("\n## ")] if "\n## " in part else part


def test_who_beats_whom_at_every_evaluation(tmp_path):
    sec = _section(_rivals(tmp_path / "exp"), "Who beats whom")
    # random-2 counts once, with its seed mean (0.64 at step 100, 0.8 at step 50)
    assert "| 100 | 4/4 random, 2/2 contiguous | 3/4 random, 2/2 contiguous | held |" in sec
    assert "| 50 | 4/4 random, 2/2 contiguous | 3/4 random, 2/2 contiguous | held |" in sec
    assert "| 0 | 4/4 random, 2/2 contiguous | 4/4 random, 2/2 contiguous | held |" in sec
    assert "all but one of the 4 random layouts\". At step 100: **held**; at 3 of 3 evaluations" in sec
    assert "optimised-s1 (0.3600) to random-1 (0.3500)" in sec
    assert "the narrowest win: optimised-s1 (0.3600) over random-2 (0.3800)" not in sec  # a layout, not a seed
    assert "the narrowest win: optimised-s1 (0.3600) over contiguous-s0 (0.4000), by 0.0400 (10.0%)" in sec

    beaten_twice = {**RIVALS, "random-3": ("random", 4.9, {0: [1.25, 0.65, 0.355]})}
    sec = _section(_rivals(tmp_path / "two", beaten_twice), "Who beats whom")
    assert "| 100 | 4/4 random, 2/2 contiguous | 2/4 random, 2/2 contiguous | not held |" in sec
    assert "At step 100: **not held**; at 2 of 3 evaluations (steps 0, 50)" in sec
    assert "optimised-s1 (0.3600) to random-1 (0.3500), random-3 (0.3550)" in sec


def test_no_dominance_section_without_rivals(tmp_path):
    plan = {k: v for k, v in RIVALS.items() if k in ("optimised", "contiguous", "anti")}  # no random layout
    md = write_report(make_experiment(tmp_path / "exp", plan=plan, zero_kl=RIVALS_ZERO)).read_text()
    assert "## Who beats whom" not in md


def test_stalled_layouts_their_j_and_layout_or_training(tmp_path):
    from dtpshard.studies.stalls import STALL_KEPT

    md = _rivals(tmp_path / "exp")
    sec = _section(md, "Layouts that stall")
    assert f"more than {STALL_KEPT:.0%} of its KL at step 0" in sec
    ranked = sorted(RIVALS, key=lambda n: -RIVALS[n][1])  # J rank among the 7 trained layouts
    assert ("| random-2 | random | 1 of 2 | random-2-s0 1.300 → 0.900 (69%); random-2-s1 1.300 → 0.380 (29%) | "
            f"5.1500 | {ranked.index('random-2') + 1} |") in sec
    assert "| no (3 layouts that trained normally have a lower J: contiguous, random-1, random-3) |" in sec
    assert "| anti | anti | 1 of 1 | anti-s0 1.900 → 1.200 (63%) | 2.0000 | 7 | 7 | yes |" in sec
    # the correlation without the anti and stalled layouts, recomputed on the seed means
    kept = ["contiguous", "optimised", "random-0", "random-1", "random-3"]
    js = [RIVALS[n][1] for n in kept]
    kl = [np.mean([c[2] for c in RIVALS[n][2].values()]) for n in kept]
    r = pearsonr(js, kl).statistic
    assert "J against the trained KL without anti, random-2:" in sec
    assert f"KL step 100 against J over 5 layouts: Pearson r = {r:+.3f}" in sec
    assert "random-2 stalls with 1 of its 2 training seeds: a property of its training" in sec
    peers = [UP_DOWN[n][0] for n in ("random-0", "random-1", "random-3")]
    assert (f"| the other 3: mean ± sd | {np.mean([5.2, 5.1, 4.9]):.4f} ± {np.std([5.2, 5.1, 4.9], ddof=1):.4f} | "
            f"{1.2833:.4f} ± ") in sec
    z = (0.30 - np.mean(peers)) / np.std(peers, ddof=1)
    assert _row(sec, "random-2: (value − mean) / sd")[3] == f"{z:+.2f}"  # the up edge's column
    assert "| random-2: rank of 4 (1 = highest) | 2 | 1 | 4 | 1 |" in sec
    assert "### anti" not in sec  # one seed and no other anti layout: nothing to tell with

    both = {**RIVALS, "random-2": ("random", 5.15, {0: [1.3, 1.0, 0.9], 1: [1.3, 1.1, 0.95]})}
    sec = _section(_rivals(tmp_path / "both", both), "Layouts that stall")
    assert "random-2 stalls with all 2 of its training seeds: a property of its layout." in sec


def test_no_stall_is_said_so(tmp_path):
    md = write_report(make_experiment(tmp_path / "exp")).read_text()
    assert "No run stalls." in _section(md, "Layouts that stall")
    assert "without" not in _section(md, "Layouts that stall")  # no anti run, no stall: nothing to leave out


@pytest.mark.parametrize("field, bad, where", [
    ('"eval_kl": 0.5', '"eval_kl": -0.5', "runs/optimised-s0/metrics.jsonl: 'eval_kl'"),
    ('"eval_kl": 0.5', '"eval_kl": 1e308', "runs/optimised-s0/metrics.jsonl: 'eval_kl'"),
    ('"step": 50', '"step": Infinity', "runs/optimised-s0/metrics.jsonl: 'step'"),
    ('"eval_ppl": ', '"eval_ppl": 0.5, "x": ', "runs/optimised-s0/metrics.jsonl: 'eval_ppl'"),
])
def test_a_measurement_out_of_its_range_is_one_line_naming_file_and_key(tmp_path, capsys, field, bad, where):
    d = make_experiment(tmp_path / "exp")
    metrics = d / "runs" / "optimised-s0" / "metrics.jsonl"
    assert field in metrics.read_text()
    metrics.write_text(metrics.read_text().replace(field, bad, 1))
    assert main(["report", str(d)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and where in err[0] and "Traceback" not in err[0], err


@pytest.mark.parametrize("key, bad", [("kl", -0.1), ("kl", 1e308), ("ppl", 0.0), ("top1", 1.5)])
def test_a_zero_shot_measurement_out_of_its_range_is_one_line(tmp_path, capsys, key, bad):
    d = make_experiment(tmp_path / "exp")
    zero = json.loads((d / "zeroshot.json").read_text())
    zero["anti"][key] = bad
    (d / "zeroshot.json").write_text(json.dumps(zero))
    assert main(["report", str(d)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"zeroshot.json: '{key}'" in err[0] and "Traceback" not in err[0], err


def test_a_negative_proxy_score_is_one_line(tmp_path, capsys):
    d = make_experiment(tmp_path / "exp")
    (d / "scores.json").write_text(json.dumps({"optimised": {"first-order": -1.0}}))
    assert main(["report", str(d)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "scores.json: 'first-order'" in err[0], err
