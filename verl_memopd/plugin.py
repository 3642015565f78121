"""What verl's ``verl.plugins`` entry point loads: registrations (and, on CPU only, patches).

verl imports every ``verl.plugins`` entry point in every process that imports verl (driver,
TaskRunner, workers) and logs failures only at DEBUG level, so :func:`registered` exists for
tests and start-up checks to assert that everything below is in place. With
``VERL_PLATFORM=cpu`` the CPU patches of ``verl_memopd.platform.patches`` are applied here too:
this entry point is the only code of ours that runs in every verl process.
"""

from __future__ import annotations

import os

from verl.plugin.platform import PlatformRegistry

from verl_memopd.platform.cpu import PlatformCPU
from verl_memopd.platform.patches import apply_verl_cpu_patches

PlatformRegistry.register(platform="cpu")(PlatformCPU)
if os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu":
    apply_verl_cpu_patches()


def _register_cpu_engines() -> None:
    """Make verl's FSDP engines (actor/ref and critic) available on the ``cpu`` device."""
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    for model_type, engine_cls in (("language_model", FSDPEngineWithLMHead), ("value_model", FSDPEngineWithValueHead)):
        for backend in ("fsdp", "fsdp2"):
            if "cpu" not in EngineRegistry._engines.get(model_type, {}).get(backend, {}):
                EngineRegistry.register(model_type=model_type, backend=backend, device="cpu")(engine_cls)


_register_cpu_engines()

# verl's agent-loop registry: the memory agent (``agent_name: memopd_memory_agent`` in dataset rows) and its
# replay of recorded trajectories (``memopd_replay_agent``)
import verl_memopd.agent.loop  # noqa: E402,F401  (registers on import)
import verl_memopd.agent.replay  # noqa: E402,F401

# verl's engine registry (memopd_language_model / memopd_value_model / memopd_teacher) and trainer
# registry (trainer.v1.trainer_mode=memopd)
import verl_memopd.trainer.engine  # noqa: E402,F401
import verl_memopd.trainer.ppo  # noqa: E402,F401


def registered() -> dict[str, bool]:
    """Which of our registrations are live in this process (for tests and start-up checks)."""
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
    from verl.workers.engine.base import EngineRegistry

    from verl_memopd.agent.replay import REPLAY_AGENT_NAME
    from verl_memopd.tasks.dataset import AGENT_NAME

    return {
        **{f"agent_loop:{name}": name in _agent_loop_registry for name in (AGENT_NAME, REPLAY_AGENT_NAME)},
        "trainer:memopd": "memopd" in TRAINER_REGISTRY,
        **{
            f"engine:{m}": m in EngineRegistry._engines
            for m in ("memopd_language_model", "memopd_value_model", "memopd_teacher")
        },
        "platform:cpu": PlatformRegistry.get("cpu") is PlatformCPU,
        "engine:language_model/fsdp2/cpu": "cpu" in EngineRegistry._engines["language_model"]["fsdp2"],
        "engine:value_model/fsdp2/cpu": "cpu" in EngineRegistry._engines["value_model"]["fsdp2"],
    }
