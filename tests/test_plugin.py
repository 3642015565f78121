"""The plugin as verl sees it: entry-point registrations, Hydra search path, CPU fail-fast checks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from verl_memopd.platform.checks import CpuProfileError, check_cpu_config


def _python(code: str, cwd, env_extra: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_import_verl_loads_our_registrations(tmp_path):
    """verl swallows plugin import errors (DEBUG log): assert every registration, in a fresh process."""
    proc = _python(
        "import json, verl; from verl_memopd.plugin import registered; print(json.dumps(registered()))",
        tmp_path,
        {"VERL_PLATFORM": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    status = json.loads(proc.stdout.strip().splitlines()[-1])
    assert status and all(status.values()), status
    assert "verl_memopd.plugin" in _python("import sys, verl; print(sorted(sys.modules))", tmp_path).stdout


@pytest.mark.parametrize("first", ["verl_memopd.trainer.teacher", "verl_memopd.trainer.critic"])
def test_the_plugin_loads_when_a_worker_module_is_imported_first(tmp_path, first):
    """Ray unpickles MemopdTeacherWorker / MemopdCriticWorker, so such a process imports their module before verl:
    verl's own load of the plugin must still succeed, with every registration (an import cycle through verl would
    fail it, and verl would swallow the error)."""
    proc = _python(
        f"import json, sys, {first}; from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY; "
        "from verl.workers.engine.base import EngineRegistry; "
        "print(json.dumps(['verl_memopd.plugin' in sys.modules, 'memopd' in TRAINER_REGISTRY, "
        "sorted(k for k in EngineRegistry._engines if k.startswith('memopd'))]))",
        tmp_path,
        {"VERL_PLATFORM": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [
        True,
        True,
        ["memopd_language_model", "memopd_teacher", "memopd_value_model"],
    ]


def test_cpu_platform_is_never_auto_detected():
    from verl_memopd.platform.cpu import PlatformCPU

    assert PlatformCPU().is_platform_available(use_smi_check=True) is False


def test_patches_are_idempotent():
    from verl_memopd.platform import patches

    patches.patch_verl_gloo_process_group()
    assert patches.patch_verl_gloo_process_group() is False
    patches.patch_vllm_cpu_weight_sync()
    assert patches.patch_vllm_cpu_weight_sync() is False
    patches.patch_verl_gloo_torchrun_process_group()
    assert patches.patch_verl_gloo_torchrun_process_group() is False


_TORCHRUN_INIT = """
import torch.distributed as dist, verl
from verl.utils.distributed import initialize_global_process_group  # what verl.trainer.sft_trainer.run_sft calls
print(initialize_global_process_group(timeout_second=60), dist.get_backend())
"""


@pytest.mark.parametrize("platform", ["cpu", ""])
def test_torchrun_process_group_is_plain_gloo_on_cpu(tmp_path, platform):
    """verl's SFT trainer (torchrun path) on the cpu platform: a plain gloo group; without the patch
    (no cpu platform selected, on this GPU-less machine) verl's "cpu:gloo,cuda:nccl" cannot start."""
    rendezvous = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(29500 + os.getpid() % 1000 + (platform == "cpu")),
    }
    proc = _python(_TORCHRUN_INIT, tmp_path, {"VERL_PLATFORM": platform, **rendezvous})
    if platform == "cpu":
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip().splitlines()[-1] == "(0, 0, 1) gloo"
    else:
        assert proc.returncode != 0 and "(0, 0, 1) gloo" not in proc.stdout


def _compose(overrides: list[str], tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside the repo: configs must come from the installed package
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose("ppo_trainer", overrides=overrides, return_hydra_config=True)


def test_profile_cpu_composes_from_outside_the_repo(tmp_path, monkeypatch):
    cfg = _compose(["+profile=cpu"], tmp_path, monkeypatch)
    assert cfg.trainer.device == "cpu"
    assert cfg.actor_rollout_ref.actor.strategy == "fsdp2"
    assert cfg.ray_kwargs.ray_init.num_gpus == 1
    # fp32 everywhere: FSDP's default mixed precision (bf16 params + autocast) would ignore dtype=float32
    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    for engine in (cfg.actor_rollout_ref.actor.fsdp_config, cfg.actor_rollout_ref.ref.fsdp_config, cfg.critic.fsdp):
        assert dict(engine.mixed_precision) == fp32
    assert "memopd_cpu_profile_check" in cfg.hydra.callbacks
    assert "profile" not in cfg, "the search path was not applied: +profile=cpu became a plain string key"


def test_recipe_memopd_resolves_to_a_config_tree(tmp_path, monkeypatch):
    cfg = _compose(["+recipe=memopd"], tmp_path, monkeypatch)
    assert "memopd" in cfg and not isinstance(cfg.get("recipe"), str)


def _cpu_cfg(tmp_path, monkeypatch, tiny_models, extra: list[str]):
    return _compose(
        ["+profile=cpu", f"actor_rollout_ref.model.path={tiny_models.student}", "algorithm.adv_estimator=grpo", *extra],
        tmp_path,
        monkeypatch,
    )


def test_cpu_checks_accept_the_profile(tmp_path, monkeypatch, tiny_models):
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    check_cpu_config(_cpu_cfg(tmp_path, monkeypatch, tiny_models, []))


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("actor_rollout_ref.model.path=/no/such/model", "actor_rollout_ref.model.path=/no/such/model: no model"),
        ("actor_rollout_ref.model.override_config.attn_implementation=flash_attention_2", "needs CUDA"),
        ("actor_rollout_ref.actor.strategy=fsdp", "FSDP1 needs an accelerator"),
        ("actor_rollout_ref.rollout.enable_sleep_mode=true", "no sleep mode"),
        ("ray_kwargs.ray_init.num_cpus=2", "set ray_kwargs.ray_init.num_cpus>=3"),
    ],
)
def test_cpu_checks_name_what_to_change(tmp_path, monkeypatch, tiny_models, override, fragment):
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    with pytest.raises(CpuProfileError, match=re.escape(fragment)):
        check_cpu_config(_cpu_cfg(tmp_path, monkeypatch, tiny_models, [override]))


def test_cpu_checks_want_the_cpu_platform(tmp_path, monkeypatch, tiny_models):
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    with pytest.raises(CpuProfileError, match="export VERL_PLATFORM=cpu"):
        check_cpu_config(_cpu_cfg(tmp_path, monkeypatch, tiny_models, []))


def test_main_ppo_fails_fast_instead_of_hanging(tmp_path):
    """The real entry point: a bad CPU config stops before Ray starts, with the reason, exit status 1."""
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore",
            "-m",
            "verl.trainer.main_ppo",
            "+profile=cpu",
            "actor_rollout_ref.model.path=/no/such/model",
            "ray_kwargs.ray_init.num_cpus=2",
        ],
        cwd=tmp_path,
        env={**os.environ, "VERL_PLATFORM": "cpu"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 1
    assert "/no/such/model: no model there" in proc.stderr and "num_cpus>=3" in proc.stderr, proc.stderr[-2000:]
    assert time.monotonic() - start < 120
