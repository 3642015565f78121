"""MemOPD as a multi-node Ray job on one machine: submitted as a user would, a node lost mid-step, resumed.

Two ``ray start`` processes on one machine form the cluster -- a head and a second node, each with
its own ports, temp dir, logical CPUs, one logical GPU and a marker resource. Both are started with
``--node-ip-address=127.0.0.1`` and the dashboard listens on 127.0.0.1 only (Ray itself swaps a
loopback node address for the machine's own IP, so nothing leaves the machine either way).

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
- with Ray's token authentication (recent Ray turns it on when ``~/.ray/auth_token`` exists), the
  same token for the nodes and the submitting client: here a fresh one in ``RAY_AUTH_TOKEN``.

The fault a cluster user fears most, then the way back:

1. job A (3 steps, a checkpoint every step): once step 1 is logged (its checkpoint written), the
   second node's Ray is killed by process id, mid-step 2. The job must end FAILED within
   ``FAIL_WITHIN_S`` and its log must name the lost node (its id) or the dead worker; the step-1
   checkpoint must be complete (both FSDP ranks' shards of actor and critic, the tracker file).
2. the second node restarts; job B, the same submission plus ``trainer.resume_mode=auto``,
   continues at step 2 from that checkpoint and SUCCEEDS. Its actor, critic and teacher calls ran
   on both nodes (Ray's state API: task name -> node) and the ``memopd/*`` metrics were logged.

Both nodes are always stopped, by process id (``ray stop`` would stop every Ray instance on the
machine, other users' included).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from verl_runs.launcher import cpu_env, parse_steps

REPO = Path(__file__).resolve().parents[1]
RAY = [sys.executable, "-m", "ray.scripts.scripts"]
#: bound of one job's start-up plus its steps (2 vLLM replicas and 2 FSDP ranks start on 2 shared cores)
JOB_TIMEOUT_S = 900
#: a job that lost a node must have ended within this long after the kill
FAIL_WITHIN_S = 180
#: per node: logical CPUs (TransferQueue, TaskRunner, agent workers and vLLM servers each reserve some).
NODE_CPUS = 6
#: the job's variables (MEMOPD_JOB_ENV of run_memopd_multinode.sh) -> the runtime_env of every worker
JOB_ENV = ("PYTHONUNBUFFERED", "VERL_PLATFORM", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "WANDB_MODE",
           "VLLM_CPU_KVCACHE_SPACE", "HF_HOME", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR")
#: the roles that must run on both nodes -> their prefix in verl's colocated worker: task "WorkerDict.<role>_<method>"
ROLES = {"actor": "actor_rollout_ref", "critic": "critic", "teacher": "memopd_teacher"}
MEMOPD_METRICS = ("actor/memopd/reverse_kl", "memopd/calls_per_episode", "memopd/tokens_saved_by_shared_prefix",
                  "timing_s/teacher")


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class RayNode:
    """``ray start --block`` in its own session; stopped by killing its processes by id."""

    def __init__(self, name: str, args: list[str], temp_dir: Path, env: dict, log: Path):
        self.name, self.temp_dir, self.log = name, temp_dir, log
        temp_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([*RAY, "start", "--block", f"--temp-dir={temp_dir}", *args], env=env,
                                     stdout=log.open("a"), stderr=subprocess.STDOUT, start_new_session=True)

    def _own_pids(self) -> list[int]:
        """Processes of this node: its process group, plus any whose command line names its temp dir."""
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                pgid = os.getpgid(int(d.name))
            except (OSError, ProcessLookupError):
                continue
            if pgid == self.proc.pid or str(self.temp_dir) in cmd:
                pids.append(int(d.name))
        return pids

    def stop(self, steps=((signal.SIGTERM, 15), (signal.SIGKILL, 5))) -> None:
        for sig, wait_s in steps:
            pids = self._own_pids()
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait_s
            while pids and time.monotonic() < deadline:
                pids = [p for p in pids if Path(f"/proc/{p}").exists() and _alive(p)]
                time.sleep(0.5)
        self.proc.wait(timeout=10)

    def kill(self) -> None:
        """The machine is lost: SIGKILL to every process of the node at once, no shutdown."""
        self.stop(steps=((signal.SIGKILL, 10),))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _ray(args: list[str], env: dict, timeout_s: float = 120) -> tuple[str, str]:
    """Run a ``ray`` CLI command; (stdout, stderr) -- the CLI writes its messages to stderr."""
    done = subprocess.run([*RAY, *args], env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"ray {' '.join(args[:3])} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return done.stdout, done.stderr


def _wait_nodes(dashboard: str, n: int, env: dict, timeout_s: float) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        done = subprocess.run([*RAY, "list", "nodes", "--address", dashboard, "--format", "json", "--detail"],
                              env=env, capture_output=True, text=True)
        try:  # prints "No resource in the cluster" instead of [] while the cluster is empty
            nodes = [x for x in json.loads(done.stdout) if x.get("state") == "ALIVE"] if done.returncode == 0 else []
        except json.JSONDecodeError:
            nodes = []
        if len(nodes) == n:
            return nodes
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(nodes)} of {n} Ray nodes alive after {timeout_s}s: {done.stderr[-2000:]}")
        time.sleep(2)


def _job_status(job_id: str, dashboard: str, env: dict) -> tuple[str, str]:
    """(status, the CLI's full answer): status is PENDING/RUNNING/SUCCEEDED/FAILED/STOPPED."""
    out, err = _ray(["job", "status", job_id, "--address", dashboard], env)
    # "... is currently RUNNING" while it runs, "Job '<id>' succeeded" / "failed" at the end
    found = re.findall(r"\b(pending|running|succeeded|failed|stopped)\b", out + err, flags=re.I)
    assert found, f"no job status in `ray job status` output:\n{out}{err}"
    return found[-1].upper(), out + err


class Cluster:
    """Two Ray nodes on loopback and the multinode recipe's submissions to them."""

    def __init__(self, tmp_path: Path):
        self.tmp = tmp_path
        self.short = Path(f"/tmp/rmn{os.getpid()}")  # Ray's socket paths must stay short
        env = cpu_env(tmp_path)
        for key in ("RAY_TMPDIR", "RAY_ADDRESS"):
            env.pop(key, None)
        # Ray >= 2.5x turns token authentication on when a token exists (~/.ray/auth_token): give this cluster
        # its own, explicitly, so the test neither depends on nor touches one of the user's.
        env.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
        self.env = env
        gcs_port, dash, client, *self.agent_ports = _free_ports(3 + 3 * 4)  # head, second, second restarted
        self.gcs, self.dashboard = f"127.0.0.1:{gcs_port}", f"http://127.0.0.1:{dash}"
        self.head_args = ["--head", f"--port={gcs_port}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
                          f"--ray-client-server-port={client}", "--include-dashboard=true"]
        self.nodes: list[RayNode] = []
        self.jobs: list[str] = []

    def node_args(self, i: int) -> list[str]:
        """Node ``i`` (0 head, 1 second); a restarted second node gets fresh ports and temp dir."""
        slot = len(self.nodes)
        listen, grpc, runtime_env, metrics = self.agent_ports[4 * slot:4 * slot + 4]
        return ["--node-ip-address=127.0.0.1", f"--num-cpus={NODE_CPUS}", "--num-gpus=1",
                f"--resources={json.dumps({f'memopd_node_{i}': 1})}", f"--dashboard-agent-listen-port={listen}",
                f"--dashboard-agent-grpc-port={grpc}", f"--runtime-env-agent-port={runtime_env}",
                f"--metrics-export-port={metrics}", "--disable-usage-stats"]

    def start_head(self) -> None:
        self.nodes.append(RayNode("head", [*self.head_args, *self.node_args(0)], self.short / "head", self.env,
                                  self.tmp / "ray_head.log"))
        _wait_nodes(self.dashboard, 1, self.env, 90)

    def start_second(self) -> list[dict]:
        """Start (or restart) the second node; the ALIVE nodes once both are up."""
        slot = len(self.nodes)
        self.nodes.append(RayNode(f"second{slot}", [f"--address={self.gcs}", *self.node_args(1)],
                                  self.short / f"second{slot}", self.env, self.tmp / f"ray_second{slot}.log"))
        return _wait_nodes(self.dashboard, 2, self.env, 90)

    def submit(self, job_id: str, overrides: list[str]) -> subprocess.Popen:
        """``recipes/run_memopd_multinode.sh`` with the quickstart job; it follows the job's log into a file."""
        env = {**self.env, "RAY_DASHBOARD": self.dashboard, "NNODES": "2", "MEMOPD_JOB_ID": job_id,
               "MEMOPD_TRAIN_SCRIPT": str(REPO / "recipes" / "quickstart_cpu.sh"),
               "MEMOPD_QUICKSTART_DIR": str(self.tmp / "qs"), "MEMOPD_TIMEOUT_S": str(JOB_TIMEOUT_S),
               "MEMOPD_JOB_ENV": " ".join(JOB_ENV)}
        self.jobs.append(job_id)
        follow_log = self.tmp / f"{job_id}.follow.log"
        script = subprocess.Popen(["bash", str(REPO / "recipes" / "run_memopd_multinode.sh"), *overrides], env=env,
                                  stdout=follow_log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 180  # the script first builds the models and data (MEMOPD_PREPARE_ONLY)
        while True:
            try:
                _job_status(job_id, self.dashboard, self.env)
                return script
            except RuntimeError as e:
                if "does not exist" not in str(e) or script.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{job_id} was not submitted (script exit {script.poll()}):\n"
                                       f"{_tail(follow_log.read_text())}") from e
            time.sleep(2)

    def wait_job(self, job_id: str, timeout_s: float, until=None) -> tuple[str, str]:
        """Poll until the job ends (or ``until()`` is true, or the timeout); (status, CLI answer)."""
        deadline = time.monotonic() + timeout_s
        while True:
            status, answer = _job_status(job_id, self.dashboard, self.env)
            if status in ("SUCCEEDED", "FAILED", "STOPPED") or (until and until()) or time.monotonic() > deadline:
                return status, answer
            time.sleep(5)  # each `ray job status` is a Python start: keep polls rare

    def logs(self, job_id: str) -> str:
        logs = _ray(["job", "logs", job_id, "--address", self.dashboard], self.env)[0]
        (self.tmp / f"{job_id}.log").write_text(logs)
        return logs

    def role_nodes(self, job_id: str, marker: dict[str, str]) -> dict[str, set[str]]:
        """``ROLES`` key -> marker names of the nodes its worker-group calls ran on (Ray's state API, this job)."""
        ray_job = next(j["job_id"] for j in json.loads(_ray(["list", "jobs", "--address", self.dashboard,
                                                              "--format", "json"], self.env)[0])
                       if j.get("submission_id") == job_id)
        tasks = json.loads(_ray(["list", "tasks", "--address", self.dashboard, "--detail", "--format", "json",
                                 "--limit", "10000", "--filter", f"job_id={ray_job}"], self.env)[0])
        return role_placement(tasks, marker)

    def close(self) -> None:
        for job_id in self.jobs:
            subprocess.run([*RAY, "job", "stop", job_id, "--address", self.dashboard, "--no-wait"], env=self.env,
                           capture_output=True, timeout=60)
        for node in reversed(self.nodes):
            if node.proc.poll() is None or node._own_pids():
                node.stop()
        shutil.rmtree(self.short, ignore_errors=True)  # Ray's session dirs; job logs are in tmp_path


def role_placement(tasks: list[dict], marker: dict[str, str]) -> dict[str, set[str]]:
    """``ROLES`` key -> node markers, from Ray task records (``name`` "WorkerDict.<role>_<method>", ``node_id``)."""
    placed: dict[str, set[str]] = defaultdict(set)
    for task in tasks:
        method = task.get("name", "").rpartition(".")[2]
        for role, prefix in ROLES.items():
            if method.startswith(prefix + "_") and task.get("node_id"):
                placed[role].add(marker.get(task["node_id"], task["node_id"]))
    return placed


def test_role_placement_is_read_from_verl_task_names():
    marker = {"n0": "memopd_node_0", "n1": "memopd_node_1"}
    tasks = [{"name": "WorkerDict.actor_rollout_ref_update_actor", "node_id": "n0"},
             {"name": "WorkerDict.actor_rollout_ref_compute_log_prob", "node_id": "n1"},
             {"name": "WorkerDict.critic_train_batch", "node_id": "n1"},
             {"name": "WorkerDict.memopd_teacher_infer_batch", "node_id": "n0"},
             {"name": "WorkerDict.__init__", "node_id": "n0"}, {"name": "TaskRunnerV1.run", "node_id": "n1"}]
    assert role_placement(tasks, marker) == {"actor": {"memopd_node_0", "memopd_node_1"}, "critic": {"memopd_node_1"},
                                             "teacher": {"memopd_node_0"}}


def _tail(text: str, n: int = 60) -> str:
    return "\n".join(text.splitlines()[-n:])


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("MEMOPD_LONG_TESTS") != "1",
                    reason="opt-in (MEMOPD_LONG_TESTS=1): the MemOPD two-node job with node loss and resume has not yet passed end to end on this machine (issue 13 section 3, in progress); test_multinode_grpo.py keeps the two-node submission path in CI")
def test_memopd_job_across_two_ray_nodes_survives_losing_one(tmp_path):
    ckpt = tmp_path / "ckpt"
    overrides = ["memopd.teacher.placement=colocate", "trainer.n_gpus_per_node=1",
                 "ray_kwargs.ray_init.num_cpus=null", "ray_kwargs.ray_init.num_gpus=null",
                 "trainer.test_freq=-1", "trainer.val_before_train=false", "memopd.audit.every_n_steps=0",
                 f"trainer.default_local_dir={ckpt}", "data.seed=0",
                 # 2 episodes a step, one per rank (micro-batches of 1 row: any per-rank share divides)
                 "actor_rollout_ref.rollout.n=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
                 "critic.ppo_micro_batch_size_per_gpu=1"]
    cluster = Cluster(tmp_path)
    follow: list[subprocess.Popen] = []
    try:
        cluster.start_head()
        nodes = cluster.start_second()
        second_id = next(n["node_id"] for n in nodes if "memopd_node_1" in n["resources_total"])

        # job A: killed mid-step 2, after its step-1 checkpoint
        job_a = f"memopd-multinode-a-{os.getpid()}"
        follow.append(cluster.submit(job_a, [*overrides, "trainer.total_training_steps=3", "trainer.save_freq=1"]))
        follow_log = tmp_path / f"{job_a}.follow.log"
        status, answer = cluster.wait_job(job_a, JOB_TIMEOUT_S,
                                          until=lambda: 1 in parse_steps(follow_log.read_text()))
        assert status == "RUNNING" and 1 in parse_steps(follow_log.read_text()), \
            f"job A did not reach step 1 ({status}):\n{_tail(follow_log.read_text())}\n{answer[-2000:]}"
        assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
        killed_at = time.monotonic()
        cluster.nodes[1].kill()
        status, answer = cluster.wait_job(job_a, FAIL_WITHIN_S)
        ended_s = time.monotonic() - killed_at
        logs_a = cluster.logs(job_a)
        print(f"multinode: job A after losing node 2 mid-step 2: {status} after {ended_s:.0f}s")
        assert status == "FAILED", (f"job A still {status} {FAIL_WITHIN_S}s after the second node was killed "
                                    f"(hang):\n{_tail(logs_a)}\n{answer[-3000:]}")
        assert sorted(parse_steps(logs_a)) == [1], _tail(logs_a)
        named = [w for w in (second_id, "ActorDiedError", "node has died", "WorkerDict", "died unexpectedly")
                 if w in logs_a + answer]
        assert second_id in logs_a + answer or "ActorDiedError" in logs_a + answer, \
            f"the failure names neither the lost node {second_id} nor a dead worker:\n{_tail(logs_a)}\n{answer[-3000:]}"
        print(f"multinode: job A's failure names: {named}")

        # the step-1 checkpoint is complete: both ranks' shards of actor and critic, and the tracker
        assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
        for role in ("actor", "critic"):
            shards = sorted(p.name for p in (ckpt / "global_step_1" / role).glob("*world_size_2_rank_*.pt"))
            ranks = {re.search(r"rank_(\d+)", s).group(1) for s in shards}
            assert ranks == {"0", "1"}, f"global_step_1/{role}: {shards}"

        # job B: the node is back; the same submission with resume_mode=auto continues at step 2
        nodes = cluster.start_second()
        marker = {n["node_id"]: next(k for k in n["resources_total"] if k.startswith("memopd_node_")) for n in nodes}
        job_b = f"memopd-multinode-b-{os.getpid()}"
        follow.append(cluster.submit(job_b, [*overrides, "trainer.total_training_steps=2", "trainer.save_freq=-1",
                                             "trainer.resume_mode=auto"]))
        status, answer = cluster.wait_job(job_b, JOB_TIMEOUT_S)
        logs_b = cluster.logs(job_b)
        assert status == "SUCCEEDED", f"resumed job ended {status}:\n{_tail(logs_b)}\n{answer[-2000:]}"
        steps = parse_steps(logs_b)
        assert sorted(steps) == [2], f"the resumed job should run step 2 only, ran {sorted(steps)}:\n{_tail(logs_b)}"
        missing = [k for k in MEMOPD_METRICS if k not in steps[2]]
        assert not missing and steps[2]["actor/memopd/reverse_kl"] > 0, f"step 2 lacks {missing}"

        placed = cluster.role_nodes(job_b, marker)
        summary = {role: sorted(placed.get(role, ())) for role in ROLES}
        print(f"multinode: job B resumed at step 2 and succeeded; role -> nodes: {json.dumps(summary)}")
        for role, where in summary.items():
            assert set(where) == set(marker.values()), f"{role} calls did not run on both nodes: {dict(placed)}"
    finally:
        cluster.close()
        for proc in follow:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
