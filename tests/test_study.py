"""The SmolLM2 study's config on a tiny model, end to end: every arm kind, four proxies, the report."""
import json
import tomllib

import numpy as np
import pytest
import yaml
from scipy.stats import pearsonr, spearmanr

from dtpshard.cli import main
from dtpshard.studies.demo import STUDY
from test_experiment import corpus


def tiny_study(tmp_path, model):
    """smollm2_study.toml with the model, data and budget made tiny; arms and proxies as shipped."""
    cfg = tomllib.loads(STUDY.read_text())
    text = [str(corpus(tmp_path / "corpus.txt"))]
    cfg.update(model=str(model), devices=2, device="cpu")
    cfg["calibration"] = {"text": text, "blocks": 2, "seq_len": 16}
    cfg["evaluation"] = {"text": text, "blocks": 2}
    cfg["training"].update(text=text, steps=2, seq_len=16, eval_every=1, checkpoint_every=1, warmup=1)
    del cfg["training"]["dataset"]
    for arm, layers in zip([a for a in cfg["arms"] if "layers" in a], (1, 2)):  # the tiny model has 3 layers
        arm["layers"] = layers
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, cfg


def test_tiny_study_end_to_end(tmp_path, tiny_dirs, capsys):
    path, cfg = tiny_study(tmp_path, tiny_dirs["llama"])
    out = tmp_path / "study"
    assert main(["study", "--study", str(path), "--out", str(out)]) == 0
    proxies = cfg["proxies"]
    assert proxies[0] == "first-order" and len(proxies) == 4

    # every arm of the shipped study: 14 layouts, 18 runs
    layouts = {p.stem: json.loads(p.read_text()) for p in (out / "layouts").glob("*.json")}
    assert len(layouts) == 14 and len(list((out / "runs").iterdir())) == 18
    assert {"optimised-layers-1", "optimised-layers-2", "optimised-ablation", "neurons-only"} <= set(layouts)
    assert layouts["optimised-ablation"]["kind"] == "optimised-ablation"  # its own group in the report

    # one pass per proxy over the same tokens: the ablation file equals `dtpshard affinity --proxy ablation`
    direct = tmp_path / "ablation.safetensors"
    assert main(["affinity", str(tiny_dirs["llama"]), "--out", str(direct), "--text", cfg["calibration"]["text"][0],
                 "--blocks", "2", "--seq-len", "16", "--device", "cpu", "--no-progress", "--proxy", "ablation"]) == 0
    from safetensors.torch import load_file

    a, b = load_file(direct), load_file(out / "affinity-ablation.safetensors")
    assert a.keys() == b.keys() and all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in a)

    # scores.json: J of every layout under every proxy; a layout's own score is the one of its proxy
    scores = json.loads((out / "scores.json").read_text())
    assert sorted(scores) == sorted(layouts) and all(sorted(s) == sorted(proxies) for s in scores.values())
    for name, layout in layouts.items():
        own = layout["score"].get("proxy") or "first-order"
        assert scores[name][own] == pytest.approx(layout["score"]["J"], rel=1e-9)

    # the report: provenance, the proxy table (r against scipy over the trained layouts), figures
    md = (out / "report.md").read_text()
    assert "## Provenance" in md and "sha256" in md and "wall time per phase" in md
    timings = json.loads((out / "timings.json").read_text())
    assert {"affinity ablation", "zero-shot", "teacher cache", "run optimised-s2"} <= set(timings)
    kl = {}
    for run in (out / "runs").iterdir():
        rows = [json.loads(li) for li in (run / "metrics.jsonl").read_text().splitlines() if '"eval"' in li]
        kl.setdefault(run.name.rsplit("-s", 1)[0], []).append(rows[-1]["eval_kl"])
    def same_function(obj):  # which units share a device in each layer, whatever the devices are called
        L = obj["devices"]

        def share(perm, d):
            return frozenset(perm[d * len(perm) // L:(d + 1) * len(perm) // L])

        return frozenset(tuple((share(lay["kv_perm"], d), share(lay["ffn_perm"], d)) for lay in obj["layers"])
                         for d in range(L))

    names, seen = [], set()  # identical layouts (same units per device) count once
    for n in sorted(kl, key=lambda n: (n != "optimised", n)):
        key = same_function(layouts[n])
        if key not in seen:
            seen.add(key)
            names.append(n)
    for proxy in proxies:
        r = pearsonr([scores[n][proxy] for n in names], [np.mean(kl[n]) for n in names]).statistic
        rho = spearmanr([scores[n][proxy] for n in names], [np.mean(kl[n]) for n in names]).statistic
        row = next(li for li in md.splitlines() if li.startswith(f"| {proxy} |")).split("|")
        assert row[2].strip() == f"{r:+.3f}" and row[6].strip() == f"{rho:+.3f}"
    assert (out / "figures" / "proxies.png").read_bytes()[:4] == b"\x89PNG"

    # rerunning resumes: nothing is recomputed, the report is rewritten
    before = (out / "timings.json").read_text()
    assert main(["study", "--study", str(path), "--out", str(out)]) == 0
    assert (out / "timings.json").read_text() == before
    assert "study finished" in capsys.readouterr().err


def test_study_refuses_a_missing_file(tmp_path, capsys):
    assert main(["study", "--study", str(tmp_path / "none.toml"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "none.toml" in err[0]
    assert not (tmp_path / "o").exists()


def test_arm_proxy_must_be_scored(tmp_path, tiny_dirs, capsys):
    path, cfg = tiny_study(tmp_path, tiny_dirs["llama"])
    cfg["proxies"] = ["first-order"]
    path.write_text(yaml.safe_dump(cfg))
    assert main(["study", "--study", str(path), "--out", str(tmp_path / "o")]) == 2
    assert "proxy = 'group-unit': not one of the experiment's proxies" in capsys.readouterr().err
