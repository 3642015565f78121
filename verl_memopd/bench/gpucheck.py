"""``python -m verl_memopd.bench.gpucheck``: the one script to run first on a GPU machine (<= 10 min on one GPU).

It checks what the CPU tests cannot and prints one line per check (``PASS``/``FAIL``/``SKIP`` last) and
a summary line; exit status 0 when none fails (skips do not fail), 1 otherwise, ``NO_CUDA_STATUS`` (3)
with the reason on a machine without CUDA, ``OLD_DRIVER_STATUS`` (4) when the NVIDIA driver cannot run
torch's CUDA build. A check whose optional package is absent (flash-attn; verl, vLLM and Ray for
``train``) prints ``SKIP`` with the reason, so an image with torch and transformers only runs every
other check and exits 0 when they pass::

    gpucheck driver nvidia=<580.x> driver_cuda=<13.0> source=<libcuda> torch=<2.11.0> torch_cuda=<13.0> PASS
    gpucheck attention backend=flash_attn ... SKIP reason=flash-attn is not installed (optional: ...)
    gpucheck attention backend=torch_varlen tokens=<N> fwd_err=<e> fwd_budget=<b> bwd_err=<e> bwd_budget=<b> PASS
    gpucheck rce model=student dtype=bfloat16 backend=torch_varlen tokens=<A> max_abs_diff=<d> tolerance=<t> ... PASS
    gpucheck rce model=teacher ... PASS
    gpucheck packing speedup_vs_per_call=<x> ideal=<y> efficiency=<x/y> PASS
    gpucheck kl vocab=<V> tokens=<N> peak_mem_ratio=<naive fp32/ours bf16> time_ratio=<ours/naive> grad_err=<e> ... PASS
    gpucheck train ... SKIP reason=needs verl, vllm, ray (not installed)
    gpucheck summary checks=9 passed=6 failed=0 skipped=3 wall_s=<s> PASS

driver
    torch 2.11.0 and vLLM 0.24.0 wheels are CUDA 13.0 builds: the driver must support CUDA 13 (Linux
    driver >= 580.65.06, the R580 branch, or an older data-center driver with the CUDA 13 forward-compatibility
    package). Checked first, before anything asks for a device. The driver's CUDA version is read from the
    first source that answers (``DRIVER_CUDA_SOURCES``): ``cuDriverGetVersion`` of ``libcuda.so.1`` through
    ctypes, ``nvidia-smi``'s "CUDA Version" header, torch's private ``_cuda_getDriverVersion`` (gone in
    torch 2.11); when none answers the line says so (``driver_cuda=unknown``) and the checks go on. Whenever
    ``torch.cuda.is_available()`` the checks run (torch itself has then initialised the driver); otherwise
    an unreadable driver is exit 3 and a too old one exit 4, with what to install. Exit 3 says which of
    two causes it is: a CPU build of torch ("this is a CPU build of torch": install the GPU stack) or a CUDA
    build with no driver answering ("no NVIDIA driver found", each source's failure named: the GPU stack on
    a machine without a GPU or driver).
attention
    The packed layout of random episodes (``bench.packing.SHAPE``), Qwen2.5-3B's head shape
    (16 query heads, 2 KV heads, head_dim 128), run by each CUDA backend (``flash_attn``, ``torch_varlen``)
    in bf16, forward and backward (gradients of a fixed random projection of the output into q and the
    un-gathered k, v). Error budget, flash-attention's own test convention: the error against an fp32
    reference (the ``torch`` backend on the same bf16 inputs, upcast) may be at most ``FWD_FACTOR``
    (forward) / ``BWD_FACTOR`` (gradients) times the error of plain PyTorch in bf16
    (``plain_bf16_attention``: bf16 matmuls, fp32 softmax rounded to bf16) against that reference,
    plus one bf16 ulp of the reference's largest magnitude. Segments with more keys than queries
    make a top-left causal alignment fail this check.
rce
    ``rce.rce_audit`` on the tiny student and teacher (``verl_memopd.bench.tiny``, built in the work dir) in
    bf16 on CUDA: packed (``backend``) vs every call run alone under sdpa, within ``rce.TOLERANCES``.
packing
    ``bench.packing``'s step (forward, full-vocabulary action log-probs, backward) on a 4-layer model
    with Qwen2.5-3B's layer shape and vocabulary, bf16: ``packed`` (``backend``) vs the faster of
    ``per_call`` padded (sdpa) and ``per_call_varlen`` (``backend``). PASS: packed is not slower.
kl
    Full-vocabulary reverse KL (the ``hidden`` transport) forward + backward at the 1-node recipe's
    shapes (student H 2048, teacher H 3584, V 151,936, 4096 positions): ours (``losses.divergence_loss``,
    bf16 inputs, ``CUDA_TOKEN_CHUNK`` rows per chunk) vs naive fp32 (``losses.naive_divergence``), and
    plain PyTorch in bf16 for the tolerance (``bench.kl``'s CUDA variants). Peak memory =
    ``torch.cuda.max_memory_allocated`` during the step minus the allocation before it. PASS: ours needs
    at least ``KL_MIN_MEMORY_RATIO`` times less than naive fp32 and its loss and gradient errors against
    naive fp32 are within ``grad_bound`` / ``loss_bound`` = ``KL_TOLERANCE_FACTOR`` times plain bf16
    PyTorch's error + ``KL_TOLERANCE_FLOOR``.
train
    ``python -m verl.trainer.main_ppo +recipe=memopd`` for ``TRAIN_STEPS`` steps on the tiny models and
    the ``tiny`` task preset, as a subprocess bounded by ``--train-timeout``: vLLM CUDA rollout, FSDP1,
    remove-padding, ``memopd_torch_varlen`` (``memopd_fa2`` with ``--backend flash_attn``) for actor,
    critic and teacher, the teacher colocated on the one GPU,
    the RCE audit at step 2 (``train_command`` lists every override). PASS: exit 0, both steps logged
    with finite metrics and MemOPD's (``TRAIN_METRICS``). Its log is ``<workdir>/train.log``.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import math
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from verl_memopd.experiment.launching import offline_env, parse_steps, run_bounded

__all__ = [
    "NO_CUDA_STATUS",
    "OLD_DRIVER_STATUS",
    "Skip",
    "ModelShape",
    "QWEN_3B",
    "CudaVersions",
    "cuda_versions",
    "driver_cuda_from_libcuda",
    "driver_cuda_from_nvidia_smi",
    "driver_cuda_from_torch",
    "DRIVER_CUDA_SOURCES",
    "driver_check",
    "plain_bf16_attention",
    "attention_check",
    "rce_check",
    "packing_check",
    "kl_check",
    "train_command",
    "train_result",
    "train_check",
    "summary_line",
    "main",
]

#: Exit status when no CUDA device is visible (distinct from a failed check, 1).
NO_CUDA_STATUS = 3
#: Exit status when the NVIDIA driver is older than torch's CUDA build needs.
OLD_DRIVER_STATUS = 4
#: What a CUDA 13 build (torch 2.11.0 / vLLM 0.24.0 wheels, docker/Dockerfile) needs from the driver.
DRIVER_HINT = (
    "a driver for CUDA {major} (CUDA 13.0: Linux driver >= 580.65.06, branch R580 or newer; on data-center "
    "GPUs an older driver plus the CUDA forward-compatibility package cuda-compat-{major}-0)"
)
TRAIN_STEPS = 2
#: metrics the training check requires at every step (MemOPD's supervision ran and reached the loss)
TRAIN_METRICS = (
    "actor/memopd/reverse_kl",
    "memopd/calls_per_episode",
    "memopd/tokens_saved_by_shared_prefix",
    "timing_s/teacher",
    "training/rollout_probs_diff_max",
    "timing_s/step",
)
FWD_FACTOR, BWD_FACTOR = 2.0, 3.0
KL_MIN_MEMORY_RATIO = 8.0
KL_TOLERANCE_FACTOR = 2.0
#: absolute floor added to the kl check's bounds (its loss and relative gradient errors are ~1e-6 .. 1e-2)
KL_TOLERANCE_FLOOR = 1e-6
BF16_ULP = 2.0**-7


class Skip(Exception):
    """Raised by a check that cannot run here for a reason that is no failure (an optional package absent).

    ``fields``: what identifies the check on its line (e.g. ``backend="flash_attn"``)."""

    def __init__(self, reason: str, **fields: object):
        super().__init__(reason)
        self.reason, self.fields = reason, fields


FLASH_ATTN_OPTIONAL = (
    "flash-attn is not installed (optional: the default CUDA backend torch_varlen ships with "
    "torch; docker build --build-arg WITH_FLASH_ATTN=1 or MEMOPD_FLASH_ATTN=1 bash "
    "docker/install.sh gpu adds it)"
)


def require_backend_packages(backend: str) -> None:
    """Skip (not fail) a check of the ``flash_attn`` backend where flash-attn is absent."""
    if backend == "flash_attn" and missing_packages("flash_attn"):
        raise Skip(FLASH_ATTN_OPTIONAL, backend=backend)


def missing_packages(*names: str) -> list[str]:
    """Those of the importable ``names`` that are not installed."""
    return [n for n in names if importlib.util.find_spec(n) is None]


@dataclass(frozen=True)
class ModelShape:
    """Attention heads (query, KV), head_dim, hidden size, MLP width and vocabulary of the checked model."""

    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int


#: Qwen2.5-3B's shape (the student of the 1-node recipe).
QWEN_3B = ModelShape(heads=16, kv_heads=2, head_dim=128, hidden=2048, intermediate=11008, vocab=151936)


@dataclass(frozen=True)
class CudaVersions:
    """What torch was built for and what the installed driver supports (None: unknown / absent)."""

    torch: str
    torch_cuda: Optional[str]  # torch.version.cuda, e.g. "13.0"; None for a CPU build
    driver_cuda: Optional[str]  # highest CUDA version the driver supports (cuDriverGetVersion), e.g. "12.8"
    driver: Optional[str]  # NVIDIA driver version (nvidia-smi), e.g. "570.124.06"
    source: str = "none"  # where driver_cuda came from; when unread, why each source failed


def _major_minor(version: Optional[str]) -> Optional[tuple[int, int]]:
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def _cuda_version_string(code: int) -> Optional[str]:
    """1000 * major + 10 * minor (cuDriverGetVersion's encoding) -> "major.minor"; 0 (no driver) -> None."""
    return f"{code // 1000}.{code % 1000 // 10}" if code > 0 else None


def driver_cuda_from_libcuda() -> Optional[str]:
    """``cuDriverGetVersion`` of the driver library ``libcuda.so.1`` (ctypes; needs no ``cuInit``)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise LookupError(f"libcuda.so.1 not loadable ({e})") from None
    code = ctypes.c_int(0)
    status = lib.cuDriverGetVersion(ctypes.byref(code))
    if status != 0:
        raise LookupError(f"cuDriverGetVersion returned CUDA error {status}")
    return _cuda_version_string(code.value)


def driver_cuda_from_nvidia_smi() -> Optional[str]:
    """The "CUDA Version: X.Y" of ``nvidia-smi``'s header."""
    try:
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LookupError(f"nvidia-smi did not run ({type(e).__name__})") from None
    m = re.search(r"CUDA Version:\s*(\d+\.\d+)", smi.stdout)
    if smi.returncode != 0 or m is None:
        raise LookupError(f"nvidia-smi exit {smi.returncode}, no 'CUDA Version' in its output")
    return m.group(1)


def driver_cuda_from_torch() -> Optional[str]:
    """torch's private ``torch._C._cuda_getDriverVersion`` (present up to torch 2.10)."""
    get = getattr(torch._C, "_cuda_getDriverVersion", None)
    if get is None:
        raise LookupError("torch has no private driver API (torch._C._cuda_getDriverVersion)")
    try:
        return _cuda_version_string(int(get()))
    except RuntimeError as e:
        raise LookupError(
            f"torch._C._cuda_getDriverVersion failed ({str(e).splitlines()[0] if str(e) else e})"
        ) from None


#: Where the driver's CUDA version is read from, in order (the first that answers wins).
DRIVER_CUDA_SOURCES: tuple[tuple[str, Callable[[], Optional[str]]], ...] = (
    ("libcuda", driver_cuda_from_libcuda),
    ("nvidia-smi", driver_cuda_from_nvidia_smi),
    ("torch", driver_cuda_from_torch),
)


def read_driver_cuda() -> tuple[Optional[str], str]:
    """(driver CUDA version or None, its source -- or, when no source answered, why each failed)."""
    failures = []
    for name, read in DRIVER_CUDA_SOURCES:
        try:
            version = read()
        except LookupError as e:
            failures.append(f"{name}: {e}")
            continue
        if version is not None:
            return version, name
        failures.append(f"{name}: reports no driver (version 0)")
    return None, "; ".join(failures)


def _driver_version() -> Optional[str]:
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        smi = None
    if smi is not None and smi.returncode == 0 and smi.stdout.split():
        return smi.stdout.split()[0]
    try:  # the kernel module's own line: "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  ..."
        m = re.search(r"Kernel Module\s+(\d+\.\d+(?:\.\d+)?)", Path("/proc/driver/nvidia/version").read_text())
    except OSError:
        return None
    return m.group(1) if m else None


def cuda_versions() -> CudaVersions:
    """Read the versions without initialising a device (works when the driver is too old for torch)."""
    driver_cuda, source = read_driver_cuda() if torch.version.cuda else (None, "CPU build of torch")
    return CudaVersions(torch.__version__, torch.version.cuda, driver_cuda, _driver_version(), source)


def driver_check(v: CudaVersions, cuda_available: Optional[bool] = None) -> dict:
    """PASS when the driver's CUDA major version covers torch's build (CUDA minor-version compatibility),
    or when torch sees a device (``cuda_available``; default: ask torch): torch then runs on this driver,
    e.g. through the forward-compatibility package, whatever version could be read."""
    need, have = _major_minor(v.torch_cuda), _major_minor(v.driver_cuda)
    covered = need is not None and have is not None and have[0] >= need[0]
    available = torch.cuda.is_available() if cuda_available is None else cuda_available
    passed = need is not None and (covered or available)
    return dict(
        nvidia=v.driver or "?",
        driver_cuda=v.driver_cuda or "unknown",
        source=v.source.replace(" ", "_") if v.driver_cuda else f"unread({v.source})",
        torch=v.torch,
        torch_cuda=v.torch_cuda or "none",
        passed=passed,
    )


def _no_cuda_reason(v: CudaVersions) -> Optional[tuple[int, str]]:
    """(exit status, message) when the GPU checks cannot run here; None when they can."""
    where = f"torch {v.torch}, CUDA build {v.torch_cuda or 'none'}"
    if v.torch_cuda is None:  # the install's fault: the CPU stack
        return NO_CUDA_STATUS, (
            f"no CUDA device visible ({where}): this is a CPU build of torch; install the GPU "
            f"stack (docker/Dockerfile or bash docker/install.sh gpu)"
        )
    if torch.cuda.is_available():  # torch initialised the driver itself: whatever we could read, the checks run
        return None
    if v.driver_cuda is None:  # the machine's: the GPU stack is installed, but no driver answers
        major = _major_minor(v.torch_cuda)[0] if _major_minor(v.torch_cuda) else "?"
        return NO_CUDA_STATUS, (
            f"no CUDA device visible ({where}): no NVIDIA driver found ({v.source}); the GPU stack is "
            f"installed, this machine lacks a GPU or its driver: run on an NVIDIA GPU with "
            f"{DRIVER_HINT.format(major=major)}"
        )
    if not driver_check(v, cuda_available=False)["passed"]:
        major = _major_minor(v.torch_cuda)[0]
        return OLD_DRIVER_STATUS, (
            f"the NVIDIA driver {v.driver or '?'} supports CUDA {v.driver_cuda}, but {where} "
            f"needs {DRIVER_HINT.format(major=major)}"
        )
    if not torch.cuda.is_available():
        return NO_CUDA_STATUS, (
            f"no CUDA device visible ({where}, driver {v.driver or '?'} for CUDA "
            f"{v.driver_cuda}); check CUDA_VISIBLE_DEVICES and nvidia-smi"
        )
    return None


def plain_bf16_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta, scale: float) -> torch.Tensor:
    """Plain PyTorch attention in the inputs' dtype, per segment, bottom-right causal.

    q (N, Hq, D); k, v (Nk, Hkv, D) gathered by ``meta.key_index`` -> (N, Hq, D). Matmuls run in the
    inputs' dtype; the softmax in fp32, its probabilities rounded back to that dtype.
    """
    groups = q.shape[1] // k.shape[1]
    outs = []
    for qa, qb, ka, kb in meta.bounds:
        qs = q[qa:qb].transpose(0, 1)  # (Hq, Lq, D)
        ks, vs = (x[ka:kb].repeat_interleave(groups, dim=1).transpose(0, 1) for x in (k, v))  # (Hq, Lk, D)
        n, m = qb - qa, kb - ka
        scores = (qs @ ks.transpose(1, 2)) * scale  # (Hq, Lq, Lk)
        visible = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
        probs = scores.float().masked_fill(~visible, float("-inf")).softmax(-1).to(q.dtype)
        outs.append((probs @ vs).transpose(0, 1))  # (Lq, Hq, D)
    return torch.cat(outs)


def _packed_meta(episodes: int, seed: int, device: str, vocab: int):
    from verl_memopd.bench.packing import SHAPE
    from verl_memopd.packing import build_layout
    from verl_memopd.rce import random_episodes

    eps = random_episodes(episodes, vocab, seed, SHAPE)
    return build_layout("packed", eps, vocab).segments.to(device)


def _attention_outputs(fn, q, k, v, meta, scale, proj) -> tuple[torch.Tensor, ...]:
    """Output and gradients (q, stream k, stream v) of ``(fn(q, k[idx], v[idx]) * proj).sum()``."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k.index_select(0, meta.key_index), v.index_select(0, meta.key_index), meta, scale)
    (out.float() * proj).sum().backward()
    return tuple(x.detach().float() for x in (out, q.grad, k.grad, v.grad))


def _exact_sdpa(device: str):
    """fp32 reference: SDPA's math kernel, without TF32 (CUDA may otherwise pick a fused kernel)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.backends.cuda.matmul.allow_tf32 = False
    return sdpa_kernel([SDPBackend.MATH])


def attention_check(
    backend: str = "flash_attn", episodes: int = 8, seed: int = 0, device: str = "cuda", shape: ModelShape = QWEN_3B
) -> dict:
    """Packed attention of ``backend`` in bf16 vs an fp32 reference, budgeted by plain bf16 PyTorch's error."""
    from verl_memopd.attention import get_backend

    require_backend_packages(backend)
    meta = _packed_meta(episodes, seed, device, shape.vocab)
    n, d = meta.num_tokens, shape.head_dim
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (
        torch.randn(n, h, d, generator=g, device=device).to(torch.bfloat16)
        for h in (shape.heads, shape.kv_heads, shape.kv_heads)
    )
    proj = torch.randn(n, shape.heads, d, generator=g, device=device)
    scale = d**-0.5
    torch_ref = get_backend("torch")
    with _exact_sdpa(device):
        ref = _attention_outputs(lambda *a: torch_ref(*a, 0.0), q.float(), k.float(), v.float(), meta, scale, proj)
    plain = _attention_outputs(plain_bf16_attention, q, k, v, meta, scale, proj)
    got = _attention_outputs(lambda *a: get_backend(backend)(*a, 0.0), q, k, v, meta, scale, proj)

    def err(xs, i):
        return (xs[i] - ref[i]).abs().max().item()

    def budget(factor, i):
        return factor * err(plain, i) + BF16_ULP * ref[i].abs().max().item()

    fwd_err, fwd_budget = err(got, 0), budget(FWD_FACTOR, 0)
    bwd = [(err(got, i), budget(BWD_FACTOR, i)) for i in (1, 2, 3)]  # dq, dk, dv
    bwd_err, bwd_budget = max(bwd, key=lambda eb: eb[0] / eb[1])
    passed = fwd_err <= fwd_budget and all(e <= b for e, b in bwd)
    return dict(
        backend=backend,
        tokens=n,
        fwd_err=fwd_err,
        fwd_budget=fwd_budget,
        bwd_err=bwd_err,
        bwd_budget=bwd_budget,
        passed=passed,
    )


def tiny_models(workdir: Path) -> tuple[Path, Path]:
    """The tiny student and teacher (``verl_memopd.bench.tiny``) under ``workdir``, built once (torch and
    transformers)."""
    from verl_memopd.bench.tiny import build

    models = workdir / "models"
    if not (models / "tiny.json").exists():
        build(models, seed=0)
    return models / "student", models / "teacher"


def prepare_tiny(workdir: Path) -> tuple[Path, Path, Path]:
    """The tiny models (``tiny_models``) and the ``tiny`` task preset under ``workdir``, once.

    Returns (student, teacher, data folder with train.parquet / val.parquet)."""
    student, teacher = tiny_models(workdir)
    data = workdir / "data"
    if not (data / "train.parquet").exists():
        subprocess.run(
            [sys.executable, "-m", "verl_memopd.tasks", "build", "--out", str(data), "--seed", "0", "--preset", "tiny"],
            check=True,
            capture_output=True,
            text=True,
            timeout=300,
        )
    return student, teacher, data


def rce_check(
    model_path: Path,
    backend: str = "flash_attn",
    episodes: int = 50,
    seed: int = 0,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
) -> dict:
    """``rce.rce_audit`` of a saved model in ``dtype``: packed (``backend``) vs each call alone (sdpa)."""
    from transformers import AutoModelForCausalLM

    require_backend_packages(backend)
    from verl_memopd.rce import random_episodes, rce_audit

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    report = rce_audit(model, random_episodes(episodes, model.config.vocab_size, seed), backend)
    return dict(
        model=Path(model_path).name,
        dtype=report.dtype,
        backend=backend,
        tokens=report.action_tokens,
        max_abs_diff=report.max_abs_diff,
        tolerance=report.tolerance,
        flat_max_abs_diff=report.flat_max_abs_diff,
        passed=report.passed,
    )


def packing_check(
    backend: str = "flash_attn",
    episodes: int = 8,
    layers: int = 4,
    seed: int = 0,
    warmup: int = 2,
    repeats: int = 5,
    device: str = "cuda",
    shape: ModelShape = QWEN_3B,
) -> dict:
    """``bench.packing``'s speed ratio on a model of ``shape``, ``layers`` deep, random weights, bf16."""
    from transformers import Qwen2Config

    require_backend_packages(backend)
    from verl_memopd.attention import hf_name
    from verl_memopd.bench.packing import SHAPE, layout_work, step_seconds
    from verl_memopd.packing import build_layout
    from verl_memopd.rce import random_episodes

    c = shape
    config = Qwen2Config(
        vocab_size=c.vocab,
        hidden_size=c.hidden,
        intermediate_size=c.intermediate,
        num_hidden_layers=layers,
        num_attention_heads=c.heads,
        num_key_value_heads=c.kv_heads,
        head_dim=c.head_dim,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    from verl_memopd.bench.packing import build_model

    model = build_model(config, device, torch.bfloat16 if device != "cpu" else torch.float32)
    eps = random_episodes(episodes, c.vocab, seed, SHAPE)
    layouts = {name: build_layout(name, eps, c.vocab) for name in ("packed", "per_call", "per_call_varlen")}
    seconds = step_seconds(
        model,
        {
            "per_call_padded": (layouts["per_call"], "sdpa"),
            "per_call_varlen": (layouts["per_call_varlen"], hf_name(backend)),
            "packed": (layouts["packed"], hf_name(backend)),
        },
        warmup,
        repeats,
    )
    speedup = min(seconds["per_call_padded"], seconds["per_call_varlen"]) / seconds["packed"]
    ideal = layout_work(layouts["per_call_varlen"], config) / layout_work(layouts["packed"], config)
    return dict(
        speedup_vs_per_call=speedup, ideal=ideal, efficiency=speedup / ideal, seconds=seconds, passed=speedup >= 1.0
    )


def kl_check(
    vocab: int = QWEN_3B.vocab,
    hidden: int = QWEN_3B.hidden,
    teacher_hidden: int = 3584,
    tokens: int = 4096,
    seed: int = 0,
) -> dict:
    """Ours in bf16 vs naive fp32 (memory, time) and vs plain bf16 PyTorch (error), ``bench.kl``'s CUDA variants."""
    from verl_memopd.bench.kl import _cuda_inputs, _cuda_measure, _cuda_prepare, _cuda_run
    from verl_memopd.losses.chunked import CUDA_TOKEN_CHUNK

    x = _cuda_inputs(
        argparse.Namespace(seed=seed, tokens=tokens, hidden=hidden, teacher_hidden=teacher_hidden, vocab=vocab)
    )
    runs = {}
    for variant in ("naive/float32", "naive/bfloat16", f"chunked/bfloat16/{CUDA_TOKEN_CHUNK}"):
        out, sec, peak = _cuda_measure(
            lambda v=variant: _cuda_prepare(v, x),
            lambda i, v=variant: _cuda_run(v, i, CUDA_TOKEN_CHUNK),
            warmup=1,
            repeats=3,
        )
        runs[variant.split("/")[0] + "_" + variant.split("/")[1]] = (out, sec, peak)
        torch.cuda.empty_cache()
    (ref, ref_s, ref_peak), (plain, _, _), (ours, ours_s, ours_peak) = runs.values()

    def err(out):
        return max(float((out[k] - ref[k]).abs().max() / ref[k].abs().max()) for k in ("grad_h", "grad_w")), float(
            (out["loss"] - ref["loss"]).abs()
        )

    (grad_err, loss_err), (plain_grad, plain_loss) = err(ours), err(plain)
    grad_bound, loss_bound = (KL_TOLERANCE_FACTOR * e + KL_TOLERANCE_FLOOR for e in (plain_grad, plain_loss))
    ratio = ref_peak / ours_peak
    return dict(
        vocab=vocab,
        tokens=tokens,
        chunk=CUDA_TOKEN_CHUNK,
        peak_mem_ratio=ratio,
        time_ratio=ours_s / ref_s,
        ms=ours_s * 1e3,
        naive_ms=ref_s * 1e3,
        grad_err=grad_err,
        grad_bound=grad_bound,
        loss_err=loss_err,
        loss_bound=loss_bound,
        naive_peak_gib=ref_peak / 2**30,
        chunked_peak_gib=ours_peak / 2**30,
        passed=ratio >= KL_MIN_MEMORY_RATIO and grad_err <= grad_bound and loss_err <= loss_bound,
    )


def train_command(
    student: Path,
    teacher: Path,
    data: Path,
    workdir: Path,
    steps: int = TRAIN_STEPS,
    attention: str = "memopd_torch_varlen",
) -> list[str]:
    """The 2-step MemOPD run on one GPU: the GPU recipe's path (FSDP1, remove-padding, vLLM CUDA rollout,
    packed ``attention`` for actor, critic and teacher) at the tiny models' scale, the teacher colocated."""
    return [
        sys.executable,
        "-m",
        "verl.trainer.main_ppo",
        "+recipe=memopd",
        f"actor_rollout_ref.model.path={student}",
        f"critic.model.path={student}",
        f"memopd.teacher.path={teacher}",
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'val.parquet'}",
        "data.train_batch_size=4",
        "data.val_batch_size=8",
        "data.max_prompt_length=256",
        "data.max_response_length=2048",
        "memopd.agent.memory_tokens=64",
        "memopd.agent.answer_tokens=32",
        "memopd.teacher.placement=colocate",
        f"memopd.teacher.attn_implementation={attention}",
        f"actor_rollout_ref.model.override_config.attn_implementation={attention}",
        f"critic.model.override_config.attn_implementation={attention}",
        "actor_rollout_ref.model.use_remove_padding=true",
        "critic.model.use_remove_padding=true",
        "actor_rollout_ref.actor.strategy=fsdp",
        "actor_rollout_ref.ref.strategy=fsdp",
        "critic.strategy=fsdp",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
        "actor_rollout_ref.rollout.max_model_len=1024",
        "actor_rollout_ref.rollout.max_num_seqs=16",
        "actor_rollout_ref.rollout.max_num_batched_tokens=4096",
        "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "critic.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.optim.lr=1e-5",
        "memopd.audit.every_n_steps=2",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[console]",
        "trainer.project_name=memopd_gpucheck",
        "trainer.experiment_name=tiny_2_steps",
        f"trainer.default_local_dir={workdir / 'checkpoints'}",
    ]


def train_result(returncode: int, log: str, wall_s: float, steps: int = TRAIN_STEPS) -> dict:
    """Judge a finished training run from its exit status and log (see the module docstring)."""
    parsed = parse_steps(log)
    last = parsed.get(steps, {})
    missing = sorted({k for m in parsed.values() for k in TRAIN_METRICS if k not in m})
    non_finite = sorted({k for m in parsed.values() for k, x in m.items() if not math.isfinite(x)})
    problems = (
        ([f"exit={returncode}"] if returncode else [])
        + ([f"steps={sorted(parsed)}"] if sorted(parsed) != list(range(1, steps + 1)) else [])
        + ([f"missing={','.join(missing)}"] if missing else [])
        + ([f"non_finite={','.join(non_finite)}"] if non_finite else [])
    )

    def metric(key):
        return last.get(key, float("nan"))

    return dict(
        steps=len(parsed),
        wall_s=wall_s,
        step_s=metric("timing_s/step"),
        reverse_kl=metric("actor/memopd/reverse_kl"),
        rollout_probs_diff_max=metric("training/rollout_probs_diff_max"),
        rce_max_abs_diff=metric("memopd/audit/rce_max_abs_diff"),
        problems=";".join(problems) or "none",
        passed=not problems,
    )


#: what the training check needs besides torch and transformers
TRAIN_PACKAGES = ("verl", "vllm", "ray")


def train_check(
    workdir: Path, timeout_s: float, steps: int = TRAIN_STEPS, attention: str = "memopd_torch_varlen"
) -> dict:
    """Run ``train_command`` as a subprocess in its own process group, killed (with its Ray) at ``timeout_s``.
    Skipped where verl, vLLM or Ray is not installed."""
    missing = missing_packages(*TRAIN_PACKAGES)
    if missing:
        raise Skip(f"needs {', '.join(missing)} (not installed; docker/Dockerfile or bash docker/install.sh gpu)")
    if attention == "memopd_fa2" and missing_packages("flash_attn"):
        raise Skip(FLASH_ATTN_OPTIONAL)
    student, teacher, data = prepare_tiny(workdir)
    run = run_bounded(
        train_command(student, teacher, data, workdir, steps, attention),
        workdir,
        offline_env(),
        timeout_s,
        workdir / "train.log",
        who="gpucheck",
    )
    return train_result(run.returncode, run.log, run.wall_s, steps)


def _line(name: str, result: dict, keys: Sequence[str]) -> str:
    fields = " ".join(f"{k}={result[k]:.4g}" if isinstance(result[k], float) else f"{k}={result[k]}" for k in keys)
    return f"gpucheck {name} {fields} {'PASS' if result['passed'] else 'FAIL'}"


def summary_line(passed: int, failed: int, wall_s: float, skipped: int = 0) -> str:
    """The last line: skips are counted apart and fail nothing."""
    return (
        f"gpucheck summary checks={passed + failed + skipped} passed={passed} failed={failed} skipped={skipped} "
        f"wall_s={wall_s:.0f} {'PASS' if failed == 0 else 'FAIL'}"
    )


#: check name -> keys of its line, in order
KEYS = {
    "driver": ["nvidia", "driver_cuda", "source", "torch", "torch_cuda"],
    "attention": ["backend", "tokens", "fwd_err", "fwd_budget", "bwd_err", "bwd_budget"],
    "rce": ["model", "dtype", "backend", "tokens", "max_abs_diff", "tolerance", "flat_max_abs_diff"],
    "packing": ["speedup_vs_per_call", "ideal", "efficiency"],
    "kl": [
        "vocab",
        "tokens",
        "chunk",
        "peak_mem_ratio",
        "time_ratio",
        "ms",
        "naive_ms",
        "grad_err",
        "grad_bound",
        "loss_err",
        "loss_bound",
        "naive_peak_gib",
        "chunked_peak_gib",
    ],
    "train": ["steps", "wall_s", "step_s", "reverse_kl", "rollout_probs_diff_max", "rce_max_abs_diff", "problems"],
}


def run_checks(checks: Sequence[tuple[str, Callable[[], dict]]], out=sys.stdout) -> tuple[int, int, int]:
    """Run each check, print its line (an exception is that check's FAIL, never hides the others; ``Skip`` is
    a SKIP line with its reason); (passed, failed, skipped)."""
    passed = failed = skipped = 0
    for name, run in checks:
        try:
            result = run()
        except Skip as e:
            fields = "".join(f"{k}={v} " for k, v in e.fields.items())
            print(f"gpucheck {name} {fields}reason={e.reason} SKIP", file=out, flush=True)
            skipped += 1
        except Exception as e:
            print(
                f"gpucheck {name} error={type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} FAIL",
                file=out,
                flush=True,
            )
            failed += 1
        else:
            print(_line(name, result, KEYS[name]), file=out, flush=True)
            passed += result["passed"]
            failed += not result["passed"]
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return passed, failed, skipped


CHECKS = ("attention", "rce", "packing", "kl", "train")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m verl_memopd.bench.gpucheck", description=__doc__.split("\n")[0])
    p.add_argument(
        "--backend",
        default="torch_varlen",
        choices=["torch_varlen", "flash_attn"],
        help="packed attention backend of the rce, packing and train checks (default torch_varlen, which "
        "ships with torch; flash_attn needs flash-attn); the attention check runs both",
    )
    p.add_argument("--episodes", type=int, default=8, help="random episodes per layout (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--checks",
        default=",".join(CHECKS),
        help=f"comma-separated subset of {','.join(CHECKS)} (default all; the driver is always checked)",
    )
    p.add_argument("--workdir", default=None, help="tiny models, data and train.log (default: a new temp dir)")
    p.add_argument("--train-timeout", type=float, default=420.0, help="seconds for the training run (default 420)")
    args = p.parse_args(argv)
    wanted = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = sorted(set(wanted) - set(CHECKS))
    if unknown:
        p.error(f"--checks: unknown {unknown}; valid: {', '.join(CHECKS)}")
    from verl_memopd.attention import hf_name

    start = time.monotonic()
    versions = cuda_versions()
    stop = _no_cuda_reason(versions)
    if stop is not None:
        status, message = stop
        if status == OLD_DRIVER_STATUS:
            print(_line("driver", driver_check(versions), KEYS["driver"]), flush=True)
        print(f"gpucheck: {message}. Exit status {status}.", file=sys.stderr)
        return status
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="memopd-gpucheck-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"gpucheck: {torch.cuda.get_device_name(0)}, work dir {workdir}", flush=True)
    checks: list[tuple[str, Callable[[], dict]]] = [("driver", lambda: driver_check(versions))]
    if "attention" in wanted:
        checks += [
            ("attention", lambda b=b: attention_check(b, args.episodes, args.seed))
            for b in ("torch_varlen", "flash_attn")
        ]
    if "rce" in wanted:
        checks += [
            ("rce", lambda m=m: rce_check(tiny_models(workdir)[m], args.backend, seed=args.seed)) for m in (0, 1)
        ]
    if "packing" in wanted:
        checks.append(("packing", lambda: packing_check(args.backend, args.episodes, seed=args.seed)))
    if "kl" in wanted:
        checks.append(("kl", lambda: kl_check(seed=args.seed)))
    if "train" in wanted:
        checks.append(("train", lambda: train_check(workdir, args.train_timeout, attention=hf_name(args.backend))))
    passed, failed, skipped = run_checks(checks)
    print(summary_line(passed, failed, time.monotonic() - start, skipped), flush=True)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
