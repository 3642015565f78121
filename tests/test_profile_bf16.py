"""The bf16 CPU profile (``+profile=cpu_bf16``): it composes through the installed search path, sets verl's own
precision keys of every engine (actor, reference = teacher, critic) and of the rollout, keeps the master weights and
reductions in fp32, leaves ``+profile=cpu`` in fp32, and warns (never falls back) on a CPU that emulates bf16."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from verl_memopd.platform import checks
from verl_memopd.platform.checks import check_cpu_config, precision_warnings

BF16_MP = {"param_dtype": "bf16", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
FP32_MP = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}


def _compose(overrides: list[str], tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside the repo: the configs come from the installed package
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose("ppo_trainer", overrides=overrides, return_hydra_config=True)


def _engines(cfg):
    return {
        "actor": cfg.actor_rollout_ref.actor.fsdp_config,
        "ref": cfg.actor_rollout_ref.ref.fsdp_config,
        "critic": cfg.critic.fsdp,
    }


def test_cpu_bf16_composes_the_cpu_profile_with_bf16_compute(tmp_path, monkeypatch):
    cfg = _compose(["+profile=cpu_bf16", "+recipe=memopd"], tmp_path, monkeypatch)
    assert "profile" not in cfg, "+profile=cpu_bf16 did not resolve to a config"
    # everything of the CPU profile is there (its start-up check included) ...
    assert cfg.trainer.device == "cpu" and cfg.actor_rollout_ref.actor.strategy == "fsdp2"
    assert cfg.actor_rollout_ref.rollout.enforce_eager and not cfg.actor_rollout_ref.rollout.enable_sleep_mode
    assert "memopd_cpu_profile_check" in cfg.hydra.callbacks and "memopd_recipe_check" in cfg.hydra.callbacks
    # ... and the recipe still wins where both speak (packed attention)
    assert cfg.actor_rollout_ref.model.override_config.attn_implementation == "memopd_torch"
    for name, engine in _engines(cfg).items():
        assert dict(engine.mixed_precision) == BF16_MP, name  # bf16 compute, fp32 gradient reduction
        assert engine.model_dtype == "fp32", name  # fp32 shards: master weights, AdamW state
        assert engine.dtype == "bfloat16", name
    assert cfg.actor_rollout_ref.rollout.dtype == "bfloat16"


def test_the_cpu_profile_stays_fp32(tmp_path, monkeypatch):
    cfg = _compose(["+profile=cpu", "+recipe=memopd"], tmp_path, monkeypatch)
    for name, engine in _engines(cfg).items():
        assert dict(engine.mixed_precision) == FP32_MP and engine.dtype == "float32", name
    assert cfg.actor_rollout_ref.rollout.dtype == "float32"


def test_teacher_worker_takes_the_profiles_precision(tmp_path, monkeypatch, tiny_models):
    """The teacher worker group is configured from the reference's FSDP settings: bf16 compute, fp32 shards."""
    from verl_memopd.trainer.config import from_config
    from verl_memopd.trainer.teacher import teacher_worker_config

    cfg = _compose(
        [
            "+profile=cpu_bf16",
            "+recipe=memopd",
            f"actor_rollout_ref.model.path={tiny_models.student}",
            f"memopd.teacher.path={tiny_models.teacher}",
        ],
        tmp_path,
        monkeypatch,
    )
    engine = teacher_worker_config(cfg, from_config(cfg)).engine_config
    assert dict(engine.mixed_precision) == BF16_MP and engine.model_dtype == "fp32" and engine.forward_only


def test_the_check_accepts_the_bf16_profile(tmp_path, monkeypatch, tiny_models):
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    overrides = ["+profile=cpu_bf16", f"actor_rollout_ref.model.path={tiny_models.student}"]
    check_cpu_config(_compose([*overrides, "algorithm.adv_estimator=grpo"], tmp_path, monkeypatch))


@pytest.mark.parametrize("fast", [True, False])
def test_bf16_on_a_cpu_without_native_bf16_warns_naming_the_keys(tmp_path, monkeypatch, fast):
    bf16 = _compose(["+profile=cpu_bf16"], tmp_path, monkeypatch)
    warnings = precision_warnings(bf16, fast_bf16=fast)
    if fast:
        assert warnings == []
    else:
        assert len(warnings) == 1 and "neither avx512_bf16 nor amx_bf16" in warnings[0]
        for key in checks.PRECISION_KEYS:
            assert f"{key}=" in warnings[0]
    assert precision_warnings(_compose(["+profile=cpu"], tmp_path, monkeypatch), fast_bf16=False) == []


def test_the_warning_follows_this_cpus_flags(tmp_path, monkeypatch):
    """No flag given: the check asks torch about this CPU (avx512_bf16 / AMX tiles)."""
    import torch

    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    warnings = precision_warnings(_compose(["+profile=cpu_bf16"], tmp_path, monkeypatch))
    assert bool(warnings) != native and checks.cpu_has_fast_bf16() == native
