"""The ``cpu`` platform: verl's device abstraction answered for a CPU-only host.

Registered under ``PlatformRegistry`` name ``cpu`` by :mod:`verl_memopd.plugin`; verl selects it
when ``VERL_PLATFORM=cpu``. Choices that keep verl's GPU-shaped code paths working unchanged:

- ``device_name`` is ``"cpu"``: tensors, FSDP2 and the engine run on the CPU;
- collectives use ``gloo`` (verl builds ``init_process_group(backend=...)`` from this name);
- the Ray resource is still ``"GPU"``: verl's resource pools count GPUs, so a CPU cluster
  declares logical GPUs (``ray_init.num_gpus``); one logical GPU = one training process;
- memory, cache, profiler and NVTX helpers are no-ops.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import ModuleType
from typing import Any, Optional

import torch
from verl.plugin.platform import PlatformBase


class _CpuDeviceModule:
    """What verl expects of ``torch.<device>`` (``get_torch_device()``), answered for the CPU.

    ``torch.cpu`` lacks the memory and RNG functions of ``torch.cuda``; verl calls them for
    metrics and checkpoints. Memory figures are the process's resident set (psutil), so
    verl's ``perf/max_memory_*`` metrics report real CPU memory; caches are no-ops.
    """

    def __getattr__(self, name: str):
        return getattr(torch.cpu, name)

    @staticmethod
    def _rss() -> int:
        import psutil

        return psutil.Process().memory_info().rss

    memory_allocated = memory_reserved = max_memory_allocated = max_memory_reserved = _rss

    @staticmethod
    def mem_get_info(device=None) -> tuple[int, int]:
        import psutil

        vm = psutil.virtual_memory()
        return vm.available, vm.total

    @staticmethod
    def get_device_properties(device=None):
        from types import SimpleNamespace

        import psutil

        return SimpleNamespace(name="CPU", total_memory=psutil.virtual_memory().total)

    @staticmethod
    def get_device_name(device=None) -> str:
        return "CPU"

    get_rng_state = staticmethod(torch.get_rng_state)
    set_rng_state = staticmethod(torch.set_rng_state)

    @staticmethod
    def _noop(*args, **kwargs) -> None:
        return None

    empty_cache = ipc_collect = reset_peak_memory_stats = set_device = synchronize = _noop


class PlatformCPU(PlatformBase):
    """verl platform for CPU-only hosts (gloo collectives, logical Ray GPUs)."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return _CPU_DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Never auto-detected: a GPU host must not silently fall back to CPU.
        return False

    def current_device(self) -> str:
        # verl passes this straight to ``.to(device=...)``; an integer would mean "accelerator 0".
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_gpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


_CPU_DEVICE_MODULE = _CpuDeviceModule()
