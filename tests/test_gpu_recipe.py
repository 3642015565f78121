"""The GPU recipe runs without flash-attn: packed attention through torch's own varlen kernel, GPU-sized KL chunks.

Composed under verl's config from the script's dry run (``tests/test_deploy.py``'s helpers): actor, critic
and teacher use ``memopd_torch_varlen`` (a backend that needs nothing beyond torch), no argument names a
flash-attn-only option, the distillation loss runs ``CUDA_TOKEN_CHUNK`` positions per chunk, and
``ATTENTION=memopd_fa2`` (flash-attn installed) switches all three models at once.
"""

from __future__ import annotations

import pytest
from test_deploy import MAIN, compose_recipe, recipe_overrides

from verl_memopd.attention import BACKENDS, HF_NAMES
from verl_memopd.losses.chunked import CUDA_TOKEN_CHUNK

#: flash-attn-only spellings: transformers' flash implementations and our flash-attn backend
FLASH_ONLY = ("flash_attention", "flash_attn", "memopd_fa2", "fa2")


def _attention_of(cfg) -> tuple[str, str, str]:
    return (
        cfg.actor_rollout_ref.model.override_config.attn_implementation,
        cfg.critic.model.override_config.attn_implementation,
        cfg.memopd.teacher.attn_implementation,
    )


def test_gpu_recipe_composes_with_torch_varlen_and_names_no_flash_attn_option(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ATTENTION", raising=False)
    args = recipe_overrides(MAIN)
    assert not [a for a in args if any(f in a.lower() for f in FLASH_ONLY)], "the GPU recipe names a flash-attn option"
    cfg = compose_recipe(MAIN)
    assert _attention_of(cfg) == ("memopd_torch_varlen",) * 3
    assert HF_NAMES["torch_varlen"] == "memopd_torch_varlen" and "torch_varlen" in BACKENDS
    assert cfg.memopd.distill.token_chunk_size == CUDA_TOKEN_CHUNK == 512
    assert cfg.actor_rollout_ref.model.use_remove_padding and cfg.actor_rollout_ref.rollout.name == "vllm"


@pytest.mark.parametrize("attention", ["memopd_fa2", "memopd_torch"])
def test_attention_env_switches_all_three_models(attention, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = compose_recipe(MAIN, {"ATTENTION": attention})
    assert _attention_of(cfg) == (attention,) * 3
