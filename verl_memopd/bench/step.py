"""Step benchmark: the recipe's training step in fp32, then in bf16, on the same data and seeds, in one invocation.

    python -m verl_memopd.bench step [--model tiny|smollm2] [--steps K] [--out DIR]

runs ``python -m verl.trainer.main_ppo +profile=cpu +recipe=memopd`` (fp32) and then the same command with
``+profile=cpu_bf16`` for ``K`` steps each (same ``data.seed``, ``rollout.seed`` and per-call vLLM seeds), reads
verl's own stage timings from its console step lines (``timing_s/gen``, ``timing_s/update_actor``, ...;
``verl_memopd.experiment.launching.parse_steps``), and averages the steady-state steps: step 1 (warm-up:
first allocations, vLLM's first batches) is never counted, nor is the audit step (``memopd.audit.every_n_steps=K``:
the RCE audit runs on step K, where ``memopd/audit/rce_pass`` and ``rce_noise_floor`` come from); with
``K = 2`` the audit step is the only steady one and is counted (said in the table).

``actor_vs_plain`` is the actor update's tokens per second (``perf/total_num_tokens`` x ppo epochs over
``timing_s/update_actor``) over plain PyTorch on the same shapes in the same dtype, measured in this process
after the verl runs: the student loaded by transformers (``sdpa``), the step's rows (verl's
``prompt_length/mean + response_length/mean`` tokens each, random ids: the token count the actor processes,
without its padding), the recipe's micro- and mini-batches, forward + full-vocabulary log-softmax loss +
backward + ``torch.optim.AdamW`` (bf16: ``torch.autocast`` over fp32 master weights, as the profile's FSDP
engines), with as many threads as verl's workers had (Ray gives an actor without ``num_cpus`` one
OpenMP thread unless ``OMP_NUM_THREADS`` is set: ``--threads``, default that of this process's environment or 1).

The table (one line per stage: fp32 s, bf16 s, fp32/bf16) precedes the last line::

    step model=<name> fp32_s=<s> bf16_s=<s> speedup=<x> gen_speedup=<x> update_actor_speedup=<x> \
        update_critic_speedup=<x> actor_vs_plain=<r> rce_pass_bf16=<0|1> probs_diff_max_bf16=<v>

(one line; wrapped here). ``speedup`` = fp32 step time / bf16 step time (> 1: bf16 faster); ``actor_vs_plain``
is the bf16 run's; ``probs_diff_max_bf16`` is the largest ``training/rollout_probs_diff_max`` (vLLM's rollout
log-probs vs the trainer's) over the bf16 run's steps. Nothing is cached between the two runs but the models
and the data (built once under ``--out``, default ``runs/bench_step``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

__all__ = [
    "MODELS",
    "STAGES",
    "StepRun",
    "command",
    "main",
    "plain_tokens_per_s",
    "prepare",
    "ratio",
    "run_variant",
    "steady_steps",
    "summary_line",
    "table",
]

#: the stages of a step that the table lists (verl's ``timing_s/<stage>``; ``step`` is the whole step)
STAGES = ("gen", "teacher", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor", "step")
#: ``--model`` -> Hydra overrides of its run on top of the shared ones (the quickstart's and the SmolLM2 arms')
MODELS: dict[str, tuple[str, ...]] = {
    # recipes/quickstart_cpu.sh: 2 episodes x 2 samples, mini-batch of 2 prompts
    "tiny": (
        "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.optim.lr=1e-5",
    ),
    # the SmolLM2 experiment's arms (experiment.config.smollm2_config): 8 episodes, no reference, bypass mode,
    # 2 episodes per micro-batch
    "smollm2": (
        "data.train_batch_size=8",
        "actor_rollout_ref.rollout.n=1",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.optim.lr=2e-5",
        "critic.optim.lr=2e-5",
        "memopd.kl_penalty_coef=0",
        "algorithm.rollout_correction.bypass_mode=true",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "critic.ppo_micro_batch_size_per_gpu=2",
    ),
}
PROFILES = {"fp32": "+profile=cpu", "bf16": "+profile=cpu_bf16"}


@dataclass
class StepRun:
    """One dtype's verl run: its per-step metrics and which steps are steady (timed)."""

    dtype: str
    returncode: int
    wall_s: float
    steps: dict[int, dict[str, float]] = field(default_factory=dict)
    timed: list[int] = field(default_factory=list)
    log_path: Optional[Path] = None

    def stage_s(self, stage: str) -> float:
        """Mean seconds of ``timing_s/<stage>`` over the timed steps (NaN if verl did not time it)."""
        values = [self.steps[s][f"timing_s/{stage}"] for s in self.timed if f"timing_s/{stage}" in self.steps[s]]
        return statistics.fmean(values) if values else float("nan")

    def mean(self, key: str) -> float:
        values = [self.steps[s][key] for s in self.timed if key in self.steps[s]]
        return statistics.fmean(values) if values else float("nan")

    def max_over_steps(self, key: str) -> float:
        values = [m[key] for m in self.steps.values() if key in m]
        return max(values) if values else float("nan")

    def audit(self, key: str) -> float:
        """``key`` on the last step that has it (the audit step's RCE figures)."""
        for s in sorted(self.steps, reverse=True):
            if key in self.steps[s]:
                return self.steps[s][key]
        return float("nan")


def steady_steps(steps: int, audit_every: int) -> list[int]:
    """Steps 2..K without the audit steps; the audit step K alone if nothing else is left (K = 2)."""
    if steps < 2:
        raise ValueError(f"--steps {steps}: need >= 2 (step 1 is warm-up and never timed)")
    clean = [s for s in range(2, steps + 1) if audit_every <= 0 or s % audit_every]
    return clean or [steps]


def command(model: str, dtype: str, steps: int, student: Path, teacher: Path, data: Path, run_dir: Path) -> list[str]:
    """The ``main_ppo`` command of one dtype's run (the experiment's shared settings, the model's batch)."""
    from verl_memopd.experiment.launch import SHARED

    shared = [PROFILES[dtype] if o == "+profile=cpu" else o for o in SHARED]
    if PROFILES[dtype] not in shared:
        raise RuntimeError(f"experiment.launch.SHARED no longer starts with +profile=cpu: {SHARED}")
    return [
        sys.executable,
        "-m",
        "verl.trainer.main_ppo",
        *shared,
        "ray_kwargs.ray_init.num_gpus=2",
        f"actor_rollout_ref.model.path={student}",
        f"memopd.teacher.path={teacher}",
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'val.parquet'}",
        "data.seed=0",
        "actor_rollout_ref.rollout.seed=0",
        "actor_rollout_ref.rollout.enable_prefix_caching=false",
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"memopd.audit.every_n_steps={steps}",
        "trainer.experiment_name=bench_step",
        f"trainer.default_local_dir={run_dir / 'checkpoints'}",
        *MODELS[model],
    ]


def prepare(model: str, out: Path) -> tuple[Path, Path, Path]:
    """(student, teacher, data dir) under ``out``, built once (deterministic; reused when present)."""
    models, data = out / "models", out / "data"
    if model == "tiny":
        if not (models / "tiny.json").is_file():
            from verl_memopd.bench.tiny import build

            build(models, seed=0)
        student, teacher = models / "student", models / "teacher"
    else:
        from verl_memopd.experiment.models import SOURCES, locate_gguf, provision

        student = teacher = provision(locate_gguf(SOURCES[model]), models / model)
    if not (data / "train.parquet").is_file():
        subprocess.run(
            [sys.executable, "-m", "verl_memopd.tasks", "build", "--out", str(data), "--seed", "0", "--preset", "tiny"],
            check=True,
        )
    return Path(student), Path(teacher), data


def run_variant(
    model: str,
    dtype: str,
    steps: int,
    paths: tuple[Path, Path, Path],
    out: Path,
    timeout_s: float,
    label: Optional[str] = None,
    threads: Optional[int] = None,
) -> StepRun:
    """One verl run of ``steps`` steps in ``out/<model>_<label>`` (``label`` defaults to ``dtype``); ``threads``:
    the Ray workers' torch threads (``OMP_NUM_THREADS``; None: this process's environment, else Ray's one)."""
    from verl_memopd.experiment.launching import cpu_env, parse_steps, run_bounded

    label = label or dtype
    run_dir = out / f"{model}_{label}"
    run_dir.mkdir(parents=True, exist_ok=True)
    env = cpu_env(run_dir, threads=threads)
    os.makedirs(env["RAY_TMPDIR"], exist_ok=True)
    cmd = command(model, dtype, steps, *paths, run_dir)
    print(f"[bench] {label}: {steps} steps, log {run_dir / 'main_ppo.log'}", flush=True)
    run = run_bounded(cmd, run_dir, env, timeout_s, run_dir / "main_ppo.log", who=f"bench {label}")
    parsed = parse_steps(run.log)
    result = StepRun(label, run.returncode, run.wall_s, parsed, steady_steps(steps, steps), run_dir / "main_ppo.log")
    missing = [s for s in range(1, steps + 1) if "timing_s/step" not in parsed.get(s, {})]
    if run.returncode != 0 or missing:
        tail = "\n".join(run.log.splitlines()[-40:])
        raise RuntimeError(f"bench: the {label} run failed (exit {run.returncode}, no steps {missing}):\n{tail}")
    return result


def plain_tokens_per_s(
    model_path: Path,
    dtype: str,
    rows: int,
    length: int,
    micro: int,
    mini: int,
    threads: int,
) -> float:
    """Plain PyTorch tokens/s of an update over ``rows`` sequences of ``length`` tokens in micro-batches of
    ``micro`` rows (forward + full-vocabulary log-softmax loss + backward) and an AdamW step every ``mini`` rows.

    Timed once per part, after a short warm-up (64 tokens): one micro-batch's forward+backward (``t_micro``) and
    one AdamW step (``t_opt``); the update's time is ``ceil(rows / micro) * t_micro + ceil(rows / mini) * t_opt``
    (on CPU each micro-batch of equal shape costs the same; timing one keeps the baseline to minutes on a 135M
    model in emulated bf16). bf16: autocast over fp32 master weights, as the profile's FSDP engines."""
    import math

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-7, weight_decay=0.01)
    vocab = model.config.vocab_size

    def micro_batch(n_rows: int, n_tokens: int) -> float:
        batch = torch.randint(0, vocab, (n_rows, n_tokens))
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            logits = model(input_ids=batch, use_cache=False).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch[:, 1:, None])
        (-logp.mean()).backward()
        return time.perf_counter() - start

    def opt_step() -> float:
        start = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    micro_batch(1, 64), opt_step()  # warm-up: allocations, AdamW's state
    t_micro = micro_batch(min(micro, rows), length)
    t_opt = opt_step()
    seconds = math.ceil(rows / micro) * t_micro + math.ceil(rows / mini) * t_opt
    return rows * length / seconds


def premise(model_path: Optional[Path], threads: int, tokens: int = 256) -> Iterator[str]:
    """Seconds, fp32 vs bf16, of the kernels a step is made of (one run each after a warm-up; bf16 may be
    emulated): ``torch.matmul`` at n = 1024 and 2048, a SmolLM2-sized MLP linear (576 -> 1536, ``tokens`` rows)
    forward+backward in bf16 weights and under autocast, and with ``model_path`` the whole model's
    forward+backward on one ``tokens``-token sequence (fp32, bf16 autocast over fp32 weights, bf16 weights)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    torch.manual_seed(0)

    def seconds(fn) -> float:
        fn()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    yield (
        f"premise: threads={threads} cpu={torch.backends.cpu.get_cpu_capability()} "
        f"avx512_bf16={int(torch.cpu._is_avx512_bf16_supported())} amx={int(torch.cpu._is_amx_tile_supported())}"
    )
    for n in (1024, 2048):
        a, b = torch.randn(n, n), torch.randn(n, n)
        f32 = seconds(lambda: a @ b)
        a16, b16 = a.bfloat16(), b.bfloat16()
        b16s = seconds(lambda: a16 @ b16)
        yield (f"matmul n={n:<5d} fp32 {f32:9.4f} s  bf16 {b16s:9.4f} s  fp32/bf16 {f32 / b16s:7.3f}")
    x, w = torch.randn(tokens, 576), torch.randn(1536, 576) * 0.02

    def linear(dtype, autocast):
        xi = x.to(dtype).requires_grad_(True)
        wi = w.to(dtype).requires_grad_(True)

        def run():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = F.linear(xi, wi)
            y.float().sum().backward()

        return run

    f32 = seconds(linear(torch.float32, False))
    for name, fn in (("bf16 weights", linear(torch.bfloat16, False)), ("bf16 autocast", linear(torch.float32, True))):
        t = seconds(fn)
        yield (f"linear 576->1536 x {tokens} fwd+bwd fp32 {f32:8.4f} s  {name} {t:8.4f} s  fp32/bf16 {f32 / t:7.3f}")
    if model_path is not None:
        from transformers import AutoModelForCausalLM

        ids = torch.randint(0, 1000, (1, tokens))

        def model_step(dtype, autocast):
            model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype, attn_implementation="sdpa")

            def run():
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    logits = model(input_ids=ids, use_cache=False).logits
                torch.log_softmax(logits.float(), -1)[0, :-1].gather(-1, ids[0, 1:, None]).mean().backward()

            return run

        f32 = seconds(model_step(torch.float32, False))
        for name, args in (("bf16 autocast", (torch.float32, True)), ("bf16 weights", (torch.bfloat16, False))):
            t = seconds(model_step(*args))
            yield (
                f"model {Path(model_path).name} fwd+bwd {tokens} tokens fp32 {f32:8.3f} s  {name} {t:8.3f} s  "
                f"fp32/bf16 {f32 / t:7.3f}"
            )


def actor_factors(model_path: Path, rows: int, length: int, threads: Sequence[int] = (1, 2)) -> list[str]:
    """Plain-PyTorch fp32 seconds of one micro-batch (``rows`` x ``length`` tokens, forward + full-vocabulary
    log-softmax loss + backward) under the settings that separate verl's actor update from plain PyTorch on
    CPU: torch threads (Ray gives a worker without ``num_cpus`` one), activation recomputation (verl's
    ``enable_gradient_checkpointing``, default true) and the extra full-vocabulary head pass of the OPD term."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    head = model.get_output_embeddings().weight.detach().clone()
    ids = torch.randint(0, model.config.vocab_size, (rows, length))

    def one(opd: bool) -> float:
        start = time.perf_counter()
        out = model(input_ids=ids, use_cache=False, output_hidden_states=opd)
        loss = -torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).mean()
        if opd:  # a frozen teacher head over the last hidden states: the reverse KL's second (N, V) pass
            t = torch.log_softmax(out.hidden_states[-1].detach() @ head.T, -1)
            s_ = torch.log_softmax(out.logits.float(), -1)
            loss = loss + (s_.exp() * (s_ - t)).sum(-1).mean()
        loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    lines = []
    for n in threads:
        torch.set_num_threads(n)
        for recompute in (False, True):
            if recompute:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_disable()
            for opd in (False, True):
                one(opd)
                t = one(opd)
                lines.append(
                    f"factors threads={n} recompute={int(recompute)} opd_head={int(opd)} "
                    f"{rows}x{length} tokens: {t:8.3f} s  {rows * length / t:9.1f} tokens/s"
                )
    return lines


def ratio(a: float, b: float) -> float:
    return a / b if b and b == b and a == a else float("nan")


def table(runs: dict[str, StepRun]) -> str:
    """The per-stage table of two runs (``runs``' first two labels, A then B): seconds and A/B, then the token
    counts, the audit step's figures and the largest rollout-vs-trainer log-prob gap of each."""
    (a_label, a), (b_label, b) = list(runs.items())[:2]
    lines = [
        f"steady steps timed: {a_label} {a.timed}, {b_label} {b.timed} (step 1 never; the audit step "
        f"{max(a.steps)} only if nothing else is left)",
        f"{'stage':16s} {a_label + '_s':>10s} {b_label + '_s':>10s} {a_label + '/' + b_label:>10s}",
    ]
    for stage in STAGES:
        x, y = a.stage_s(stage), b.stage_s(stage)
        if x == x or y == y:
            lines.append(f"{stage:16s} {x:10.3f} {y:10.3f} {ratio(x, y):10.3f}")
    for key in ("perf/total_num_tokens", "prompt_length/mean", "response_length/mean"):
        lines.append(f"{key:28s} {a_label} {a.mean(key):.1f} {b_label} {b.mean(key):.1f}")
    for key in ("memopd/audit/rce_pass", "memopd/audit/rce_max_diff_over_tolerance", "memopd/audit/rce_noise_floor"):
        lines.append(f"{key:42s} {a_label} {a.audit(key):.4g} {b_label} {b.audit(key):.4g}")
    key = "training/rollout_probs_diff_max"
    lines.append(
        f"{key:42s} {a_label} {a.max_over_steps(key):.4g} {b_label} {b.max_over_steps(key):.4g} (max over steps)"
    )
    return "\n".join(lines)


def summary_line(model: str, runs: dict[str, StepRun], actor_vs_plain: float) -> str:
    fp32, bf16 = runs["fp32"], runs["bf16"]
    speed = {s: ratio(fp32.stage_s(s), bf16.stage_s(s)) for s in ("step", "gen", "update_actor", "update_critic")}
    rce = bf16.audit("memopd/audit/rce_pass")
    return (
        f"step model={model} fp32_s={fp32.stage_s('step'):.3f} bf16_s={bf16.stage_s('step'):.3f} "
        f"speedup={speed['step']:.3f} gen_speedup={speed['gen']:.3f} "
        f"update_actor_speedup={speed['update_actor']:.3f} update_critic_speedup={speed['update_critic']:.3f} "
        f"actor_vs_plain={actor_vs_plain:.3f} rce_pass_bf16={int(rce == 1.0)} "
        f"probs_diff_max_bf16={bf16.max_over_steps('training/rollout_probs_diff_max'):.4g}"
    )


def _batch_shape(model: str) -> dict[str, int]:
    """rows, micro and mini (rows) of the model's step, from its overrides and the experiment's shared ones."""
    from verl_memopd.experiment.launch import SHARED

    values = {}
    for item in (*SHARED, *MODELS[model]):
        key, _, value = item.partition("=")
        values[key] = value
    n = int(values["actor_rollout_ref.rollout.n"])
    return {
        "rows": int(values["data.train_batch_size"]) * n,
        "mini": int(values["actor_rollout_ref.actor.ppo_mini_batch_size"]) * n,
        "micro": int(values["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"]),
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m verl_memopd.bench step")
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--steps", type=int, default=4, help="steps per run (>= 2; step 1 untimed)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_step"), help="models, data and the runs' logs")
    parser.add_argument("--timeout-s", type=float, default=7200, help="bound of each verl run")
    parser.add_argument(
        "--threads",
        type=int,
        default=int(os.environ.get("OMP_NUM_THREADS", "1")),
        help="threads of the plain-PyTorch baseline (verl's Ray workers: OMP_NUM_THREADS, else 1)",
    )
    parser.add_argument(
        "--premise",
        action="store_true",
        help="only time the kernels (matmul, a SmolLM2 linear, the model's forward+backward) in fp32 and bf16",
    )
    parser.add_argument(
        "--factors",
        type=int,
        nargs=2,
        metavar=("ROWS", "LENGTH"),
        help="only time one fp32 micro-batch in plain PyTorch under verl's actor settings (threads, recomputation)",
    )
    args = parser.parse_args(argv)
    if args.factors:
        print("\n".join(actor_factors(prepare(args.model, args.out.resolve())[0], *args.factors)))
        return 0
    if args.premise:
        model = None if args.model == "tiny" else prepare(args.model, args.out.resolve())[0]
        for line in premise(model, args.threads):
            print(line, flush=True)
        return 0
    steady_steps(args.steps, args.steps)  # fails early on --steps < 2
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    paths = prepare(args.model, out)
    runs = {d: run_variant(args.model, d, args.steps, paths, out, args.timeout_s) for d in ("fp32", "bf16")}
    shape = _batch_shape(args.model)
    bf16 = runs["bf16"]
    length = round(bf16.mean("prompt_length/mean") + bf16.mean("response_length/mean"))
    vs_plain = {}
    print(table(runs))
    for dtype, run in runs.items():
        plain = plain_tokens_per_s(paths[0], dtype, shape["rows"], length, shape["micro"], shape["mini"], args.threads)
        actor = run.mean("perf/total_num_tokens") / run.stage_s("update_actor")  # ppo_epochs = 1 (verl's default)
        vs_plain[dtype] = actor / plain
        print(
            f"{dtype}: actor update {actor:.1f} tokens/s ({run.mean('perf/total_num_tokens'):.0f} tokens a step) vs "
            f"plain PyTorch {plain:.1f} tokens/s ({shape['rows']} rows x {length} tokens, micro {shape['micro']}, "
            f"{args.threads} thread(s)): {vs_plain[dtype]:.3f}",
            flush=True,
        )
    print(summary_line(args.model, runs, vs_plain["bf16"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
