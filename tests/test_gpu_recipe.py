"""The GPU recipe runs without flash-attn: packed attention through torch's own varlen kernel, GPU-sized KL chunks.

Composed under verl's config from the script's dry run (``tests/test_deploy.py``'s helpers): actor, critic
and teacher use ``memopd_torch_varlen`` (a backend that needs nothing beyond torch), no argument names a
flash-attn-only option, the distillation loss runs ``CUDA_TOKEN_CHUNK`` positions per chunk, and
``ATTENTION=memopd_fa2`` (flash-attn installed) switches all three models at once. The one-GPU recipe
(``ONE_GPU``) composes the same way onto one GPU with the teacher colocated; both GPU recipes pass the checks
``verl.trainer.main_ppo`` runs on its config before starting anything (verl's ``validate_config`` and our
recipe check), and the one-GPU header states its memory and step time as estimates until measured.
"""

from __future__ import annotations

import pytest
from test_deploy import MAIN, RECIPES, compose_recipe, recipe_overrides

from verl_memopd.attention import BACKENDS, HF_NAMES
from verl_memopd.losses.chunked import CUDA_TOKEN_CHUNK

ONE_GPU = "run_memopd_qwen2.5_0.5b_1.5b_1gpu.sh"
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


def test_one_gpu_recipe_composes_onto_one_gpu_with_the_teacher_colocated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for var in ("ATTENTION", "STUDENT", "TEACHER", "MEMOPD_DATA"):
        monkeypatch.delenv(var, raising=False)
    args = recipe_overrides(ONE_GPU)
    assert not [a for a in args if any(f in a.lower() for f in FLASH_ONLY)], "the recipe names a flash-attn option"
    cfg = compose_recipe(ONE_GPU)
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (1, 1)
    assert cfg.memopd.teacher.placement == "colocate" and cfg.memopd.teacher.state == "aligned"
    assert cfg.actor_rollout_ref.model.path.endswith("Qwen2.5-0.5B-Instruct")
    assert cfg.critic.model.path == cfg.actor_rollout_ref.model.path
    assert cfg.memopd.teacher.path.endswith("Qwen2.5-1.5B-Instruct")
    assert cfg.data.train_files.endswith("memopd_small/train.parquet")
    assert _attention_of(cfg) == ("memopd_torch_varlen",) * 3
    assert cfg.memopd.distill.token_chunk_size == CUDA_TOKEN_CHUNK and cfg.memopd.distill.coef == 1.0
    assert cfg.actor_rollout_ref.rollout.name == "vllm" and cfg.actor_rollout_ref.rollout.gpu_memory_utilization <= 0.4
    # the packed episode (4 memory calls of <= 256 tokens + the answer call) fits the response length
    assert cfg.data.max_response_length >= 2 * 4 * cfg.memopd.agent.memory_tokens + cfg.memopd.agent.answer_tokens


@pytest.mark.parametrize("script", [MAIN, ONE_GPU])
def test_gpu_recipes_pass_the_checks_main_ppo_runs_before_starting(script, tiny_models, tmp_path, monkeypatch):
    """What ``python -m verl.trainer.main_ppo`` checks first: verl's ``validate_config`` (batch sizes against
    the GPUs, actor and critic configs) and the recipe's Hydra callback (``memopd:`` tree, agent settings).
    verl reads the model folders' configs there, so the tiny models stand in for the Qwen2.5 ones."""
    from verl.trainer.main_ppo import need_critic
    from verl.utils.config import validate_config

    from verl_memopd.trainer.config import from_config

    monkeypatch.chdir(tmp_path)
    cfg = compose_recipe(script, {"STUDENT": str(tiny_models.student), "TEACHER": str(tiny_models.teacher)})
    memopd = from_config(cfg)
    assert memopd.teacher.placement == ("colocate" if script == ONE_GPU else "separate")
    assert memopd.uses_reference and need_critic(cfg)  # the reference via memopd.kl_penalty_coef, not verl's KL
    validate_config(cfg, use_reference_policy=memopd.uses_reference, use_critic=need_critic(cfg))


def test_one_gpu_recipe_states_memory_and_step_time_as_estimates():
    head = (RECIPES / ONE_GPU).read_text().split("set -euo pipefail")[0]
    assert "one 80 GB GPU" in head and "580.65.06" in head
    for what in ("Memory, ESTIMATED (not yet measured", "Step time, ESTIMATED (not measured)"):
        assert what in head, f"{ONE_GPU}: the header must say {what!r}"
    assert "GB peak" in head and "s per step" in head
