"""The static-cache decoder of runtime/graphs.py against RankModel's eager decoding: on CPU its
step runs without a graph (2 gloo ranks); on a GPU (skipped here) the captured graph, 1 NCCL rank."""
import pytest
import torch

from dtpshard.core.launch import launch_local
from dtpshard.model.decode import generate_ids
from tiny import save_tiny

DELAYS = (0, 1, 2)


def _worker(model_dir, out_dir, backend):
    from dtpshard.core.launch import process_group, set_threads
    from dtpshard.core.settings import resolve_dtp
    from dtpshard.runtime.graphs import GraphDecoder
    from dtpshard.runtime.ranks import RankModel, check_world

    set_threads()
    prompt = torch.randint(0, 384, (2, 5), generator=torch.Generator().manual_seed(1))
    with process_group(timeout=120, backend=backend) as (rank, world):
        dev = "cuda" if backend == "nccl" else "cpu"
        ckpt, _ = check_world(model_dir, world)
        net = RankModel(ckpt, rank, resolve_dtp(ckpt.shape, devices=world), timeout=120, device=dev)
        res = {}
        for delay in DELAYS:
            net.set_delay(delay)
            eager, static = net.new_cache(), GraphDecoder(net, batch=2, max_len=32)
            cache = static.new_cache()
            a, b = net(prompt.to(dev), eager), static(prompt.to(dev), cache)
            nxt = a[:, -1:].argmax(-1)
            steps = []
            for _ in range(6):  # the same tokens into both: compare the logits step by step
                la, lb = net(nxt, eager), static(nxt, cache)
                steps.append((la - lb).abs().max().item())
                nxt = la.argmax(-1)
            res[delay] = max([(a - b).abs().max().item(), *steps])
            res[delay, "gen"] = torch.equal(generate_ids(net, prompt.to(dev), 8),
                                            generate_ids(GraphDecoder(net, 2, 32), prompt.to(dev), 8))
        torch.save(res, f"{out_dir}/rank{rank}.pt")
    return 0


def _check(world, backend, tmp_path):
    model = save_tiny(tmp_path / "qwen2", "qwen2", seed=1)
    exits = launch_local(world, _worker, (str(model), str(tmp_path), backend), grace=30, deadline=240)
    assert [e.code for e in exits] == [0] * world, [e.traceback or e.said for e in exits]
    for r in range(world):
        res = torch.load(tmp_path / f"rank{r}.pt")
        for d in DELAYS:
            assert res[d] <= 1e-4 and res[d, "gen"], (r, d, res[d])


def test_static_cache_decoder_equals_eager_decoding(tmp_path):
    _check(2, "gloo", tmp_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CUDA-graph capture with NCCL)")
def test_cuda_graph_decoder_equals_eager_decoding(tmp_path):
    _check(1, "nccl", tmp_path)
