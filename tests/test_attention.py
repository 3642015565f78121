"""Packed attention: backends against a dense-masked reference, HF integration, refusals."""

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

from verl_memopd.attention import (
    BACKENDS,
    PackedAttentionError,
    attention_implementation,
    call_varlen_attn,
    forward_layout,
    get_backend,
    hf_name,
    register_backend,
)
from verl_memopd.packing import build_layout
from verl_memopd.rce import EpisodeShape, random_episodes
from verl_memopd.segments import PAD_SEGMENT, segment_meta

VOCAB = 128


def _semantic_mask(seg: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """(N, N) visibility from the definition, independent of SegmentMeta: same row, and causal within a
    segment (padding runs included), or a block token looking at its row's prefix (segment 0)."""
    i, j = torch.arange(seg.numel()).unsqueeze(1), torch.arange(seg.numel()).unsqueeze(0)
    same_row = row.unsqueeze(1) == row.unsqueeze(0)
    run = torch.cat([torch.zeros(1, dtype=torch.long), ((seg.diff() != 0) | (row.diff() != 0)).long().cumsum(0)])
    own = (run.unsqueeze(1) == run.unsqueeze(0)) & (j <= i)
    prefix = (seg.unsqueeze(1) > 0) & (seg.unsqueeze(0) == 0)
    return same_row & (own | prefix)


def _random_stream(gen: torch.Generator):
    """Rows of [left padding][q][blocks...][right padding] with random lengths."""
    seg, row = [], []
    for r in range(4):
        lengths = [
            int(x) for x in torch.randint(1, 7, (int(torch.randint(1, 5, (1,), generator=gen)) + 2,), generator=gen)
        ]
        ids = [PAD_SEGMENT] + list(range(len(lengths) - 2)) + [PAD_SEGMENT]
        for s, n in zip(ids, lengths):
            seg += [s] * n
            row += [r] * n
    return torch.tensor(seg), torch.tensor(row)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_torch_backend_matches_dense_masked_attention_and_gradients(seed):
    gen = torch.Generator().manual_seed(seed)
    seg, row = _random_stream(gen)
    meta = segment_meta(seg, row)
    n, hq, hkv, d = seg.numel(), 4, 2, 16
    q, k, v = (torch.randn(n, h, d, generator=gen, requires_grad=True) for h in (hq, hkv, hkv))
    out = get_backend("torch")(q, k[meta.key_index], v[meta.key_index], meta, d**-0.5, 0.0)
    mask = _semantic_mask(seg, row)
    assert torch.equal(meta.visibility(), mask)
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(2, 1).transpose(0, 1),
        v.repeat_interleave(2, 1).transpose(0, 1),
        attn_mask=mask,
    ).transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    weights = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * weights).sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


def test_torch_backend_runs_on_sdpa_fused_kernel():
    """Each segment reaches SDPA as a 4-D batch of one, so the fused kernel (CPU flash attention) takes it:
    restricted to that kernel, a 3-D call or a shape it refuses raises 'No available kernel'."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator().manual_seed(3)
    seg, row = _random_stream(gen)
    meta = segment_meta(seg, row)
    assert any(kb - ka > qb - qa for qa, qb, ka, kb in meta.bounds)  # masked (bottom-right) and square segments
    n, d = seg.numel(), 16
    q, k, v = (torch.randn(n, h, d, generator=gen, requires_grad=True) for h in (4, 2, 2))
    args = (q, k[meta.key_index], v[meta.key_index], meta, d**-0.5, 0.0)
    with sdpa_kernel([SDPBackend.MATH]):
        ref = get_backend("torch")(*args)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = get_backend("torch")(*args)
        out.sum().backward()
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return Qwen2ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def episodes():
    return random_episodes(
        6, VOCAB, seed=3, shape=EpisodeShape(prefix_len=(2, 12), chunk_len=(1, 8), response_len=(1, 8))
    )


@pytest.mark.parametrize("impl", ["sdpa", "eager", "flash_attention_2"])
def test_packed_layout_is_refused_under_stock_attention(model, episodes, impl):
    previous = model.config._attn_implementation
    model.config._attn_implementation = impl  # flash-attn is absent here: set it without loading a kernel
    try:
        for name in ("packed", "per_call_varlen"):
            with pytest.raises(PackedAttentionError, match=f"{impl!r} would let packed call blocks see each other"):
                forward_layout(model, build_layout(name, episodes))
    finally:
        model.config._attn_implementation = previous


@torch.no_grad()
def test_memopd_attention_without_metadata_raises(model):
    with attention_implementation(model, hf_name("torch")):
        with pytest.raises(PackedAttentionError, match="without memopd_segments"):
            model(torch.tensor([[1, 2, 3]]), use_cache=False)
    assert model.config._attn_implementation == "sdpa"


@torch.no_grad()
@pytest.mark.parametrize("name", ["per_call", "flat"])
def test_plain_layouts_agree_under_stock_and_packed_attention(model, episodes, name):
    layout = build_layout(name, episodes, VOCAB)
    stock = forward_layout(model, layout)
    with attention_implementation(model, hf_name("torch")):
        packed = forward_layout(model, layout)
    torch.testing.assert_close(packed, stock, atol=1e-5, rtol=1e-5)


def test_backend_registry_refuses_duplicates_and_flash_names():
    with pytest.raises(ValueError, match="already registered"):
        register_backend("torch")(BACKENDS["torch"])
    with pytest.raises(ValueError, match="containing 'flash'"):
        register_backend("flashy")(BACKENDS["torch"])
    with pytest.raises(KeyError, match="valid attention backends: flash_attn, torch, torch_varlen"):
        get_backend("xformers")
    assert "flash" not in hf_name("flash_attn")


def test_cuda_backends_refuse_cpu_tensors():
    meta = segment_meta(torch.tensor([0, 0, 1]), torch.zeros(3, dtype=torch.long))
    q = torch.randn(3, 2, 8)
    for name in ("flash_attn", "torch_varlen"):
        with pytest.raises(PackedAttentionError, match="needs CUDA fp16/bf16"):
            get_backend(name)(q, q[meta.key_index], q[meta.key_index], meta, 0.3, 0.0)


# --- torch's varlen_attn across its signatures (fakes that run on CPU with the real parameter lists) ----------
def _dense_varlen(query, key, value, cu_q, cu_k, causal, scale, gqa):
    """What the flash kernel computes: per segment, causal aligned bottom-right; K/V heads must match Q's
    unless ``gqa`` (query head h reads KV head h // groups)."""
    if key.shape[1] != query.shape[1] and not gqa:
        raise RuntimeError(f"{query.shape[1]} query heads vs {key.shape[1]} key heads without GQA")
    groups = query.shape[1] // key.shape[1]
    outs = []
    bounds = zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist())
    for qa, qb, ka, kb in bounds:
        qs = query[qa:qb].transpose(0, 1)  # (Hq, Lq, D)
        ks, vs = (x[ka:kb].repeat_interleave(groups, dim=1).transpose(0, 1) for x in (key, value))
        scores = qs @ ks.transpose(1, 2) * (query.shape[-1] ** -0.5 if scale is None else scale)
        if causal:
            n, m = qb - qa, kb - ka
            scores = scores.masked_fill(~torch.ones(n, m, dtype=torch.bool).tril(m - n), float("-inf"))
        outs.append((scores.softmax(-1) @ vs).transpose(0, 1))
    return torch.cat(outs)


def varlen_attn_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    return _dense_varlen(query, key, value, cu_seq_q, cu_seq_k, is_causal, None, gqa=False)


def varlen_attn_2_11(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
):
    assert window_size in ((-1, -1), (-1, 0)), window_size
    return _dense_varlen(query, key, value, cu_seq_q, cu_seq_k, window_size == (-1, 0), scale, gqa=False)


def varlen_attn_2_13(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
    seqused_k=None,
    block_table=None,
    num_splits=None,
):
    assert window_size in ((-1, -1), (-1, 0)), window_size
    return _dense_varlen(query, key, value, cu_seq_q, cu_seq_k, window_size == (-1, 0), scale, gqa=enable_gqa)


@pytest.mark.parametrize("fake", [varlen_attn_2_10, varlen_attn_2_11, varlen_attn_2_13])
@pytest.mark.parametrize("hkv", [2, 8])
def test_varlen_attn_is_called_as_each_torch_signature_allows(fake, hkv):
    """torch 2.11 has no enable_gqa (K/V heads repeated here), 2.10 no scale/window_size (is_causal, q
    pre-scaled): every spelling gives the torch reference's packed, bottom-right causal attention."""
    gen = torch.Generator().manual_seed(0)
    seg, row = _random_stream(gen)
    meta = segment_meta(seg, row)
    assert any(kb - ka > qb - qa for qa, qb, ka, kb in meta.bounds)  # bottom-right alignment is exercised
    q, k, v = (torch.randn(seg.numel(), h, 16, generator=gen) for h in (8, hkv, hkv))
    k, v = k[meta.key_index], v[meta.key_index]
    ref = get_backend("torch")(q, k, v, meta, 0.3, 0.0)
    torch.testing.assert_close(call_varlen_attn(fake, q, k, v, meta, 0.3), ref, atol=1e-5, rtol=1e-5)


def test_installed_torch_varlen_signature_binds():
    """The arguments chosen for the installed torch bind to its real varlen_attn (a TypeError otherwise)."""
    import inspect

    varlen = pytest.importorskip("torch.nn.attention.varlen")
    bound = []

    def spy(*args, **kwargs):
        bound.append(inspect.signature(varlen.varlen_attn).bind(*args, **kwargs))
        return args[0]

    spy.__signature__ = inspect.signature(varlen.varlen_attn)
    meta = segment_meta(torch.tensor([0, 0, 1]), torch.zeros(3, dtype=torch.long))
    q, kv = torch.randn(3, 4, 8), torch.randn(3, 2, 8)
    call_varlen_attn(spy, q, kv[meta.key_index], kv[meta.key_index], meta, 0.3)
    args = bound[0].arguments
    assert args.get("window_size") == (-1, 0) or args.get("is_causal") is True


def test_varlen_attn_without_a_causal_argument_is_refused():
    def no_causal(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
        raise AssertionError("must not be called")

    meta = segment_meta(torch.tensor([0, 0, 1]), torch.zeros(3, dtype=torch.long))
    q = torch.randn(3, 2, 8)
    with pytest.raises(PackedAttentionError, match="neither window_size nor is_causal"):
        call_varlen_attn(no_causal, q, q[meta.key_index], q[meta.key_index], meta, 0.3)


def _has_flash_attn() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("flash_attn", marks=pytest.mark.skipif(not _has_flash_attn(), reason="needs CUDA and flash-attn")),
        pytest.param("torch_varlen", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    ],
)
def test_cuda_backend_matches_torch_reference(name):
    gen = torch.Generator().manual_seed(0)
    seg, row = _random_stream(gen)
    meta = segment_meta(seg, row)
    q, k, v = (torch.randn(seg.numel(), h, 64, generator=gen) for h in (8, 2, 2))
    ref = get_backend("torch")(q, k[meta.key_index], v[meta.key_index], meta, 0.125, 0.0)
    cuda_meta = meta.to("cuda")
    qc, kc, vc = (x.to("cuda", torch.bfloat16) for x in (q, k, v))
    out = get_backend(name)(qc, kc[cuda_meta.key_index], vc[cuda_meta.key_index], cuda_meta, 0.125, 0.0)
    bf16_ref = get_backend("torch")(
        *(x.to(torch.bfloat16).float() for x in (q, k[meta.key_index], v[meta.key_index])), meta, 0.125, 0.0
    )
    # budget: twice plain PyTorch's error from bf16 inputs, plus one bf16 ulp of the output's magnitude
    budget = 2 * (bf16_ref - ref).abs().max().item() + ref.abs().max().item() * 2.0**-7
    assert (out.float().cpu() - ref).abs().max().item() <= budget
