"""The recipe and its failure paths: every misconfiguration stops the run with the reason, before
training (never training silently without a teacher)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf
from verl_runs.launcher import run_main_ppo

from verl_memopd.agent.loop import MemoryAgentConfig
from verl_memopd.losses.actor import OPDLossConfig
from verl_memopd.losses.chunked import Chunking
from verl_memopd.supervision import SupervisionError, load_output_head
from verl_memopd.trainer.config import LOSS_KEYS, DistillConfig, MemopdConfig, MemopdConfigError, from_config
from verl_memopd.trainer.teacher import check_teacher_compatible


def _compose(tmp_path, monkeypatch, *overrides):
    monkeypatch.chdir(tmp_path)  # from outside the repo: the installed plugin must provide the configs
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose("ppo_trainer", overrides=["+recipe=memopd", *overrides])


def test_recipe_and_baselines_compose(tmp_path, monkeypatch, tiny_models):
    teacher = f"memopd.teacher.path={tiny_models.teacher}"
    main = from_config(_compose(tmp_path, monkeypatch, teacher))
    assert (main.layout, main.distill.coef, main.distill.divergence, main.distill.transport) == (
        "packed",
        1.0,
        "reverse_kl",
        "hidden",
    )
    flat = from_config(_compose(tmp_path, monkeypatch, teacher, "memopd.layout=flat"))
    ppo_only = from_config(_compose(tmp_path, monkeypatch, "memopd.distill.coef=0"))
    assert flat.layout == "flat" and flat.uses_teacher
    assert not ppo_only.uses_teacher  # no teacher path needed for PPO alone
    cfg = _compose(tmp_path, monkeypatch, teacher)
    assert cfg.trainer.v1.trainer_mode == "memopd"
    assert cfg.actor_rollout_ref.model.model_type == "memopd_language_model"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["memopd.layout=packd"], "memopd.layout='packd': expected one of"),
        ([], "memopd.teacher.path is not set but memopd.distill.coef > 0"),
        (["memopd.teacher.path=/no/teacher"], "memopd.teacher.path=/no/teacher: no model there"),
        (["+memopd.distill.lamda=1"], "memopd.distill: unknown key(s) ['lamda']"),
        (["memopd.distill.coef=-1"], "memopd.distill.coef=-1 must be >= 0"),
        (["memopd.teacher.placement=elsewhere"], "memopd.teacher.placement='elsewhere'"),
        (["memopd.teacher.n_gpus_per_node=0"], "placement=separate needs n_gpus_per_node >= 1"),
        (["memopd.kl_penalty_coef=-0.1"], "memopd.kl_penalty_coef=-0.1 must be >= 0"),
        (["memopd.audit.every_n_steps=-1"], "memopd.audit.every_n_steps=-1 must be >= 0"),
        (["memopd.distill.top_mass_tokens=-1"], "memopd.distill.top_mass_tokens=-1 must be >= 0"),
        (["memopd.distill.jsd_beta=0.3"], "memopd.distill: OPDLossConfig: jsd_beta is set but divergence is"),
        (["memopd.distill.vocab_chunk_size=0"], "memopd.distill: Chunking: chunk sizes must be >= 1"),
        (["memopd.distill.coef=0", "algorithm.use_kl_in_reward=true"], "would penalise the reward twice"),
        (["memopd.distill.coef=0", "+memopd.agent.prompts.task=x"], "memopd.agent.prompts.task: not a run-time"),
    ],
)
def test_bad_memopd_config_is_refused(tmp_path, monkeypatch, overrides, message):
    with pytest.raises(MemopdConfigError) as err:
        from_config(_compose(tmp_path, monkeypatch, *overrides))
    assert message in str(err.value)


@pytest.mark.parametrize("key, value", [("transport", "logits"), ("divergence", "kl_rev")])
def test_unknown_transport_or_divergence_is_refused(tmp_path, monkeypatch, tiny_models, key, value):
    cfg = _compose(tmp_path, monkeypatch, f"memopd.teacher.path={tiny_models.teacher}", f"memopd.distill.{key}={value}")
    with pytest.raises(Exception, match=value):
        from_config(cfg)


RECIPE = Path(__file__).resolve().parents[1] / "hydra_configs" / "recipe" / "memopd.yaml"


def _defaults(cls) -> dict:
    """A config dataclass's defaults as a tree of the recipe's shape (a nested config dataclass is its own tree)."""
    out = {}
    for f in fields(cls):
        value = f.default_factory() if f.default_factory is not MISSING else f.default
        out[f.name] = _defaults(type(value)) if is_dataclass(value) else value
    return out


def test_the_recipe_states_the_dataclasses_defaults_key_by_key():
    recipe = OmegaConf.to_container(OmegaConf.load(RECIPE).memopd)
    agent = recipe.pop("agent")
    defaults = _defaults(MemopdConfig)
    assert defaults.pop("agent") == {}  # memopd.agent is the agent loop's own config, compared below
    assert recipe == defaults
    assert sorted(agent) == sorted(f.name for f in fields(MemoryAgentConfig))
    assert MemoryAgentConfig.from_mapping(agent) == MemoryAgentConfig()


def test_the_loss_reads_its_distill_keys_by_name_with_the_same_defaults():
    loss = {f.name: f.default for f in fields(OPDLossConfig) if f.name != "vocab_size"}
    distill = _defaults(DistillConfig)
    assert loss == {key: distill[key] for key in LOSS_KEYS}
    assert set(distill) - set(LOSS_KEYS) == {"topk", "teacher_mask"}  # the teacher's transport, the rows' m_T


def test_jsd_beta_and_vocab_chunk_size_reach_the_loss(tmp_path, monkeypatch, tiny_models):
    teacher = f"memopd.teacher.path={tiny_models.teacher}"
    default = from_config(_compose(tmp_path, monkeypatch, teacher)).opd_loss_config(vocab_size=50)
    assert (default.divergence, default.chunking) == ("reverse_kl", Chunking(128, None))
    overrides = ("memopd.distill.divergence=jsd", "memopd.distill.jsd_beta=0.3", "memopd.distill.vocab_chunk_size=16")
    opd = from_config(_compose(tmp_path, monkeypatch, teacher, *overrides)).opd_loss_config(vocab_size=50)
    assert (opd.vocab_size, opd.make_divergence().beta, opd.chunking) == (50, 0.3, Chunking(128, 16))


def test_unresolved_recipe_string_is_refused():
    cfg = OmegaConf.create({"recipe": "memopd"})
    with pytest.raises(MemopdConfigError, match="became the plain string key"):
        from_config(cfg)


def test_teacher_vocabulary_must_match(tiny_models, tmp_path):
    assert check_teacher_compatible(str(tiny_models.student), str(tiny_models.teacher)) > 0
    from transformers import AutoTokenizer

    odd = tmp_path / "odd_teacher"
    shutil.copytree(tiny_models.teacher, odd)
    tok = AutoTokenizer.from_pretrained(odd)
    tok.add_tokens(["<odd_token>"])
    tok.save_pretrained(odd)
    with pytest.raises(SupervisionError, match="teacher: the output head has .* rows but the tokenizer has"):
        check_teacher_compatible(str(tiny_models.student), str(odd))


def test_teacher_output_head_is_read_from_its_files(tiny_models):
    from transformers import AutoModelForCausalLM

    head = load_output_head(str(tiny_models.teacher))
    model = AutoModelForCausalLM.from_pretrained(tiny_models.teacher)
    assert head.shape == model.lm_head.weight.shape
    assert head.equal(model.lm_head.weight.detach())


def test_main_ppo_stops_before_ray_on_a_bad_recipe(tmp_path, tiny_models):
    proc = subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore",
            "-m",
            "verl.trainer.main_ppo",
            "+profile=cpu",
            "+recipe=memopd",
            f"actor_rollout_ref.model.path={tiny_models.student}",
            "ray_kwargs.ray_init.num_gpus=2",
        ],
        cwd=tmp_path,
        env={**os.environ, "VERL_PLATFORM": "cpu"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 1
    assert "memopd.teacher.path is not set" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_teacher_worker_failure_stops_the_run(tmp_path, tiny_models):
    """A teacher that cannot load (corrupt weights) must stop training with its error."""
    broken = tmp_path / "broken_teacher"
    shutil.copytree(tiny_models.teacher, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    data = tmp_path / "data"
    subprocess.run(
        [sys.executable, "-m", "verl_memopd.tasks", "build", "--out", str(data), "--seed", "0", "--preset", "tiny"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    run = run_main_ppo(
        [
            "+profile=cpu",
            "+recipe=memopd",
            "ray_kwargs.ray_init.num_gpus=2",
            f"actor_rollout_ref.model.path={tiny_models.student}",
            f"memopd.teacher.path={broken}",
            f"data.train_files={data / 'train.parquet'}",
            f"data.val_files={data / 'val.parquet'}",
            "data.train_batch_size=2",
            "data.max_response_length=2048",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "critic.ppo_micro_batch_size_per_gpu=2",
            "trainer.total_training_steps=1",
            "trainer.val_before_train=false",
        ],
        tmp_path / "run",
        timeout_s=600,
    )
    assert run.returncode != 0 and not run.steps, run.tail()
    assert "MemopdTeacherWorker" in run.log and "safetensors" in run.log.lower(), run.tail()
