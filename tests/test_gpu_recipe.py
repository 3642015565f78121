"""The GPU recipe runs without flash-attn: packed attention through torch's own varlen kernel, GPU-sized KL chunks.

Composed under verl's config from the script's dry run (``tests/test_deploy.py``'s helpers): actor, critic
and teacher use ``memopd_torch_varlen`` (a backend that needs nothing beyond torch), no argument names a
flash-attn-only option, the distillation loss runs ``CUDA_TOKEN_CHUNK`` positions per chunk, and
``ATTENTION=memopd_fa2`` (flash-attn installed) switches all three models at once. The one-GPU recipe
(``ONE_GPU``) composes the same way onto one GPU with the teacher colocated; both GPU recipes pass the checks
``verl.trainer.main_ppo`` runs on its config before starting anything (verl's ``validate_config`` and our
recipe check), and the one-GPU header states its memory and step time as estimates until measured. The
separate_async recipe (``SEPARATE``) is the 1-node recipe plus the async overrides: trainer / teacher / standalone
rollout pool on one node, the nccl checkpoint engine, bypass mode and verl's batch rule, checked as on a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess

import pytest
from test_deploy import MAIN, RECIPES, _flat, compose_recipe, recipe_overrides

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


SEPARATE = "run_memopd_separate_async_1node.sh"
#: where the separate_async recipe differs from the sync 1-node recipe's composed config, by design
SEPARATE_ONLY = {
    "memopd.trainer.base",
    "actor_rollout_ref.hybrid_engine",
    "actor_rollout_ref.rollout.nnodes",
    "actor_rollout_ref.rollout.n_gpus_per_node",
    "actor_rollout_ref.rollout.checkpoint_engine.backend",
    "actor_rollout_ref.rollout.gpu_memory_utilization",
    "algorithm.rollout_correction.bypass_mode",
    "trainer.v1.separate_async.parameter_sync_step",
    "trainer.n_gpus_per_node",
}


def _separate_env(**env):
    return {"ROLLOUT_GPUS_PER_NODE": "2", "PARAMETER_SYNC_STEP": "2", "HYBRID": "0", "GPUS_PER_NODE": "8", **env}


def test_separate_async_recipe_splits_one_node_into_trainer_teacher_and_a_standalone_rollout_pool(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    for var in ("TEACHER_GPUS_PER_NODE", "NNODES", "EXPERIMENT", "ATTENTION"):
        monkeypatch.delenv(var, raising=False)
    cfg = compose_recipe(SEPARATE, _separate_env())
    rollout = cfg.actor_rollout_ref.rollout
    assert cfg.memopd.trainer.base == "separate_async" and cfg.trainer.v1.trainer_mode == "memopd"
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (1, 4)
    assert (cfg.memopd.teacher.placement, cfg.memopd.teacher.n_gpus_per_node) == ("separate", 2)
    assert (rollout.nnodes, rollout.n_gpus_per_node, rollout.checkpoint_engine.backend) == (1, 2, "nccl")
    assert cfg.actor_rollout_ref.hybrid_engine is False and rollout.gpu_memory_utilization == 0.8
    assert cfg.trainer.n_gpus_per_node + cfg.memopd.teacher.n_gpus_per_node + rollout.n_gpus_per_node == 8
    assert cfg.algorithm.rollout_correction.bypass_mode and rollout.calculate_log_probs
    sync_step = cfg.trainer.v1.separate_async.parameter_sync_step
    assert cfg.data.train_batch_size == sync_step * cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 2 * 24
    # the sync recipe plus the async overrides: models, data, lengths and learning rates stay matched
    main, sep = _flat(compose_recipe(MAIN)), _flat(cfg)
    differ = {k for k in main.keys() | sep.keys() if main.get(k, "<absent>") != sep.get(k, "<absent>")}
    assert differ - {"trainer.experiment_name", "trainer.default_local_dir"} == SEPARATE_ONLY
    # the teacher colocated: the trainer takes its 2 GPUs; a hybrid engine keeps the sync recipe's vLLM share
    colocated = compose_recipe(SEPARATE, _separate_env(TEACHER_GPUS_PER_NODE="0", HYBRID="1", PARAMETER_SYNC_STEP="4"))
    assert colocated.memopd.teacher.placement == "colocate" and colocated.trainer.n_gpus_per_node == 6
    assert colocated.actor_rollout_ref.hybrid_engine is True
    assert colocated.actor_rollout_ref.rollout.gpu_memory_utilization == 0.4
    assert colocated.actor_rollout_ref.actor.ppo_mini_batch_size == colocated.critic.ppo_mini_batch_size == 12


def test_separate_async_recipe_passes_the_start_up_checks_on_gpu_and_refuses_naive(tiny_models, tmp_path, monkeypatch):
    """``_check_trainer_base`` as ``main_ppo``'s recipe check runs it on a GPU machine (trainer.device=cuda, no
    VERL_PLATFORM=cpu), plus verl's ``validate_config``; the in-process ``naive`` engine cannot reach the pool."""
    from omegaconf import open_dict
    from verl.trainer.main_ppo import need_critic
    from verl.utils.config import validate_config

    from verl_memopd.trainer.config import MemopdConfigError, _check_trainer_base, from_config

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    monkeypatch.delenv("TEACHER_GPUS_PER_NODE", raising=False)
    env = _separate_env(STUDENT=str(tiny_models.student), TEACHER=str(tiny_models.teacher))
    cfg = compose_recipe(SEPARATE, env)
    assert cfg.trainer.device == "cuda"
    _check_trainer_base(cfg, "separate_async")
    memopd = from_config(cfg)  # the whole recipe check: memopd tree, agent, data lengths, trainer base
    assert memopd.trainer.base == "separate_async" and memopd.uses_reference
    validate_config(cfg, use_reference_policy=memopd.uses_reference, use_critic=need_critic(cfg))

    naive = compose_recipe(SEPARATE, env)
    with open_dict(naive):
        del naive.actor_rollout_ref.rollout.checkpoint_engine["backend"]  # verl's default: naive
    with pytest.raises(MemopdConfigError, match=r"separate_async needs .*checkpoint_engine.backend=nccl"):
        _check_trainer_base(naive, "separate_async")
    with open_dict(naive):
        naive.actor_rollout_ref.rollout.checkpoint_engine.backend = "naive"
    with pytest.raises(MemopdConfigError, match=r"'naive' only updates colocated replicas"):
        from_config(naive)
    monkeypatch.setenv("VERL_PLATFORM", "cpu")  # the same recipe on the cpu platform: no transport there
    with pytest.raises(MemopdConfigError, match=r"cpu platform"):
        _check_trainer_base(cfg, "separate_async")


def test_separate_async_recipe_refuses_a_sync_step_that_breaks_verls_batch_rule_and_checks_cupy_first(tmp_path):
    done = subprocess.run(
        ["bash", str(RECIPES / SEPARATE)],
        env={**os.environ, "MEMOPD_DRY_RUN": "1", "PARAMETER_SYNC_STEP": "5"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "must divide data.train_batch_size=48" in done.stderr
    text = (RECIPES / SEPARATE).read_text()
    head = text.split("set -euo pipefail")[0]
    for what in ("NOT RUN", "Memory, ESTIMATED (never measured", "Step time, ESTIMATED (never measured)", "580.65.06"):
        assert what in head, f"{SEPARATE}: the header must say {what!r}"
    assert "cupy-cuda13x==14.0.1" in head and "nccl_checkpoint_engine" in head
    # the pre-flight imports what verl's nccl engine imports, and names the install when it fails
    assert "import verl.checkpoint_engine.nccl_checkpoint_engine" in text and "nccl_available()" in text
    if importlib.util.find_spec("cupy") is not None:
        return  # a launch would go on to download the models and start Ray
    # an environment without cupy (the CPU stack): a launch stops at the check, before Ray or any download
    fake = tmp_path / "models"
    done = subprocess.run(
        ["bash", str(RECIPES / SEPARATE)],
        env={**os.environ, "STUDENT": str(fake / "s"), "TEACHER": str(fake / "t"), "MEMOPD_DATA": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3 and "pip install cupy-cuda13x==14.0.1" in done.stderr, done.stderr[-2000:]
    assert not fake.exists()
