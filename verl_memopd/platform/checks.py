"""Fail-fast checks of a verl config for the ``cpu`` platform, run before any Ray process starts.

Wired as a Hydra callback by ``hydra_configs/profile/cpu.yaml`` (``hydra.callbacks``): Hydra calls
:meth:`CpuProfileCheck.on_job_start` with the composed config before verl's ``main``. Each rule
below stands for a failure that otherwise shows up minutes later deep inside a Ray worker, or as
a silent hang; the message says what to change.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

#: Ray actors that reserve one logical CPU each in a verl 0.9.1 V1 run besides the storage units:
#: the TaskRunner (``@ray.remote`` default 1 CPU) and TransferQueue's controller (``num_cpus=1``).
FIXED_CPU_ACTORS = 2


class CpuProfileError(ValueError):
    """A verl setting that cannot work on the ``cpu`` platform."""


def _get(cfg: DictConfig, key: str, default: Any = None) -> Any:
    return OmegaConf.select(cfg, key, default=default)


def _check_model_path(cfg: DictConfig, key: str) -> list[str]:
    path = _get(cfg, key)
    if path is None:
        return []
    if not (Path(str(path)).expanduser() / "config.json").is_file():
        return [
            f"{key}={path}: no model there (no config.json); this machine has no model hub -- build one with "
            f"`python -m verl_memopd.bench.tiny --out DIR` and pass DIR/student (or DIR/teacher)"
        ]
    return []


def check_cpu_config(cfg: DictConfig) -> None:
    """Raise :class:`CpuProfileError` listing every setting that cannot work on the ``cpu`` platform."""
    problems: list[str] = []
    if os.environ.get("VERL_PLATFORM", "").strip().lower() != "cpu":
        problems.append("VERL_PLATFORM is not 'cpu': export VERL_PLATFORM=cpu (verl would pick its CUDA platform)")
    problems += _check_model_path(cfg, "actor_rollout_ref.model.path")
    if _get(cfg, "algorithm.adv_estimator") == "gae":  # only GAE starts a critic
        problems += _check_model_path(cfg, "critic.model.path")
    attn = _get(cfg, "actor_rollout_ref.model.override_config.attn_implementation")
    if attn is not None and "flash" in str(attn):
        problems.append(
            f"actor_rollout_ref.model.override_config.attn_implementation={attn} needs CUDA; use sdpa "
            f"(or a memopd_* packed attention)"
        )
    for role in ("actor", "ref"):
        for key in (f"actor_rollout_ref.{role}.strategy", f"actor_rollout_ref.{role}.fsdp_config.strategy"):
            if _get(cfg, key) not in (None, "fsdp2"):
                problems.append(f"{key}={_get(cfg, key)}: FSDP1 needs an accelerator; set fsdp2")
    for key in ("actor_rollout_ref.rollout.enable_sleep_mode", "actor_rollout_ref.rollout.free_cache_engine"):
        if _get(cfg, key):
            problems.append(f"{key}=true: vLLM's CPU backend has no sleep mode; set false")
    units = int(_get(cfg, "transfer_queue.backend.SimpleStorage.num_data_storage_units", 1))
    num_cpus = _get(cfg, "ray_kwargs.ray_init.num_cpus")
    need = FIXED_CPU_ACTORS + units
    if num_cpus is not None and int(num_cpus) < need:
        problems.append(
            f"ray_kwargs.ray_init.num_cpus={num_cpus}: TransferQueue's controller, its {units} storage "
            f"unit(s) and verl's TaskRunner each reserve a logical CPU, so Ray would wait forever; "
            f"set ray_kwargs.ray_init.num_cpus>={need} (logical CPUs, not cores) or fewer "
            f"transfer_queue.backend.SimpleStorage.num_data_storage_units"
        )
    if problems:
        raise CpuProfileError("verl config cannot run on the cpu platform:\n  - " + "\n  - ".join(problems))


#: every engine's compute dtype key (verl's FSDP ``mixed_precision.param_dtype``) and the rollout's dtype
PRECISION_KEYS = (
    "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype",
    "actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype",
    "critic.fsdp.mixed_precision.param_dtype",
    "actor_rollout_ref.rollout.dtype",
)


def cpu_has_fast_bf16() -> bool:
    """Whether torch's CPU kernels run bf16 matmuls natively here (AVX512-BF16 or AMX tiles)."""
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def precision_warnings(cfg: DictConfig, fast_bf16: bool | None = None) -> list[str]:
    """Warnings (not errors: bf16 runs everywhere) for low-precision settings on a CPU that emulates them."""
    low = [
        f"{key}={_get(cfg, key)}"
        for key in PRECISION_KEYS
        if str(_get(cfg, key, "")).lower() in ("bf16", "bfloat16", "fp16", "float16", "half")
    ]
    if not low or (cpu_has_fast_bf16() if fast_bf16 is None else fast_bf16):
        return []
    return [
        f"{', '.join(low)}: this CPU has neither avx512_bf16 nor amx_bf16, so torch emulates bf16 matmuls "
        f"(several times slower than fp32 here, docs/measurements.md 'bf16 on CPU'); the run stays in the dtype "
        f"asked for -- use +profile=cpu (fp32) for speed"
    ]


class CpuProfileCheck(Callback):
    """Hydra callback: :func:`check_cpu_config` before the job (verl's ``main``) starts.

    Hydra 1.3 turns exceptions raised by callbacks into warnings and carries on, so a failed
    check exits the process instead (``SystemExit`` carries the message to stderr, status 1).
    """

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            check_cpu_config(config)
        except CpuProfileError as e:
            raise SystemExit(f"[verl-memopd] {e}") from None
        for warning in precision_warnings(config):
            print(f"[verl-memopd] warning: {warning}", file=sys.stderr, flush=True)
