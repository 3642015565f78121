"""``python -m verl_memopd.gpucheck`` on a machine without CUDA, and its machinery on CPU.

The GPU checks themselves (flash-attn, CUDA memory) run only on a GPU; here: the no-CUDA exit
status and message, the plain-PyTorch attention that sets the bf16 budget, and the attention and
packing checks end to end with the ``torch`` backend on a small shape.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from verl_memopd.attention import get_backend
from verl_memopd.gpucheck import NO_CUDA_STATUS, ModelShape, _packed_meta, attention_check, packing_check, \
    plain_bf16_attention

SMALL = ModelShape(heads=4, kv_heads=2, head_dim=32, hidden=128, intermediate=256, vocab=512)
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine-without-CUDA path")


@needs_no_cuda
def test_exits_with_distinct_status_and_says_why_without_cuda():
    done = subprocess.run([sys.executable, "-m", "verl_memopd.gpucheck"], capture_output=True, text=True, timeout=120)
    assert done.returncode == NO_CUDA_STATUS == 3, done.stdout + done.stderr
    assert "no CUDA device visible" in done.stderr
    assert "gpucheck attention" not in done.stdout


def test_plain_attention_equals_torch_backend_in_fp32():
    meta = _packed_meta(2, 0, "cpu", SMALL.vocab)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(meta.num_tokens, h, 32, generator=g) for h in (4, 2, 2))
    k, v = k[meta.key_index], v[meta.key_index]
    ref = get_backend("torch")(q, k, v, meta, 0.2, 0.0)
    assert torch.allclose(plain_bf16_attention(q, k, v, meta, 0.2), ref, atol=1e-5)


def test_attention_check_runs_and_torch_bf16_is_within_budget():
    result = attention_check("torch", episodes=1, device="cpu", shape=SMALL)
    assert result["passed"], result
    assert 0 < result["fwd_err"] <= result["fwd_budget"] and 0 < result["bwd_err"] <= result["bwd_budget"]


def test_packing_check_runs():
    result = packing_check("torch", episodes=2, layers=1, warmup=0, repeats=1, device="cpu", shape=SMALL)
    assert set(result["seconds"]) == {"per_call_padded", "per_call_varlen", "packed"}
    assert result["ideal"] > 1 and result["speedup_vs_per_call"] > 0
