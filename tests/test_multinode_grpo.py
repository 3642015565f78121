"""Multi-node Ray on one machine: verl's stock GRPO job submitted with ``ray job submit`` to two nodes.

The cluster is ``verl_runs.ray_cluster.LoopbackCluster`` (two ``ray start`` processes on loopback, one
logical GPU each). The CPU profile's GRPO smoke job (tests/test_verl_cpu.py's overrides, 2 steps) is
submitted with ``trainer.nnodes=2 trainer.n_gpus_per_node=1``, so verl's resource pool puts one FSDP
rank (and one vLLM replica) on each node and the ranks' gloo collectives cross nodes.
Checks: the job SUCCEEDED, its log shows both steps, and verl's worker actors ran on both nodes
(Ray's state API: actor -> node). ~4-6 min on 2 shared cores, most of it the two vLLM-CPU replicas
starting; the steps themselves take ~30 s. (tests/test_multinode_ray.py submits MemOPD itself.)
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict

import pytest

from verl_runs.grpo import grpo_overrides, prompts_parquet
from verl_runs.launcher import parse_steps
from verl_runs.ray_cluster import LoopbackCluster, tail

JOB_TIMEOUT_S = 540
#: verl's training worker actors (the actor/rollout group); one per logical GPU.
WORKER_CLASS_HINT = "WorkerDict"
JOB_ENV = ("VERL_PLATFORM", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "WANDB_MODE", "VLLM_CPU_KVCACHE_SPACE", "HF_HOME",
           "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR")


@pytest.mark.slow
def test_verl_job_runs_across_two_ray_nodes(tiny_models, tmp_path):
    cluster = LoopbackCluster(tmp_path)
    job_id = f"memopd-multinode-{os.getpid()}"
    try:
        cluster.start_head()
        cluster.start_second()
        marker = cluster.markers(cluster.wait_nodes(2))

        train = prompts_parquet(tmp_path / "train.parquet", 16)
        val = prompts_parquet(tmp_path / "val.parquet", 4)
        overrides = grpo_overrides(tiny_models.student, train, val, steps=2, lr=1e-6) + [
            "trainer.nnodes=2", "trainer.n_gpus_per_node=1",
            "ray_kwargs.ray_init.num_cpus=null", "ray_kwargs.ray_init.num_gpus=null",
            f"trainer.default_local_dir={tmp_path / 'ckpt'}",
        ]
        cluster.submit(job_id, [sys.executable, "-m", "verl.trainer.main_ppo", *overrides],
                       {k: cluster.env[k] for k in JOB_ENV})
        status, answer = cluster.wait_job(job_id, JOB_TIMEOUT_S, ask_every_s=10)
        logs = cluster.logs(job_id)
        assert status == "SUCCEEDED", f"job {job_id} ended {status} (timeout {JOB_TIMEOUT_S}s):\n{tail(logs)}"
        assert sorted(parse_steps(logs)) == [1, 2], tail(logs)

        # where did verl's workers run? (the state API keeps finished jobs' dead actors)
        placed: dict[str, set[str]] = defaultdict(set)
        for actor in cluster.actors():
            placed[actor["class_name"]].add(marker.get(actor["node_id"], actor["node_id"]))
        summary = {cls: sorted(where) for cls, where in sorted(placed.items())}
        print(f"multinode: job {job_id} succeeded; actor classes -> nodes: {json.dumps(summary)}")
        workers = {cls: where for cls, where in summary.items() if WORKER_CLASS_HINT in cls}
        assert workers, f"no {WORKER_CLASS_HINT} actors found; actors: {summary}"
        assert any(set(where) == set(marker.values()) for where in workers.values()), \
            f"training workers did not run on both nodes: {summary}"
    finally:
        cluster.close()
