"""Packed attention: backends against a dense-masked reference, HF integration, refusals."""

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

from verl_memopd.attention import (
    BACKENDS, PackedAttentionError, attention_implementation, forward_layout, get_backend, hf_name, register_backend,
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
        lengths = [int(x) for x in torch.randint(1, 7, (int(torch.randint(1, 5, (1,), generator=gen)) + 2,),
                                                 generator=gen)]
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
    out = get_backend("torch")(q, k[meta.key_index], v[meta.key_index], meta, d ** -0.5, 0.0)
    mask = _semantic_mask(seg, row)
    assert torch.equal(meta.visibility(), mask)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1),
                                         v.repeat_interleave(2, 1).transpose(0, 1), attn_mask=mask).transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    weights = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * weights).sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return Qwen2ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def episodes():
    return random_episodes(6, VOCAB, seed=3, shape=EpisodeShape(prefix_len=(2, 12), chunk_len=(1, 8),
                                                                 response_len=(1, 8)))


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
    with pytest.raises(KeyError, match="valid backends: flash_attn, torch, torch_varlen"):
        get_backend("xformers")
    assert "flash" not in hf_name("flash_attn")


def test_cuda_backends_refuse_cpu_tensors():
    meta = segment_meta(torch.tensor([0, 0, 1]), torch.zeros(3, dtype=torch.long))
    q = torch.randn(3, 2, 8)
    for name in ("flash_attn", "torch_varlen"):
        with pytest.raises(PackedAttentionError, match="needs CUDA fp16/bf16"):
            get_backend(name)(q, q[meta.key_index], q[meta.key_index], meta, 0.3, 0.0)


def _has_flash_attn() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.parametrize("name", [
    pytest.param("flash_attn", marks=pytest.mark.skipif(not _has_flash_attn(), reason="needs CUDA and flash-attn")),
    pytest.param("torch_varlen", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
])
def test_cuda_backend_matches_torch_reference(name):
    gen = torch.Generator().manual_seed(0)
    seg, row = _random_stream(gen)
    meta = segment_meta(seg, row)
    q, k, v = (torch.randn(seg.numel(), h, 64, generator=gen) for h in (8, 2, 2))
    ref = get_backend("torch")(q, k[meta.key_index], v[meta.key_index], meta, 0.125, 0.0)
    cuda_meta = meta.to("cuda")
    qc, kc, vc = (x.to("cuda", torch.bfloat16) for x in (q, k, v))
    out = get_backend(name)(qc, kc[cuda_meta.key_index], vc[cuda_meta.key_index], cuda_meta, 0.125, 0.0)
    bf16_ref = get_backend("torch")(*(x.to(torch.bfloat16).float() for x in (q, k[meta.key_index],
                                                                            v[meta.key_index])), meta, 0.125, 0.0)
    # budget: twice plain PyTorch's error from bf16 inputs, plus one bf16 ulp of the output's magnitude
    budget = 2 * (bf16_ref - ref).abs().max().item() + ref.abs().max().item() * 2.0 ** -7
    assert (out.float().cpu() - ref).abs().max().item() <= budget
