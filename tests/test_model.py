"""DTPModel against transformers (δ = 0, L = 1) and against the literal transcription of docs/design.md §1."""
import pytest
import torch

from dtpshard.core.family import split_fused
from dtpshard.model.dtp import DTPModel
from reference import literal_dtp_logits
from tiny import FAMILIES, tiny_hf_model

TOL = 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def hf(request):
    return tiny_hf_model(request.param)


def ids_for(hf, B=2, T=13, seed=0):
    return torch.randint(0, hf.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("devices,delay", [(4, 0), (2, 0), (1, 2), (1, 1.5)])
def test_dense_identities_match_transformers(hf, devices, delay):
    ids = ids_for(hf)
    ref = hf(ids).logits
    out = DTPModel.from_hf(hf, devices=devices, delay=delay)(ids).logits
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("devices", [1, 4])
def test_dense_identity_gradients_match_transformers(hf, devices):
    """The training path (hand-written backwards: norms, residual updates, per-device matmuls) at
    δ = 0 against transformers' autograd, parameter by parameter."""
    ids = ids_for(hf)
    hf.zero_grad()
    hf(ids).logits.logsumexp(-1).mean().backward()
    want = {n: p.grad.clone() for n, p in hf.named_parameters() if p.grad is not None}
    hf.zero_grad()
    model = DTPModel.from_hf(hf, devices=devices, delay=0).train()
    model(ids).logits.logsumexp(-1).mean().backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    want = split_fused(want, model.shape)  # a fused tensor's gradient, split as its parts (Phi-3)
    assert set(got) == set(want) - {"lm_head.weight"} or set(got) == set(want)
    for name, g in got.items():
        torch.testing.assert_close(g, want[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("delay", [1, 2, 3, 1.5])
@pytest.mark.parametrize("stage3", ["sqrt", "one"])
def test_matches_literal_transcription(devices, delay, stage3):
    hf = tiny_hf_model("qwen3" if devices == 4 else "qwen2", seed=devices)
    ids = ids_for(hf, B=1, T=9)
    ref = literal_dtp_logits(hf, ids, devices, delay, stage3)
    out = DTPModel.from_hf(hf, devices=devices, delay=delay, stage3=stage3)(ids).logits
    assert (out - ref).abs().max().item() <= TOL
    # and DTP really changed the function
    assert (out - hf(ids).logits).abs().max().item() > 1e-2


PARTIAL_ROTARY = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}


@pytest.mark.parametrize("fam, over", [("llama", {}), ("llama_tied", {}), ("mistral", {}), ("granite", {}),
                                       ("phi3", {}), ("phi3", {"rope_parameters": PARTIAL_ROTARY})])
def test_literal_transcription_other_families(fam, over):
    """Phi-3 at 15 tokens crosses its tiny window of 11; Granite has all four multipliers."""
    hf = tiny_hf_model(fam, seed=3, **over)
    ids = ids_for(hf, B=1, T=15)
    out = DTPModel.from_hf(hf, devices=4, delay=1)(ids).logits
    assert (out - literal_dtp_logits(hf, ids, 4, 1)).abs().max().item() <= TOL


def test_partials_sum_to_dense_module_output(hf):
    model = DTPModel.from_hf(hf, devices=4, delay=1)
    ids = ids_for(hf, B=2, T=11)
    T = ids.shape[1]
    x = hf.model.embed_tokens(ids) + 0.5 * torch.randn(2, T, hf.config.hidden_size)
    cos, sin = model.rope(x, 0, T)
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
    hf_cos, hf_sin = hf.model.rotary_emb(x, torch.arange(T)[None])
    for m in range(model.shape.modules):
        layer = hf.model.layers[m // 2]
        p, local = model.module_partials(m, x.unsqueeze(0).expand(4, *x.shape), cos, sin)
        assert p.shape == (4, *x.shape) and local is None
        if m % 2:
            dense = layer.mlp(layer.post_attention_layernorm(x))
        else:
            dense = layer.self_attn(layer.input_layernorm(x), position_embeddings=(hf_cos, hf_sin),
                                    attention_mask=causal)[0]
        dense = dense * model.shape.residual_multiplier  # what joins the stream (Granite's multiplier)
        assert (p.sum(0) - dense).abs().max().item() <= TOL
        assert (p[0] - dense).abs().max().item() > 1e-3  # one device alone is not the dense output


@pytest.mark.parametrize("delay", [1, 1.5, 0])
def test_kv_cache_decoding_equals_full_forward(delay):
    hf = tiny_hf_model("qwen3", seed=5)
    model = DTPModel.from_hf(hf, devices=4, delay=delay)
    ids = ids_for(hf, B=2, T=14)
    full = model(ids).logits
    cache = model.new_cache()
    pieces = [model(ids[:, :6], cache=cache).logits, model(ids[:, 6:9], cache=cache).logits]  # prefill, then a chunk
    pieces += [model(ids[:, t:t + 1], cache=cache).logits for t in range(9, 14)]  # then token by token
    assert cache.length == 14
    assert (torch.cat(pieces, 1) - full).abs().max().item() <= TOL


def test_checkpointing_gradients_equal():
    hf = tiny_hf_model("qwen2", seed=7)
    ids = ids_for(hf, B=2, T=10)
    grads = []
    for ckpt in (False, True):
        model = DTPModel.from_hf(hf, devices=2, delay=1.5).train()
        model.gradient_checkpointing = ckpt
        model(ids).logits.logsumexp(-1).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-6, rtol=1e-5), n
    assert any(g.abs().max() > 0 for g in grads[0].values())


def test_bfloat16_runs_close_to_fp32():
    hf = tiny_hf_model("llama", seed=2)
    ids = ids_for(hf)
    ref = DTPModel.from_hf(hf, devices=4, delay=1)(ids).logits
    out = DTPModel.from_hf(hf, devices=4, delay=1, dtype=torch.bfloat16)(ids).logits
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max().item() < 0.1 * ref.abs().max().item()


def test_fractional_delay_is_continuous():
    hf = tiny_hf_model("llama", seed=4)
    ids = ids_for(hf, B=1, T=8)
    model = DTPModel.from_hf(hf, devices=4, delay=1)
    at1 = model(ids).logits
    model.set_dtp(4, 1 + 1e-6)
    assert (model(ids).logits - at1).abs().max().item() < 1e-4
    model.set_dtp(4, 2 - 1e-6)
    near2 = model(ids).logits
    model.set_dtp(4, 2)
    assert (model(ids).logits - near2).abs().max().item() < 1e-4


def test_rms_norm_backward_matches_autograd():
    from dtpshard.model.ops import _RMSNormFn, rms_norm

    x = torch.randn(2, 3, 5, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: _RMSNormFn.apply(a, b, 1e-6), (x, w))
    dy = torch.randn(2, 3, 5, 16, dtype=torch.float64)
    g1 = torch.autograd.grad((rms_norm(x, w, 1e-6) * dy).sum(), (x, w))
    g2 = torch.autograd.grad((_RMSNormFn.apply(x, w, 1e-6) * dy).sum(), (x, w))
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, atol=1e-12)
    # the training forward (1/rms from vector_norm) equals the inference one to float rounding
    assert torch.allclose(_RMSNormFn.apply(x, w, 1e-6), rms_norm(x, w, 1e-6), atol=1e-12)
    x32 = torch.randn(4, 2, 7, 64) * 3
    w32 = torch.randn(64)
    assert torch.allclose(_RMSNormFn.apply(x32, w32, 1e-6), rms_norm(x32, w32, 1e-6), rtol=1e-6, atol=1e-6)


def test_residual_update_backward_matches_autograd():
    from dtpshard.model.ops import _ResidualUpdate, residual_update

    def literal(x, p, own, arrivals):  # x_l + own·p_l + Σ_k w_k·(Σ_j q_j^k - q_l^k)
        out = x + own * p
        for q, w in arrivals:
            out = out + w * (q.sum(0, keepdim=True) - q)
        return out

    x, p, q1, q2 = (torch.randn(3, 2, 4, 8, dtype=torch.float64, requires_grad=True) for _ in range(4))
    assert torch.autograd.gradcheck(lambda *t: _ResidualUpdate.apply(t[0], t[1], 0.5, [1.0, 0.25], t[2], t[3]),
                                    (x, p, q1, q2))
    dy = torch.randn(3, 2, 4, 8, dtype=torch.float64)
    for own, arrivals in ((1.0, []), (1.0, [(q1, 1.0)]), (3 ** -0.5, [(q1, 0.5), (q2, 0.5)])):
        ins = (x, p, *[q for q, _ in arrivals])
        got = residual_update(x, p, own, [(None, q, w) for q, w in arrivals])
        want = literal(x, p, own, arrivals)
        assert torch.allclose(got, want, atol=1e-12)
        expected = torch.autograd.grad((want * dy).sum(), ins)
        for a, b in zip(torch.autograd.grad((got * dy).sum(), ins), expected):
            assert torch.allclose(a, b, atol=1e-12)
        # the same sums given, as a rank's all-reduce gives them: the same values and gradients
        given = residual_update(x, p, own, [(q.sum(0, keepdim=True), q, w) for q, w in arrivals])
        assert torch.allclose(given, want, atol=1e-12)
        for a, b in zip(torch.autograd.grad((given * dy).sum(), ins), expected):
            assert torch.allclose(a, b, atol=1e-12)
    with torch.no_grad():  # the inference path: no autograd Function, same values
        assert torch.allclose(residual_update(x, p, 0.5, [(None, q1, 1.0)]), literal(x, p, 0.5, [(q1, 1.0)]),
                              atol=1e-12)


@pytest.mark.parametrize("cols", [False, True])
def test_device_matmul_backward_matches_autograd_in_the_weights_layout(cols):
    from dtpshard.model.ops import _DeviceMatmul

    def case(n, out, inp, dtype):  # x, w and autograd's reference y = bmm(x, W_l^T views)
        w = torch.randn(out, inp, dtype=dtype, requires_grad=True)
        if cols:  # device l: columns [l·inp/4, (l+1)·inp/4), transposed -> [4, inp/4, out]
            x, view = torch.randn(4, n, inp // 4, dtype=dtype), w.view(out, 4, inp // 4).permute(1, 2, 0)
        else:  # device l: rows [l·out/4, (l+1)·out/4), transposed -> [4, inp, out/4]
            x, view = torch.randn(4, n, inp, dtype=dtype), w.view(4, out // 4, inp).transpose(1, 2)
        return x.requires_grad_(), w, torch.bmm(x, view)

    x, w, _ = case(6, 12, 8, torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: _DeviceMatmul.apply(a, b, 4, cols), (x, w))
    # fp32 at sizes where bmm calls BLAS (tiny ones take a plain loop): the forward and dx are
    # autograd's own GEMMs, dW is its GEMM with the operands swapped (equal to float rounding)
    x, w, ref = case(64, 48, 32, torch.float32)
    assert torch.equal(_DeviceMatmul.apply(x, w, 4, cols), ref)
    dy = torch.randn_like(ref)
    got = torch.autograd.grad(_DeviceMatmul.apply(x, w, 4, cols), (x, w), dy)
    want = torch.autograd.grad(ref, (x, w), dy)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    assert got[1].stride() == w.stride()
    if cols:  # what this Function is for: autograd's own column gradient is column-major
        assert not want[1].is_contiguous()


def test_every_weight_gradient_arrives_in_the_weights_layout():
    """A strided gradient costs AccumulateGrad a copy (or a slow strided add) per weight per step."""
    hf = tiny_hf_model("qwen3")
    model = DTPModel.from_hf(hf, devices=2, delay=1).train()
    strided = []
    for name, p in model.named_parameters():
        p.register_hook(lambda g, name=name: strided.append(name) if not g.is_contiguous() else None)
    model(ids_for(hf)).logits.logsumexp(-1).mean().backward()
    assert not strided


def test_autocast_bf16_training_step_runs():
    hf = tiny_hf_model("qwen2", seed=1)
    model = DTPModel.from_hf(hf, devices=4, delay=1).train()
    ids = ids_for(hf)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids).logits.float().logsumexp(-1).mean()
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    ref = DTPModel.from_hf(hf, devices=4, delay=1)
    ref(ids).logits.logsumexp(-1).mean().backward()
    g32 = ref.model.layers[0].mlp.gate_proj.weight.grad
    g16 = model.model.layers[0].mlp.gate_proj.weight.grad
    assert (g16 - g32).norm() < 0.1 * g32.norm()
