"""Per-module delay (docs/design.md §1): only a set of modules is delayed, the rest plain tensor
parallel. Every engine is held to the literal transcription (tests/reference.py) elsewhere; here
the simulator, the schedule's rules, the set's checks and the uniform case bit for bit."""
import math

import pytest
import torch

from dtpshard.core.delayed import check_delayed, compact, parse_spec, share_count
from dtpshard.core.errors import UserError
from dtpshard.core.settings import DTPSettings, read_record, resolve_dtp
from dtpshard.model.delay import schedule
from dtpshard.model.dtp import DTPModel
from reference import literal_dtp_logits
from tiny import tiny_hf_model

TOL = 1e-4


def ids_for(hf, B=1, T=11, seed=0):
    return torch.randint(0, hf.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("devices,delay,stage3,delayed", [
    (4, 1, "sqrt", (1, 2, 3)),      # module 0 plain: no stage 1 at all
    (4, 1, "sqrt", (0, 1, 4)),      # stage 1 on module 0, a plain last module
    (2, 2, "one", (2, 3, 5)),       # a delayed module whose sum never lands (5 + 2 >= 6), stage3 one
    (2, 2, "sqrt", (0, 5)),
    (4, 1.5, "sqrt", (1, 3, 4)),    # fractional δ over a subset
    (2, 1, "sqrt", (5,)),           # only the last module: its sum never lands
])
def test_partial_matches_literal_transcription(devices, delay, stage3, delayed):
    hf = tiny_hf_model("qwen3" if devices == 4 else "llama", seed=devices)
    ids = ids_for(hf)
    ref = literal_dtp_logits(hf, ids, devices, delay, stage3, delayed=delayed)
    out = DTPModel.from_hf(hf, devices=devices, delay=delay, stage3=stage3, delayed=delayed)(ids).logits
    assert (out - ref).abs().max().item() <= TOL
    assert (out - hf(ids).logits).abs().max().item() > 1e-3  # the delayed modules changed the function


def test_uniform_is_todays_schedule_bit_for_bit():
    """Every module listed is stored as None: the same schedule, the same logits to the bit."""
    hf = tiny_hf_model("llama", seed=1)
    ids = ids_for(hf)
    for delay in (1, 2, 1.5):
        assert schedule(6, 4, delay, "sqrt", None) == schedule(6, 4, delay, "sqrt")
        full = DTPModel.from_hf(hf, devices=4, delay=delay, delayed=tuple(range(6)))
        assert full.settings.delayed is None
        uniform = DTPModel.from_hf(hf, devices=4, delay=delay)
        assert torch.equal(full(ids).logits, uniform(ids).logits)


def test_one_delayed_module_moves_less_than_all():
    hf = tiny_hf_model("llama", seed=2)
    ids = ids_for(hf)
    dense = hf(ids).logits
    one = DTPModel.from_hf(hf, devices=4, delay=1, delayed=(3,))(ids).logits
    full = DTPModel.from_hf(hf, devices=4, delay=1)(ids).logits
    assert 0 < (one - dense).abs().max() < (full - dense).abs().max()


def test_schedule_rules():
    s = schedule(8, 4, 1, "sqrt", (2, 3, 7))
    assert [st.own_scale for st in s] == [1.0] * 7 + [2.0]  # module 0 lands at once: no stage 1; 7 never lands
    assert s[3].arrivals == ((2, 1.0),) and s[4].arrivals == ((3, 1.0), (4, 1.0))
    assert 7 not in s.last_use and s.edges() == [(2, 3), (3, 4)]
    s = schedule(6, 4, 1, "sqrt", (0, 1))
    assert s[0].own_scale == math.sqrt(4) and s[1].own_scale == 1.0  # the first landing is after module 0


def test_gradients_flow_through_plain_and_delayed_modules():
    hf = tiny_hf_model("llama", seed=3)
    model = DTPModel.from_hf(hf, devices=2, delay=1, delayed=(1, 2)).train()
    model(ids_for(hf)).logits.logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_spec_parsing():
    assert parse_spec("0.5") == 0.5 and parse_spec(0.25) == 0.25 and parse_spec("1.0") == 1.0
    assert parse_spec("10-12,3") == (10, 11, 12, 3)
    assert share_count(0.5, 60) == 30 and share_count(0.01, 60) == 1 and share_count(1.0, 60) == 60
    assert compact((0, 1, 2, 5, 7, 8), 10) == "0-2,5,7-8"
    assert parse_spec("0") == (0,)  # no decimal point: module indices; a share is written 0.5 or 1.0
    for bad in ("1.5", "0.0", "-1", "nan", "inf", "a-b", "5-3", "", "1e400", "3,,4"):
        with pytest.raises(UserError):
            v = parse_spec(bad)
            check_delayed(v if isinstance(v, tuple) else (), 10)


def test_set_checks():
    assert check_delayed([3, 1], 6) == (1, 3)
    assert check_delayed(range(6), 6) is None  # all: stored as None
    for bad, why in (([], "empty"), ([1, 1], "twice"), ([6], "outside"), ([-1], "outside"), ([True], "integers")):
        with pytest.raises(UserError, match=why):
            check_delayed(bad, 6)
    with pytest.raises(UserError, match="outside"):
        resolve_dtp(DTPModel.from_hf(tiny_hf_model("llama"), devices=2).shape, devices=2, delayed=(0, 99))


def test_record_round_trip_and_checks():
    s = DTPSettings(2, 1, "sqrt", (1, 4))
    assert s.to_json() == {"devices": 2, "delay": 1, "stage3": "sqrt", "delayed": [1, 4]}
    assert "delayed" not in DTPSettings(2, 1, "sqrt").to_json()
    assert read_record(s.to_json(), "x") == s.to_json()
    for bad in ([4, 1], [1, 1], [], ["1"], [-2]):
        with pytest.raises(UserError, match="delayed"):
            read_record({"devices": 2, "delayed": bad}, "config.json")


def _rank_worker(model_dir, delayed, out_dir):
    """One rank of a partial student: its logits, cached decoding and greedy tokens."""
    from dtpshard.core.launch import process_group, set_threads
    from dtpshard.core.settings import resolve_dtp
    from dtpshard.model.decode import generate_ids
    from dtpshard.runtime.ranks import RankModel, check_world

    set_threads()
    ids = torch.randint(0, 384, (2, 11), generator=torch.Generator().manual_seed(0))
    with process_group(timeout=120) as (rank, world):
        ckpt, _ = check_world(model_dir, world)
        res = {}
        for delay in (1, 2):
            settings = resolve_dtp(ckpt.shape, devices=world, delay=delay, delayed=tuple(delayed))
            net = RankModel(ckpt, rank, settings, None, timeout=120)
            res[delay] = net(ids)
            cache = net.new_cache()
            res[delay, "cached"] = torch.cat([net(ids[:, :7], cache)] + [net(ids[:, t:t + 1], cache)
                                                                         for t in range(7, 11)], 1)
            res[delay, "generated"] = generate_ids(net, ids[:, :4], 6)
        torch.save(res, f"{out_dir}/rank{rank}.pt")
    return 0


def test_ranks_compute_the_partial_student(tmp_path):
    """The multi-process runtime (one process per device, the partials over the host's transport)
    equals the simulator, which equals the transcription: plain modules sum at once, delayed ones
    land δ modules later."""
    from dtpshard.core.launch import launch_local
    from dtpshard.model.decode import generate_ids
    from tiny import save_tiny

    path = save_tiny(tmp_path / "qwen2", "qwen2", seed=1)
    delayed = (1, 2, 4)
    codes = launch_local(2, _rank_worker, (str(path), delayed, str(tmp_path)), grace=30, deadline=240)
    assert [e.code for e in codes] == [0, 0], [e.traceback or e.said for e in codes]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    ids = torch.randint(0, 384, (2, 11), generator=torch.Generator().manual_seed(0))
    for delay in (1, 2):
        ref = DTPModel.from_pretrained(path, devices=2, delay=delay, delayed=delayed)
        want = ref(ids).logits
        gen = generate_ids(ref, ids[:, :4], 6)
        for r in range(2):
            assert (ranks[r][delay] - want).abs().max().item() <= TOL, (delay, r)
            assert (ranks[r][delay, "cached"] - want).abs().max().item() <= TOL, (delay, r)
            assert torch.equal(ranks[r][delay, "generated"], gen)


def test_sensitivity_resumed_at_the_module_equals_full_forwards():
    """module_sensitivity starts module m's forward from the dense stream entering m; that is the
    full forward with only m delayed (KL of each, against the dense logits)."""
    from dtpshard.affinity.sensitivity import module_sensitivity

    hf = tiny_hf_model("qwen3", seed=5)
    model = DTPModel.from_hf(hf, devices=4, delay=1)
    ids = ids_for(hf, B=3, T=9)
    got = module_sensitivity(model, ids, model.settings, micro_batch=2)
    assert model.settings.delayed is None  # left as it was
    dense = torch.log_softmax(hf(ids).logits.double(), -1)
    for m in range(model.shape.modules):
        one = torch.log_softmax(DTPModel.from_hf(hf, devices=4, delay=1, delayed=(m,))(ids).logits.double(), -1)
        want = (dense.exp() * (dense - one)).sum(-1).mean().item()
        assert got["kl"][m] == pytest.approx(want, rel=1e-3, abs=1e-7), m
    assert min(got["kl"]) > 0 and got["tokens"] == ids.numel()


@pytest.mark.parametrize("recorded, says", [([0, 99], "outside"), ([3, 1], "not a valid DTP setting"),
                                             ([], "not a valid DTP setting"), ("1-3", "not a valid DTP setting")])
def test_a_student_whose_set_does_not_fit_is_refused_in_one_line(tmp_path, capsys, recorded, says):
    import json

    from dtpshard.cli import main
    from tiny import save_tiny

    teacher = save_tiny(tmp_path / "teacher", "llama", seed=1)
    student = tmp_path / "student"
    DTPModel.from_pretrained(teacher, 2, 1, delayed=(1, 2)).save_pretrained(student, source=teacher)
    cfg = json.loads((student / "config.json").read_text())
    assert cfg["dtp"]["delayed"] == [1, 2]
    cfg["dtp"]["delayed"] = recorded
    (student / "config.json").write_text(json.dumps(cfg))
    assert main(["generate", str(student), "--prompt", "x", "--max-new-tokens", "2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and "delayed" in err[0], err
