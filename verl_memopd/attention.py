"""Packed attention: executes a layout's :class:`~verl_memopd.segments.SegmentMeta` (stage 3).

Hugging Face models call their attention through ``transformers.AttentionInterface``; every
backend here is registered there under its own name (``hf_name(backend)``: ``memopd_torch``,
``memopd_fa2``, ``memopd_torch_varlen``), so a model runs packed attention after
``model.set_attn_implementation("memopd_torch")`` (or with ``attn_implementation=...`` at load).
The names never contain "flash": transformers treats any such name as a flash-attention request
(it would try to load a flash-attn kernel for it).
transformers builds no mask for an implementation without a mask function, and passes extra
forward kwargs down to the attention function: the metadata travels as ``memopd_segments=``.

Per layer, a model's ``(B, H, L, D)`` query/key/value become streams of ``N = B * L`` rows; only
keys/values are gathered (``key_index``: ``q``'s K/V are repeated per block, its hidden states are
computed once); each segment then attends causally, aligned bottom-right::

    segment t+1:  queries B_t  (Lq)      keys [q ; B_t]  (Lk = P + Lq)

Backends (registry ``BACKENDS``; all take ``q (N, Hq, D)``, gathered ``k, v (Nk, Hkv, D)``):

- ``torch``: per-segment SDPA with an explicit bottom-right causal mask; CPU reference.
- ``flash_attn``: ``flash_attn_varlen_func(..., causal=True)``, flash-attn >= 2.1 (bottom-right
  alignment when Lk > Lq); CUDA, fp16/bf16; imported lazily.
- ``torch_varlen``: ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10), causal, called with the
  arguments the installed torch's signature has (``call_varlen_attn``); CUDA only.

A layout that packs several segments per row is refused under any other attention
implementation (sdpa/eager would let blocks see each other; HF flash-attn would infer boundaries
from position ids), and a ``memopd_*`` attention called without metadata raises.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from verl_memopd.fields import SEGMENTS
from verl_memopd.packing import BatchLayout
from verl_memopd.registry import Registry
from verl_memopd.segments import SegmentMeta

__all__ = [
    "BACKENDS",
    "HF_NAMES",
    "PackedAttentionError",
    "register_backend",
    "scoped_backend",
    "get_backend",
    "hf_name",
    "backend_of",
    "require_packed_attention",
    "attention_implementation",
    "forward_hidden",
    "forward_layout",
    "call_varlen_attn",
]

#: Prefix of the attention implementation names registered with transformers.
HF_PREFIX = "memopd_"
#: backend name -> its transformers attention implementation name.
HF_NAMES: dict[str, str] = {}
#: Backend signature: (q (N, Hq, D), k (Nk, Hkv, D), v (Nk, Hkv, D), meta, scale, dropout) -> (N, Hq, D).
Backend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, SegmentMeta, float, float], torch.Tensor]
BACKENDS = Registry("attention backend")


class PackedAttentionError(RuntimeError):
    """Packed attention asked to run in a way that would not honour the layout's segments."""


def hf_name(backend: str) -> str:
    """The transformers attention implementation name of ``backend``."""
    get_backend(backend)
    return HF_NAMES[backend]


def register_backend(name: str, hf_suffix: Optional[str] = None) -> Callable[[Backend], Backend]:
    """Register a backend and its transformers implementation ``memopd_<hf_suffix or name>``."""
    hf = HF_PREFIX + (hf_suffix or name)

    def deco(fn: Backend) -> Backend:
        if hf in HF_NAMES.values():
            raise ValueError(f"attention implementation {hf!r} is already registered")
        if "flash" in hf:
            raise ValueError(f"{hf!r}: transformers would treat a name containing 'flash' as flash-attention")
        BACKENDS.add(name, fn)
        HF_NAMES[name] = hf
        AttentionInterface.register(hf, _hf_attention(name))
        return fn

    return deco


@contextmanager
def scoped_backend(name: str, fn: Backend) -> Iterator[str]:
    """Register ``fn`` as backend ``name`` for the duration of the block (e.g. a deliberately faulty
    copy in ``python -m verl_memopd.rce --self-test``); yields its transformers name and removes it
    from ``BACKENDS``, ``HF_NAMES`` and transformers' attention registry on exit."""
    register_backend(name)(fn)
    hf = HF_NAMES[name]
    try:
        yield hf
    finally:
        del BACKENDS[name], HF_NAMES[name]
        AttentionInterface._global_mapping.pop(hf, None)


def get_backend(name: str) -> Backend:
    return BACKENDS.lookup(name)


def _hf_attention(backend: str) -> Callable:
    """The function transformers calls per layer: ``(B, H, L, D)`` tensors -> ``((B, L, Hq, D), None)``."""

    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        scaling: Optional[float] = None,
        dropout: float = 0.0,
        sliding_window: Optional[int] = None,
        memopd_segments: Optional[SegmentMeta] = None,
        **_: object,
    ) -> tuple[torch.Tensor, None]:
        where = f"attention {HF_NAMES[backend]!r} (layer {getattr(module, 'layer_idx', '?')})"
        if memopd_segments is None:
            raise PackedAttentionError(
                f"{where} was called without memopd_segments metadata; run the model "
                f"through verl_memopd.attention.forward_layout or pass memopd_segments="
            )
        if attention_mask is not None or sliding_window is not None or not getattr(module, "is_causal", True):
            raise PackedAttentionError(
                f"{where} supports causal full attention only, without a 4-D mask or "
                f"sliding window (got mask={attention_mask is not None}, "
                f"sliding_window={sliding_window})"
            )
        b, hq, length, d = query.shape
        if memopd_segments.num_tokens != b * length:
            raise PackedAttentionError(
                f"{where}: memopd_segments covers {memopd_segments.num_tokens} tokens, the batch has B*L = {b * length}"
            )
        q = query.transpose(1, 2).reshape(b * length, hq, d)
        k, v = (x.transpose(1, 2).reshape(b * length, x.shape[1], d) for x in (key, value))
        if not memopd_segments.keys_are_queries:
            k, v = k.index_select(0, memopd_segments.key_index), v.index_select(0, memopd_segments.key_index)
        scale = d**-0.5 if scaling is None else scaling
        out = BACKENDS[backend](q, k, v, memopd_segments, scale, dropout)
        return out.reshape(b, length, hq, d), None

    attention.__name__ = f"{HF_NAMES[backend]}_attention"
    return attention


@register_backend("torch")
def _torch_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: SegmentMeta, scale: float, dropout: float
) -> torch.Tensor:
    """Reference: one SDPA per segment (``split`` views, so backward concatenates instead of scattering).

    Each segment runs as a batch of one, ``(1, H, L*, D)``: SDPA's fused kernels (CPU flash attention
    included) take 4-D inputs only, a 3-D call falls back to the unfused math path (~1.7x slower on CPU
    at the benchmark's shapes, more memory). Square segments use ``is_causal``; the others an explicit
    bottom-right causal mask ``(Lq, Lk)``, one per distinct shape.
    """
    lq = [qb - qa for qa, qb, _, _ in meta.bounds]
    lk = [kb - ka for _, _, ka, kb in meta.bounds]
    gqa = q.shape[1] != k.shape[1]
    masks: dict[tuple[int, int], torch.Tensor] = {}
    outs = []
    for qs, ks, vs in zip(q.split(lq), k.split(lk), v.split(lk)):
        qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (qs, ks, vs))  # (1, H, L*, D)
        n, m = qs.shape[2], ks.shape[2]
        if n == m:  # square: top-left and bottom-right alignment coincide
            o = F.scaled_dot_product_attention(
                qs, ks, vs, dropout_p=dropout, is_causal=True, scale=scale, enable_gqa=gqa
            )
        else:
            if (n, m) not in masks:
                masks[(n, m)] = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=masks[(n, m)], dropout_p=dropout, scale=scale, enable_gqa=gqa
            )
        outs.append(o.squeeze(0).transpose(0, 1))
    return torch.cat(outs)


def _require_cuda(name: str, q: torch.Tensor) -> None:
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        raise PackedAttentionError(
            f"attention backend {name!r} needs CUDA fp16/bf16 tensors, got {q.device} "
            f"{q.dtype}; use backend 'torch' elsewhere"
        )


@register_backend("flash_attn", hf_suffix="fa2")
def _flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: SegmentMeta, scale: float, dropout: float
) -> torch.Tensor:
    """flash-attn varlen; its causal mask is bottom-right aligned since flash-attn 2.1."""
    _require_cuda("flash_attn", q)
    try:
        import flash_attn
        from flash_attn import flash_attn_varlen_func
    except ImportError as e:
        raise PackedAttentionError(f"attention backend 'flash_attn' needs the flash-attn package ({e})") from None
    major, minor = (int(x) for x in flash_attn.__version__.split(".")[:2])
    if (major, minor) < (2, 1):
        raise PackedAttentionError(f"flash-attn {flash_attn.__version__} aligns causal masks top-left; need >= 2.1")
    return flash_attn_varlen_func(
        q,
        k,
        v,
        meta.cu_seqlens_q,
        meta.cu_seqlens_k,
        meta.max_seqlen_q,
        meta.max_seqlen_k,
        dropout_p=dropout,
        softmax_scale=scale,
        causal=True,
    )


@register_backend("torch_varlen")
def _torch_varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: SegmentMeta, scale: float, dropout: float
) -> torch.Tensor:
    """PyTorch's flash-attention varlen wrapper, called as the installed torch's signature allows."""
    _require_cuda("torch_varlen", q)
    if dropout:
        raise PackedAttentionError("attention backend 'torch_varlen' has no attention dropout")
    from torch.nn.attention.varlen import varlen_attn

    return call_varlen_attn(varlen_attn, q, k, v, meta, scale)


def call_varlen_attn(
    varlen_attn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: SegmentMeta, scale: float
) -> torch.Tensor:
    """Run ``torch.nn.attention.varlen.varlen_attn`` (passed in) causally, whatever its torch version's signature.

    q (N, Hq, D); k, v (Nk, Hkv, D) gathered -> (N, Hq, D). The signature has changed release by release:

    - torch 2.10: ``(..., max_q, max_k, is_causal=False, return_aux=None)`` -- no ``scale``: q is pre-scaled
      by ``scale / D**-0.5`` (the kernel applies its default ``D**-0.5``);
    - torch 2.11: ``(..., *, return_aux=None, scale=None, window_size=(-1, -1))`` -- causal is
      ``window_size=(-1, 0)``; no ``enable_gqa``: with fewer K/V heads the private op underneath
      (``torch.ops.torch_attn._varlen_attn``, whose flash kernel takes them natively, query head h reading
      KV head ``h // (Hq // Hkv)``, SDPA's GQA convention) is called directly (``_private_varlen_gqa``);
      without that op the K/V heads are repeated to Hq here (``repeat_interleave``: on an H200, 8 layers of
      Qwen2.5-3B's 16 / 2 heads, that repeat and its backward cost ~8% of a packed actor step);
    - torch 2.12+: adds ``enable_gqa`` (K/V passed with Hkv heads).

    Both causal spellings reach ``aten._flash_attention_forward(..., is_causal=True)``, whose causal mask is
    bottom-right aligned when Lk > Lq (flash-attn >= 2.1 semantics) -- the alignment our segments need;
    ``python -m verl_memopd.bench.gpucheck`` checks it against the ``torch`` reference on a GPU.
    """
    params = inspect.signature(varlen_attn).parameters
    kwargs: dict[str, object] = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    elif "is_causal" in params:
        kwargs["is_causal"] = True
    else:
        raise PackedAttentionError(
            f"torch {torch.__version__}'s varlen_attn{inspect.signature(varlen_attn)} takes "
            f"neither window_size nor is_causal: cannot ask it for causal attention"
        )
    if "scale" in params:
        kwargs["scale"] = scale
    else:
        q = q * (scale * q.shape[-1] ** 0.5)
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv:
        if hq % hkv:
            raise PackedAttentionError(f"{hq} query heads are not a multiple of {hkv} key/value heads")
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        elif (native := _private_varlen_gqa(varlen_attn, kwargs)) is not None:
            return native(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k)
        else:
            k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)  # (Nk, Hq, D)
    return varlen_attn(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k, **kwargs)


def _private_varlen_gqa(varlen_attn: Callable, public_kwargs: dict) -> Optional[Callable[..., torch.Tensor]]:
    """torch 2.11's ``torch.ops.torch_attn._varlen_attn`` (what ``varlen_attn`` calls; autograd registered)
    as ``f(q, k, v, cu_q, cu_k, max_q, max_k) -> out`` with the public call's causal mask and scale, K/V at
    their own head count; None where ``varlen_attn`` is not the installed torch's own, this torch has no
    such op, or its schema cannot say causal."""
    try:
        from torch.nn.attention import varlen

        if varlen_attn is not varlen.varlen_attn:
            return None
        op = torch.ops.torch_attn._varlen_attn
        names = [a.name for a in op.default._schema.arguments]
    except (ImportError, AttributeError, RuntimeError):
        return None
    if "is_causal" not in names and "window_size" not in names:
        return None
    kwargs: dict[str, object] = {}
    if "is_causal" in names:
        kwargs["is_causal"] = True
    if "window_size" in names:
        kwargs["window_size"] = list(public_kwargs.get("window_size", (-1, 0)))
    if "scale" in public_kwargs and "scale" in names:
        kwargs["scale"] = public_kwargs["scale"]
    elif "scale" in public_kwargs:
        return None

    def call(*args) -> torch.Tensor:
        out = op(*args, **kwargs)
        return out[0] if isinstance(out, (tuple, list)) else out

    return call


# --- running a model on a layout ------------------------------------------------------------------
def backend_of(model: torch.nn.Module) -> Optional[str]:
    """The memopd backend a model's attention implementation selects, or None for any other one."""
    impl = model.config._attn_implementation
    return next((b for b, hf in HF_NAMES.items() if hf == impl), None)


def require_packed_attention(model: torch.nn.Module) -> str:
    """Return the model's memopd backend; raise when its attention would let packed segments mix."""
    backend = backend_of(model)
    if backend is None:
        raise PackedAttentionError(
            f"attention implementation {model.config._attn_implementation!r} would let packed call blocks see "
            f"each other (sdpa/eager ignore the segments; flash-attn infers them from position ids); use one of "
            f"{', '.join(sorted(HF_NAMES.values()))}"
        )
    return backend


@contextmanager
def attention_implementation(model: torch.nn.Module, name: str) -> Iterator[torch.nn.Module]:
    """Temporarily run ``model`` with attention implementation ``name`` (e.g. ``"sdpa"``, ``hf_name("torch")``)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


def forward_hidden(model: torch.nn.Module, layout: BatchLayout) -> torch.Tensor:
    """Final (post-norm) hidden states at the action-predicting positions: (A, H), in layout order.

    Layouts that need segment attention run only under a ``memopd_*`` implementation; plain causal
    layouts run under any implementation (with the segments passed when it is a ``memopd_*`` one).
    """
    backend = require_packed_attention(model) if layout.needs_segment_attention else backend_of(model)
    device = model.get_input_embeddings().weight.device
    kwargs = {} if backend is None else {SEGMENTS: layout.segments.to(device)}
    out = model.base_model(
        input_ids=layout.input_ids.to(device), position_ids=layout.position_ids.to(device), use_cache=False, **kwargs
    )
    hidden = out.last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, layout.action_index.to(device))


def forward_layout(model: torch.nn.Module, layout: BatchLayout) -> torch.Tensor:
    """Full-vocabulary logits at the action-predicting positions of a causal LM: (A, V), in layout order."""
    return model.get_output_embeddings()(forward_hidden(model, layout))
