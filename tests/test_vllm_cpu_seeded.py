"""vLLM-CPU, seeded requests under chunked prefill: the generator rewind of a discarded
sample, done by state on CPU (``platform.patches.patch_vllm_cpu_seeded_chunked_prefill``).

The runner here is a stand-in with vLLM's attribute names (``input_batch.generators``,
``input_batch.num_reqs``, ``discard_request_mask.np``); its ``_bookkeeping_sync`` does what vLLM's does
with the generators (``gen.set_offset(gen.get_offset() - 4)`` for discarded requests), so unpatched it
raises vLLM's own error on CPU generators.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from verl_memopd.platform.patches import _bookkeeping_restoring_rng, _sample_keeping_discarded_rng


class FakeRunner:
    def __init__(self, seeds, discard):
        gens = {}
        for i, seed in enumerate(seeds):
            if seed is not None:
                gens[i] = torch.Generator("cpu")
                gens[i].manual_seed(seed)
        self.input_batch = SimpleNamespace(generators=gens, num_reqs=len(seeds))
        self.discard_request_mask = SimpleNamespace(np=np.array(discard + [False] * 4))

    def _sample(self):  # one draw per request, from its own generator when seeded
        return [
            torch.rand(1, generator=self.input_batch.generators.get(i)).item() for i in range(self.input_batch.num_reqs)
        ]

    def _bookkeeping_sync(self):  # vLLM 0.32's loop over the discarded requests
        for i in np.nonzero(self.discard_request_mask.np[: self.input_batch.num_reqs])[0]:
            gen = self.input_batch.generators.get(int(i))
            if gen is not None:
                gen.set_offset(gen.get_offset() - 4)
        return "done"


class Patched(FakeRunner):
    _sample = _sample_keeping_discarded_rng(FakeRunner._sample)
    _bookkeeping_sync = _bookkeeping_restoring_rng(FakeRunner._bookkeeping_sync)


def test_unpatched_cpu_generators_raise_vllms_error():
    runner = FakeRunner([7, 8], [True, False])
    runner._sample()
    with pytest.raises(RuntimeError, match="CPU Generator does not use offset"):
        runner._bookkeeping_sync()


def test_a_discarded_sample_consumes_no_randomness():
    # request 0 is prefilled in two chunks (first sample discarded), request 1 in one; request 2 is unseeded
    chunked = Patched([7, 8, None], [True, False, False])
    first = chunked._sample()
    assert chunked._bookkeeping_sync() == "done"
    chunked.discard_request_mask.np[:] = False
    second = chunked._sample()
    chunked._bookkeeping_sync()
    whole = Patched([7, 8, None], [False, False, False])  # the same request prefilled at once
    alone = whole._sample()
    assert second[0] == alone[0]  # request 0's kept sample is the one it draws without chunking
    assert first[1] == alone[1] and second[1] != first[1]  # request 1 advanced as usual
    assert set(chunked.input_batch.generators) == {0, 1}


def test_the_patch_applies_to_vllms_cpu_runner_once():
    pytest.importorskip("vllm")
    from verl_memopd.platform.patches import patch_vllm_cpu_seeded_chunked_prefill

    patch_vllm_cpu_seeded_chunked_prefill()
    assert patch_vllm_cpu_seeded_chunked_prefill() is False  # idempotent
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert CPUModelRunner._bookkeeping_sync.memopd_patched and CPUModelRunner._sample.memopd_patched
    assert not getattr(GPUModelRunner._bookkeeping_sync, "memopd_patched", False)  # CUDA keeps its offset rewind
