"""MemOPD as a multi-node Ray job on one machine: submitted as a user would, a node lost mid-step, resumed.

The cluster is ``verl_runs.ray_cluster.LoopbackCluster``: two ``ray start`` processes on this machine
(a head and a second node, one logical GPU each, loopback addresses, their own auth token).

The job is the README's CPU MemOPD job (``recipes/quickstart_cpu.sh``: ``+profile=cpu +recipe=memopd``
on the tiny models) submitted by ``recipes/run_memopd_multinode.sh`` itself (``MEMOPD_TRAIN_SCRIPT``
points it at the quickstart; ``NNODES=2`` -> ``trainer.nnodes=2``), with the teacher colocated so the
two logical GPUs hold everything: one fused verl worker per node runs actor, reference, critic and
teacher (one FSDP rank each, gloo collectives across nodes), one vLLM replica per node. What a real
cluster needs is the same:

- the plugin installed on every node (verl loads it through its ``verl.plugins`` entry point in
  every worker process; nothing is shipped with ``working_dir``);
- ``VERL_PLATFORM`` etc. in the job's ``runtime_env`` env_vars (``MEMOPD_JOB_ENV``) and in the nodes'
  environment;
- ``ray_kwargs.ray_init.num_cpus=null`` / ``num_gpus=null``: the job's driver joins the running
  cluster, and Ray refuses resource arguments when connecting to one;
- with Ray's token authentication, the same token for the nodes and the submitting client.

The fault a cluster user fears most, then the way back:

1. job A (a checkpoint every step): once step 1 is logged (its checkpoint is written before the
   step's line), the second node's Ray is killed by process id, early in step 2. The job must end
   FAILED within ``FAIL_WITHIN_S`` (no hang, no step 2) and its log must name the lost node (its id:
   the trainer's node watchdog, verl_memopd/trainer/watchdog.py) or a worker it held (Ray's
   ActorUnavailableError / ActorDiedError name the actor; the state API places it on that node);
   the step-1 checkpoint must be complete (both FSDP ranks' shards of actor and critic, the tracker).
2. the second node restarts; job B, the same submission plus ``trainer.resume_mode=auto``, resumes
   from that checkpoint, runs step 2 and SUCCEEDS. Its actor, critic and teacher calls ran on both
   nodes (Ray's state API: task name -> node) and the ``memopd/*`` metrics were logged.

It also covers what the former stock-GRPO two-node test checked (a verl job submitted with
``ray job submit`` to two loopback nodes, its workers on both). Lean on purpose (CI has a 35-minute
budget): one episode per rank and step, one reward worker, no dataloader workers, no validation, no
audit. ~9 min on 2 shared cores (measured 531 s: nodes and models 49 s, job A to step 1 197 s, its
failure 28 s after the kill, job B 226 s): each job's start-up (2 vLLM-CPU replicas, 2 FSDP ranks, ~15
worker processes each importing verl) is ~3.5 min; the steps take ~10-35 s.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import pytest
from verl_runs.ray_cluster import LoopbackCluster, parse_job_status, tail

from verl_memopd.experiment.launching import parse_steps

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "quickstart_cpu.sh"
MULTINODE = REPO / "recipes" / "run_memopd_multinode.sh"
#: bound of one job's start-up plus its steps (2 vLLM replicas and 2 FSDP ranks start on 2 shared cores)
JOB_TIMEOUT_S = 900
#: a job that lost a node must have ended within this long after the kill
FAIL_WITHIN_S = 180
#: the job's variables (MEMOPD_JOB_ENV of run_memopd_multinode.sh) -> the runtime_env of every worker
JOB_ENV = (
    "PYTHONUNBUFFERED",
    "VERL_PLATFORM",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "WANDB_MODE",
    "VLLM_CPU_KVCACHE_SPACE",
    "HF_HOME",
    "VLLM_CACHE_ROOT",
    "TRITON_CACHE_DIR",
)
#: the roles that must run on both nodes -> their prefix in verl's colocated worker: task "WorkerDict.<role>_<method>"
ROLES = {"actor": "actor_rollout_ref", "critic": "critic", "teacher": "memopd_teacher"}
MEMOPD_METRICS = (
    "actor/memopd/reverse_kl",
    "memopd/calls_per_episode",
    "memopd/tokens_saved_by_shared_prefix",
    "timing_s/teacher",
)
#: both jobs: two logical GPUs (one per node) hold actor, reference, critic, teacher and a vLLM replica each
TWO_NODES = (
    "memopd.teacher.placement=colocate",
    "trainer.n_gpus_per_node=1",
    "ray_kwargs.ray_init.num_cpus=null",
    "ray_kwargs.ray_init.num_gpus=null",
)
#: both jobs: as little as the checks need (each Ray worker process costs ~10 s of CPU just importing verl)
LEAN = (
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
    "memopd.audit.every_n_steps=0",
    "data.seed=0",
    # 2 episodes a step, one per rank; micro-batches of 1 row divide any per-rank share
    "actor_rollout_ref.rollout.n=1",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
    "critic.ppo_micro_batch_size_per_gpu=1",
)
JOB_A = ("trainer.total_training_steps=3", "trainer.save_freq=1")
JOB_B = ("trainer.total_training_steps=2", "trainer.save_freq=-1", "trainer.resume_mode=auto")


def job_overrides(ckpt: Path, job: tuple[str, ...]) -> list[str]:
    return [*TWO_NODES, *LEAN, f"trainer.default_local_dir={ckpt}", *job]


def role_placement(tasks: list[dict], marker: dict[str, str]) -> dict[str, set[str]]:
    """``ROLES`` key -> node markers, from Ray task records (``name`` "WorkerDict.<role>_<method>", ``node_id``)."""
    placed: dict[str, set[str]] = defaultdict(set)
    for task in tasks:
        method = task.get("name", "").rpartition(".")[2]
        for role, prefix in ROLES.items():
            if method.startswith(prefix + "_") and task.get("node_id"):
                placed[role].add(marker.get(task["node_id"], task["node_id"]))
    return placed


def failure_lines(text: str, node_id: str, actors: dict[str, str]) -> list[str]:
    """The lines of a failed job's log that name the lost node or one of the ``actors`` (id -> class) it held --
    Ray's ActorUnavailableError / ActorDiedError name the actor, the node watchdog names the node."""
    return list(
        dict.fromkeys(
            line.strip()[:400]
            for line in text.splitlines()
            if node_id in line or any(actor in line for actor in actors)
        )
    )


def test_failure_lines_name_the_lost_node_or_its_actors():
    text = (
        "step:1 - x:1\n"
        "ray.exceptions.ActorUnavailableError: The actor 306b02000000 is unavailable: Socket closed\n"
        "[verl-memopd] node watchdog: Ray node(s) ab12 (10.0.0.2) holding this run's workers died\n"
        "ray.exceptions.ActorUnavailableError: The actor 306b02000000 is unavailable: Socket closed\n"
    )
    assert failure_lines(text, "ab12", {"306b02000000": "TaskRunnerV1"}) == text.splitlines()[1:3]
    assert failure_lines(text, "cd34", {"ffff02000000": "WorkerDict"}) == []


def test_role_placement_is_read_from_verl_task_names():
    marker = {"n0": "memopd_node_0", "n1": "memopd_node_1"}
    tasks = [
        {"name": "WorkerDict.actor_rollout_ref_update_actor", "node_id": "n0"},
        {"name": "WorkerDict.actor_rollout_ref_compute_log_prob", "node_id": "n1"},
        {"name": "WorkerDict.critic_train_batch", "node_id": "n1"},
        {"name": "WorkerDict.memopd_teacher_infer_batch", "node_id": "n0"},
        {"name": "WorkerDict.__init__", "node_id": "n0"},
        {"name": "TaskRunnerV1.run", "node_id": "n1"},
    ]
    assert role_placement(tasks, marker) == {
        "actor": {"memopd_node_0", "memopd_node_1"},
        "critic": {"memopd_node_1"},
        "teacher": {"memopd_node_0"},
    }


def test_job_status_is_read_from_the_status_line_not_the_quoted_log():
    failed = (
        "Job 'a-1' failed\nStatus message: Job entrypoint command failed with exit code 1, last available "
        "logs:\n  workers are running\nJob 'other' succeeded"
    )
    assert parse_job_status("a-1", failed) == "FAILED"
    assert (
        parse_job_status("a-1", "Status for job 'a-1': RUNNING\nStatus message: Job is currently running.") == "RUNNING"
    )
    assert parse_job_status("b", "------\nJob 'b' succeeded\n------") == "SUCCEEDED"
    with pytest.raises(AssertionError, match="no status line"):
        parse_job_status("a-1", "Job 'a-12' failed")


def _submitted_overrides(qs: Path, ckpt: Path, job: tuple[str, ...]) -> list[str]:
    """The training command run_memopd_multinode.sh submits for ``job`` (its dry run), Hydra overrides only."""
    env = {
        **os.environ,
        "MEMOPD_DRY_RUN": "1",
        "RAY_DASHBOARD": "http://127.0.0.1:1",
        "NNODES": "2",
        "MEMOPD_TRAIN_SCRIPT": str(QUICKSTART),
        "MEMOPD_QUICKSTART_DIR": str(qs),
    }
    done = subprocess.run(
        ["bash", str(MULTINODE), *job_overrides(ckpt, job)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    args = done.stdout.splitlines()
    train = args[args.index("--") + 1 :]
    return train[train.index("verl.trainer.main_ppo") + 1 :]


@pytest.mark.parametrize("job", [JOB_A, JOB_B], ids=["job_a", "job_b_resume"])
def test_submitted_config_fits_two_ranks(job, tiny_models, tmp_path, monkeypatch):
    """The composed config of what the slow test submits: 2 nodes x 1 logical GPU, teacher colocated, every
    micro-batch size dividing each rank's share of a step's rows, and the checks main_ppo's Hydra callbacks
    run (CPU profile, memopd: tree) passing -- found here in seconds instead of minutes into a Ray job."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from verl_memopd.platform.checks import check_cpu_config
    from verl_memopd.trainer.config import from_config

    (tmp_path / "qs").mkdir()
    (tmp_path / "qs" / "models").symlink_to(tiny_models.student.parent)
    overrides = _submitted_overrides(tmp_path / "qs", tmp_path / "ckpt", job)
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)
    get = lambda key: OmegaConf.select(cfg, key)  # noqa: E731
    assert (get("trainer.nnodes"), get("trainer.n_gpus_per_node"), get("memopd.teacher.placement")) == (
        2,
        1,
        "colocate",
    )
    assert get("ray_kwargs.ray_init.num_cpus") is None and get("ray_kwargs.ray_init.num_gpus") is None
    ranks = get("trainer.nnodes") * get("trainer.n_gpus_per_node")
    rows = get("data.train_batch_size") * get("actor_rollout_ref.rollout.n")  # one verl row per episode
    mini = get("actor_rollout_ref.actor.ppo_mini_batch_size") * get("actor_rollout_ref.rollout.n")
    assert rows % ranks == 0 and mini % ranks == 0, (rows, mini, ranks)
    for key in (
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
        "critic.ppo_micro_batch_size_per_gpu",
    ):
        assert (mini // ranks) % get(key) == 0 and (rows // ranks) % get(key) == 0, f"{key}={get(key)}"
    assert (get("reward.num_workers"), get("data.dataloader_num_workers")) == (1, 0)
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    check_cpu_config(cfg)
    assert from_config(cfg).teacher.placement == "colocate"


def _kill_in_step_2(cluster: LoopbackCluster, job_id: str, follower: subprocess.Popen, ckpt: Path) -> float:
    """Kill the second node as soon as job A has written its step-1 checkpoint and logged step 1 (step 2 then
    starts at once; a step takes ~10 s); the time of the kill. The driver's own log file is read: the CLI's
    log stream lags by seconds."""
    tracker, driver_log = ckpt / "latest_checkpointed_iteration.txt", cluster.driver_log(job_id)

    def step_1_done() -> bool:
        return (
            tracker.is_file()
            and tracker.read_text().strip() == "1"
            and driver_log.is_file()
            and 1 in parse_steps(driver_log.read_text(errors="replace"))
        )

    if not cluster.wait_until(step_1_done, JOB_TIMEOUT_S, follower):
        status, answer = cluster.job_status(job_id)
        raise AssertionError(f"job A did not reach step 1 ({status}):\n{tail(cluster.logs(job_id))}\n{answer[-2000:]}")
    cluster.nodes[1].kill()
    return time.monotonic()


@pytest.mark.slow
def test_memopd_job_across_two_ray_nodes_survives_losing_one(tmp_path):
    ckpt = tmp_path / "ckpt"
    cluster = LoopbackCluster(tmp_path)
    env = {
        **cluster.env,
        "RAY_DASHBOARD": cluster.dashboard,
        "NNODES": "2",
        "MEMOPD_TRAIN_SCRIPT": str(QUICKSTART),
        "MEMOPD_QUICKSTART_DIR": str(tmp_path / "qs"),
        "MEMOPD_TIMEOUT_S": str(JOB_TIMEOUT_S),
        "MEMOPD_JOB_ENV": " ".join(JOB_ENV),
    }
    times: dict[str, float] = {}
    start = time.monotonic()
    try:
        cluster.start_head(wait=False)
        # meanwhile the models and data the script would build first (MEMOPD_PREPARE_ONLY)
        subprocess.run(
            ["bash", str(QUICKSTART)],
            env={**env, "MEMOPD_PREPARE_ONLY": "1"},
            check=True,
            timeout=600,
            capture_output=True,
        )
        cluster.wait_nodes(1)
        cluster.start_second()
        second_id = next(n["node_id"] for n in cluster.wait_nodes(2) if "memopd_node_1" in n["resources_total"])
        times["cluster"] = time.monotonic() - start

        # job A: the second node is killed early in step 2, after the step-1 checkpoint
        job_a = f"memopd-multinode-a-{os.getpid()}"
        follower = cluster.follow(
            job_a,
            ["bash", str(MULTINODE), *job_overrides(ckpt, JOB_A)],
            {**env, "MEMOPD_JOB_ID": job_a},
            tmp_path / f"{job_a}.follow.log",
        )
        killed_at = _kill_in_step_2(cluster, job_a, follower, ckpt)
        times["job A to step 1"] = killed_at - start - times["cluster"]
        cluster.start_second()  # the machine comes back (a new node) while job A fails
        status, answer = cluster.wait_job(job_a, FAIL_WITHIN_S, follower, ask_every_s=30)
        times["job A end after the kill"] = time.monotonic() - killed_at
        logs_a = cluster.logs(job_a)
        assert status == "FAILED", (
            f"job A {status} {times['job A end after the kill']:.0f}s after the second node "
            f"was killed (FAILED expected within {FAIL_WITHIN_S}s):\n{tail(logs_a)}\n"
            f"{answer[-3000:]}"
        )
        assert sorted(parse_steps(logs_a)) == [1], f"step 2 should have died with the node:\n{tail(logs_a)}"
        lost = {a["actor_id"]: a["class_name"] for a in cluster.actors() if a.get("node_id") == second_id}
        names = failure_lines(logs_a + answer, second_id, lost)
        assert names, (
            f"the failure names neither the lost node {second_id} nor one of its workers "
            f"{sorted(lost.values())}:\n{tail(logs_a)}"
        )
        print(
            f"multinode: job A {status} {times['job A end after the kill']:.0f}s after losing node {second_id} "
            f"(actors there: {lost}); the failure says:\n  " + "\n  ".join(names[:6])
        )

        # the step-1 checkpoint is complete: both ranks' shards of actor and critic, and the tracker
        assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
        for role in ("actor", "critic"):
            shards = sorted(p.name for p in (ckpt / "global_step_1" / role).glob("*world_size_2_rank_*.pt"))
            kinds = {(s.split("_world_size")[0], re.search(r"rank_(\d+)", s).group(1)) for s in shards}
            assert kinds == {(k, r) for k in ("model", "optim", "extra_state") for r in "01"}, (
                f"global_step_1/{role}: {shards}"
            )
        assert not (ckpt / "global_step_2").exists()

        # job B: the node is back; the same submission with resume_mode=auto continues at step 2
        try:
            back = cluster.wait_nodes(2, exclude=frozenset({second_id}))
        except TimeoutError as e:  # Ray's node start, not the job under test: the operator starts the machine again
            print(f"multinode: the second node did not come back; starting it once more: {e}")
            cluster.nodes[-1].kill()
            cluster.start_second()
            back = cluster.wait_nodes(2, exclude=frozenset({second_id}))
        marker = cluster.markers(back)
        job_b = f"memopd-multinode-b-{os.getpid()}"
        b_start = time.monotonic()
        follower = cluster.follow(
            job_b,
            ["bash", str(MULTINODE), *job_overrides(ckpt, JOB_B)],
            {**env, "MEMOPD_JOB_ID": job_b},
            tmp_path / f"{job_b}.follow.log",
        )
        status, answer = cluster.wait_job(job_b, JOB_TIMEOUT_S, follower)
        times["job B"] = time.monotonic() - b_start
        logs_b = cluster.logs(job_b)
        assert status == "SUCCEEDED", f"resumed job ended {status}:\n{tail(logs_b)}\n{answer[-2000:]}"
        assert f"Resuming from {ckpt / 'global_step_1'}" in logs_b, tail(logs_b)
        steps = parse_steps(logs_b)
        assert sorted(steps) == [2], f"the resumed job should run step 2 only, ran {sorted(steps)}:\n{tail(logs_b)}"
        missing = [k for k in MEMOPD_METRICS if k not in steps[2]]
        assert not missing and steps[2]["actor/memopd/reverse_kl"] > 0, f"step 2 lacks {missing}"

        placed = role_placement(cluster.tasks(job_b), marker)
        summary = {role: sorted(placed.get(role, ())) for role in ROLES}
        print(f"multinode: job B resumed at step 2 and succeeded; role -> nodes: {json.dumps(summary)}")
        for role, where in summary.items():
            assert set(where) == set(marker.values()), f"{role} calls did not run on both nodes: {dict(placed)}"
    finally:
        cluster.close()
        times["total"] = time.monotonic() - start
        print("multinode: wall " + ", ".join(f"{k} {v:.0f}s" for k, v in times.items()))
