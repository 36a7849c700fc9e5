"""The multi-process runtime (gloo on 127.0.0.1) against the single-process DTPModel.

One launch per world size computes everything (δ ∈ {0, 1, 2, 1.5}, contiguous and random
layouts, cached decoding, greedy generation, bytes held) and saves it; the test process then
compares with DTPModel. Every launch has a deadline, so no test can hang.
"""
import re
import time

import pytest
import torch

from dtpshard import cli
from dtpshard.core.launch import launch_local
from dtpshard.core.layout import Layout
from dtpshard.core.permutation import permutation_spec
from dtpshard.model.checkpoint import open_checkpoint
from dtpshard.model.decode import generate_ids
from dtpshard.model.dtp import DTPModel
from tiny import save_tiny

TOL = 1e-4
DELAYS = (0, 1, 2, 1.5)
NEW_TOKENS = 8
DEADLINE = 240  # seconds for a whole launch, generous for a loaded 2-core machine


@pytest.fixture(scope="module")
def ckpt_dirs(tmp_path_factory):
    """World size (or family) -> a tiny checkpoint it divides: qwen2 (q/k/v biases) for 2, qwen3 (q/k
    norms, 3 KV groups of 2 heads) for 3; Phi-3 (fused tensors read as their parts, a window shorter
    than the texts) and Granite (its multipliers) for 2."""
    root = tmp_path_factory.mktemp("runtime")
    return {2: save_tiny(root / "qwen2", "qwen2", seed=1),
            3: save_tiny(root / "qwen3", "qwen3", seed=2, num_key_value_heads=3, num_attention_heads=6,
                         intermediate_size=96),
            "phi3": save_tiny(root / "phi3", "phi3", seed=3), "granite": save_tiny(root / "granite", "granite", seed=4)}


def _ids(T, seed, vocab=384):
    return torch.randint(0, vocab, (2, T), generator=torch.Generator().manual_seed(seed))


def _equivalence_worker(model_dir, layout_path, out_dir):
    """One rank: everything the test compares, saved to out_dir/rank{r}.pt."""
    from dtpshard.core.launch import process_group, set_threads
    from dtpshard.core.settings import resolve_dtp
    from dtpshard.runtime.ranks import RankModel, check_world

    set_threads()  # one core each: oversubscribed OpenMP threads make a forward ~10x slower
    ids, prompt = _ids(13, 0), _ids(5, 1)
    with process_group(timeout=120) as (rank, world):
        ckpt, _ = check_world(model_dir, world)
        res = {}
        for name, lay in (("contiguous", None), ("random", Layout.load(layout_path))):
            net = RankModel(ckpt, rank, resolve_dtp(ckpt.shape, devices=world, delay=0), lay, timeout=120)
            res[name, "bytes"] = net.sharded_bytes()
            for delay in DELAYS:
                net.set_delay(delay)
                res[name, delay] = net(ids)
            net.set_delay(1)  # prefill, then a chunk, then token by token, from the per-rank cache
            cache = net.new_cache()
            pieces = [net(ids[:, :6], cache), net(ids[:, 6:9], cache)]
            pieces += [net(ids[:, t:t + 1], cache, logits_to_keep=1) for t in range(9, 13)]
            res[name, "cached"] = torch.cat(pieces, 1)
            res[name, "generated"] = generate_ids(net, prompt, NEW_TOKENS)
        torch.save(res, f"{out_dir}/rank{rank}.pt")
    return 0


@pytest.mark.parametrize("world, which", [(2, 2), (3, 3), (2, "phi3"), (2, "granite")])
def test_ranks_equal_single_process_model(world, which, ckpt_dirs, tmp_path):
    path = ckpt_dirs[which]
    shape = open_checkpoint(path).shape
    layout = Layout.random(shape, world, seed=world)
    assert not layout.is_identity()
    layout.save(tmp_path / "layout.json")
    codes = launch_local(world, _equivalence_worker, (str(path), str(tmp_path / "layout.json"), str(tmp_path)),
                         grace=30, deadline=DEADLINE)
    assert [e.code for e in codes] == [0] * world, [e.traceback or e.said for e in codes]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    ids, prompt = _ids(13, 0), _ids(5, 1)
    full_bytes = sum(t.numel() * 4 for n, t in open_checkpoint(path).state_dict().items()
                     if n in permutation_spec(shape))
    for name, lay in (("contiguous", None), ("random", layout)):
        ref = DTPModel.from_pretrained(path, devices=world, delay=0, layout=lay)
        for r in range(world):  # each rank holds exactly its 1/L of the sharded weights
            assert ranks[r][name, "bytes"] * world == full_bytes
        for delay in DELAYS:
            ref.set_dtp(world, delay)
            want = ref(ids).logits
            for r in range(world):
                assert (ranks[r][name, delay] - want).abs().max().item() <= TOL, (name, delay, r)
        ref.set_dtp(world, 1)
        assert (ranks[0][name, "cached"] - ref(ids).logits).abs().max().item() <= TOL
        gen = generate_ids(ref, prompt, NEW_TOKENS)
        for r in range(world):
            assert torch.equal(ranks[r][name, "generated"], gen), (name, r)
    # δ really changed the function, and the layout really changed which units sit together
    assert (ranks[0]["contiguous", 1] - ranks[0]["contiguous", 0]).abs().max().item() > 1e-2
    assert (ranks[0]["random", 1] - ranks[0]["contiguous", 1]).abs().max().item() > 1e-2


def test_cli_nproc_prints_the_single_process_generation(ckpt_dirs, capfd):
    path = str(ckpt_dirs[2])
    assert cli.main(["generate", path, "--prompt", "import torch", "--devices", "2", "--delay", "2",
                     "--max-new-tokens", "6", "--device", "cpu"]) == 0
    want = capfd.readouterr().out
    assert cli.main(["run", path, "--prompt", "import torch", "--nproc", "2", "--delay", "2",
                     "--max-new-tokens", "6"]) == 0
    got = capfd.readouterr()
    assert got.out == want, got.err  # rank 0 alone prints, the same text


def test_killed_rank_ends_the_run_with_an_error(ckpt_dirs, capfd, monkeypatch):
    monkeypatch.setenv("DTPSHARD_TEST_KILL", "1:3")  # rank 1 dies silently at module 3 of the prefill
    t = time.monotonic()
    rc = cli.main(["run", str(ckpt_dirs[2]), "--prompt", "import torch", "--nproc", "2", "--timeout", "30"])
    took = time.monotonic() - t
    err = capfd.readouterr().err
    assert rc == 2
    assert took < 120, took  # a liveness bound (the run ends, never hangs), held at load 6
    lines = [ln for ln in err.splitlines() if ln.strip()]
    survivor = [ln for ln in lines if ln.startswith("dtpshard run: error: rank 0:")]
    assert len(survivor) == 1 and "another rank died" in survivor[0], err
    assert any("rank 1 exit 3" in ln for ln in lines), err
    assert "Traceback" not in err


def test_refused_before_any_collective(ckpt_dirs, tmp_path, capfd, monkeypatch):
    import torch.distributed as dist

    # 3 ranks cannot split 4 KV groups: refused by the launcher, and by a torchrun rank, at once
    had_group = dist.is_initialized()
    t = time.monotonic()
    assert cli.main(["run", str(ckpt_dirs[2]), "--prompt", "x", "--nproc", "3"]) == 2
    assert re.search(r"world size 3 does not fit .*num_key_value_heads=4", capfd.readouterr().err)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert cli.main(["run", str(ckpt_dirs[2]), "--prompt", "x"]) == 2
    assert "world size 3 does not fit" in capfd.readouterr().err
    # a layout made for 4 devices at world size 2
    monkeypatch.setenv("WORLD_SIZE", "2")
    Layout.random(open_checkpoint(ckpt_dirs[2]).shape, 4, seed=0).save(tmp_path / "l4.json")
    assert cli.main(["run", str(ckpt_dirs[2]), "--prompt", "x", "--layout", str(tmp_path / "l4.json")]) == 2
    err = capfd.readouterr().err
    assert "made for devices=4, the world size is 2" in err and len(err.strip().splitlines()) == 1
    assert dist.is_initialized() == had_group and time.monotonic() - t < 30
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert cli.main(["run", str(ckpt_dirs[2]), "--prompt", "x"]) == 2
    assert "not started by torchrun" in capfd.readouterr().err


def test_launcher_refuses_before_spawning_any_rank(ckpt_dirs, capfd, monkeypatch):
    import dtpshard.runtime.run as run

    monkeypatch.setattr(run, "launch_local", lambda *a, **k: pytest.fail("ranks were spawned"))
    for flags, said in ((["--prompt", ""], "the prompt encodes to no tokens"),
                        (["--prompt", "x", "--latency-ms", "1e12", "--timeout", "5"],
                         "--latency-ms 1e+12: every transfer would outlast --timeout 5 s"),
                        (["--prompt", "x", "--timeout", "1e300"],
                         "--timeout 1e300: must be a finite number > 0 (seconds, at most 1e6)")):
        assert cli.main(["run", str(ckpt_dirs[2]), "--nproc", "2", *flags]) == 2
        err = capfd.readouterr().err.strip()
        assert said in err and len(err.splitlines()) == 1, err


def test_rank_that_never_starts_times_out(ckpt_dirs, capfd, monkeypatch):
    import torch.distributed as dist

    from dtpshard.core.launch import free_port

    if dist.is_initialized():
        pytest.skip("another test left a process group in this process; run_cmd would reuse it")

    monkeypatch.setenv("RANK", "0")  # rank 1 of 2 never comes
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    t = time.monotonic()
    assert cli.main(["run", str(ckpt_dirs[2]), "--prompt", "x", "--timeout", "2"]) == 2
    assert time.monotonic() - t < 30
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "the 2 ranks did not all join" in err, err


def test_emulated_link_latency_is_in_series_with_the_transfer():
    """The added latency starts when the transfer itself completes, so a slow transfer cannot hide it."""
    from dtpshard.runtime.ranks import Link

    fut = torch.futures.Future()

    class Work:  # a transfer that completes when the test says so
        def get_future(self):
            return fut

        def wait(self, timeout):
            return True

    link = Link(0, 10, latency=0.05)
    done = link._completion(Work())
    time.sleep(0.03)  # the transfer itself takes 30 ms (or more: only lower bounds are asserted)
    before = time.perf_counter()
    fut.set_result(None)  # the transfer completes now: its callback runs inside this call
    completed = time.perf_counter()
    assert before <= done[0] <= completed  # stamped at completion, however loaded the machine
    link._wait(Work(), done, "a transfer")
    assert time.perf_counter() - completed >= 0.05  # latency after completion, not max(30, 50) ms after posting
    plain = Link(0, 10)  # no emulated link: no callback, no wait
    assert plain._completion(Work()) == [0.0]


def test_link_waits_on_the_stream_with_nccl():
    """NCCL: a wait with a timeout polls the work's CUDA event from the host (the CPU blocked, CUDA-graph
    capture broken), so the Link waits without one and leaves hangs to the group's own timeout; gloo's
    wait is the host's, with the timeout."""
    import datetime

    from dtpshard.runtime.ranks import Link

    calls = []

    class Work:
        def wait(self, *args):
            calls.append(args)
            return True

    Link(0, 30, device="cuda")._wait(Work(), [0.0], "a sum")
    Link(0, 30, device="cpu")._wait(Work(), [0.0], "a sum")
    assert calls == [(), (datetime.timedelta(seconds=30),)]
