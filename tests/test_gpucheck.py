"""``python -m verl_memopd.bench.gpucheck`` on a machine without CUDA, and its machinery on CPU.

The GPU checks themselves (flash-attn, CUDA memory, the GPU training run) run only on a GPU; here:
the no-CUDA and old-driver exits and messages, the driver verdict, the plain-PyTorch attention that
sets the bf16 budget, the attention and packing checks end to end with the ``torch`` backend on a
small shape, the training run's command (composed under verl's config: the GPU recipe's path), its
log parsing and verdict, its timeout (process group killed), and the per-check lines and summary.
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verl_memopd.attention import get_backend
from verl_memopd.bench import gpucheck
from verl_memopd.bench.gpucheck import (
    NO_CUDA_STATUS,
    OLD_DRIVER_STATUS,
    TRAIN_METRICS,
    CudaVersions,
    ModelShape,
    _no_cuda_reason,
    _packed_meta,
    attention_check,
    driver_check,
    packing_check,
    plain_bf16_attention,
    run_checks,
    summary_line,
    train_check,
    train_command,
    train_result,
)

SMALL = ModelShape(heads=4, kv_heads=2, head_dim=32, hidden=128, intermediate=256, vocab=512)
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine-without-CUDA path")


@needs_no_cuda
def test_exits_with_distinct_status_and_says_why_without_cuda():
    """On this machine, as installed: the CPU stack names the CPU build of torch; the GPU stack
    (``bash docker/install.sh gpu`` on a machine without a GPU) names the missing driver instead."""
    done = subprocess.run(
        [sys.executable, "-m", "verl_memopd.bench.gpucheck"], capture_output=True, text=True, timeout=120
    )
    assert "gpucheck attention" not in done.stdout
    if torch.version.cuda is None:
        assert done.returncode == NO_CUDA_STATUS == 3, done.stdout + done.stderr
        assert "no CUDA device visible" in done.stderr and "CPU build of torch" in done.stderr
    else:  # a CUDA build of torch: no driver (3), a too old one (4), or a driver without a visible device (3)
        assert done.returncode in (NO_CUDA_STATUS, OLD_DRIVER_STATUS), done.stdout + done.stderr
        assert "CPU build of torch" not in done.stderr and "NVIDIA driver" in done.stderr + done.stdout


def _no_driver_here(monkeypatch, tmp_path):
    """A CUDA build of torch on a machine with no NVIDIA driver: every driver source fails as it does there
    (no libcuda.so.1, no nvidia-smi, no /proc/driver/nvidia/version, torch 2.11's missing private API)."""
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def no_libcuda(name):
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")

    def no_smi(*a, **k):
        raise FileNotFoundError(2, "No such file or directory", "nvidia-smi")

    monkeypatch.setattr(gpucheck.ctypes, "CDLL", no_libcuda)
    monkeypatch.setattr(gpucheck.subprocess, "run", no_smi)
    monkeypatch.delattr(torch._C, "_cuda_getDriverVersion", raising=False)
    monkeypatch.setattr(
        gpucheck, "Path", lambda p: Path(tmp_path / "absent") if str(p).startswith("/proc/") else Path(p)
    )


def test_cuda_torch_without_a_driver_says_no_driver_not_cpu_build(monkeypatch, capsys, tmp_path):
    _no_driver_here(monkeypatch, tmp_path)
    versions = gpucheck.cuda_versions()
    assert (versions.torch_cuda, versions.driver_cuda, versions.driver) == ("13.0", None, None)
    assert gpucheck.main([]) == NO_CUDA_STATUS
    out, err = capsys.readouterr()
    assert out == "" and "CPU build of torch" not in err
    assert "CUDA build 13.0): no NVIDIA driver found (libcuda: libcuda.so.1 not loadable" in err
    assert "nvidia-smi: nvidia-smi did not run (FileNotFoundError)" in err and "torch: torch has no private" in err
    assert "the GPU stack is installed" in err and "driver for CUDA 13" in err and "580.65.06" in err


def test_the_two_causes_of_status_3_have_distinct_messages(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = _no_cuda_reason(CudaVersions("2.13.0+cpu", None, None, None, "CPU build of torch"))
    no_driver = _no_cuda_reason(CudaVersions("2.11.0+cu130", "13.0", None, None, "libcuda: not loadable"))
    assert cpu[0] == no_driver[0] == NO_CUDA_STATUS
    assert "CPU build of torch" in cpu[1] and "install the GPU stack" in cpu[1] and "driver" not in cpu[1]
    assert "no NVIDIA driver found (libcuda: not loadable)" in no_driver[1] and "CPU build" not in no_driver[1]


@pytest.mark.parametrize(
    "driver_cuda, torch_cuda, verdict",
    [
        ("12.8", "13.0", OLD_DRIVER_STATUS),
        ("13.0", "13.0", NO_CUDA_STATUS),
        ("13.1", "13.0", NO_CUDA_STATUS),
        (None, "13.0", NO_CUDA_STATUS),
        ("13.0", None, NO_CUDA_STATUS),
    ],
)
def test_driver_verdict_where_torch_sees_no_device(driver_cuda, torch_cuda, verdict, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    v = CudaVersions("2.11.0", torch_cuda, driver_cuda, "570.124.06", "libcuda")
    stop = _no_cuda_reason(v)
    assert stop is not None and stop[0] == verdict, stop
    covered = driver_cuda is not None and torch_cuda is not None and driver_cuda >= torch_cuda
    assert driver_check(v)["passed"] == covered
    if verdict == OLD_DRIVER_STATUS:
        assert "570.124.06" in stop[1] and "CUDA 12.8" in stop[1] and "580.65.06" in stop[1]


@pytest.mark.parametrize("driver_cuda", ["13.0", "12.8", None])
def test_never_refuses_while_torch_sees_a_device(driver_cuda, monkeypatch):
    """torch 2.11 lost the private driver API: an unread (or old-looking) driver version must not stop the
    checks when torch itself runs CUDA; the driver line says what was read and passes."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    v = CudaVersions("2.11.0", "13.0", driver_cuda, "580.159.04", "libcuda" if driver_cuda else "libcuda: not loadable")
    assert _no_cuda_reason(v) is None
    line = gpucheck._line("driver", driver_check(v), gpucheck.KEYS["driver"])
    assert line.endswith(" PASS") and f"driver_cuda={driver_cuda or 'unknown'}" in line
    if driver_cuda is None:
        assert "source=unread(libcuda: not loadable)" in line


def test_a_cpu_build_of_torch_is_no_cuda_even_if_a_device_were_seen(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    stop = _no_cuda_reason(CudaVersions("2.11.0", None, None, None, "CPU build of torch"))
    assert stop[0] == NO_CUDA_STATUS and "CPU build of torch" in stop[1]


def test_old_driver_stops_before_any_check_with_status_4(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(
        gpucheck, "cuda_versions", lambda: CudaVersions("2.11.0", "13.0", "12.4", "550.54.15", "nvidia-smi")
    )
    assert gpucheck.main([]) == OLD_DRIVER_STATUS == 4
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "gpucheck driver nvidia=550.54.15 driver_cuda=12.4 source=nvidia-smi torch=2.11.0 torch_cuda=13.0 FAIL"
    ]
    assert "supports CUDA 12.4" in err and "driver for CUDA 13" in err and "Exit status 4" in err


# --- reading the driver's CUDA version: each source, and each failing (mocked) -------------------------
class _FakeLibcuda:
    def __init__(self, code: int, status: int = 0):
        self.code, self.status = code, status

    def cuDriverGetVersion(self, ref):  # noqa: N802 (the C name)
        ref._obj.value = self.code
        return self.status


def _smi(stdout: str, rc: int = 0):
    return lambda *a, **k: subprocess.CompletedProcess(a[0], rc, stdout=stdout, stderr="")


def test_libcuda_reads_the_version(monkeypatch):
    monkeypatch.setattr(gpucheck.ctypes, "CDLL", lambda name: _FakeLibcuda(13000))
    assert gpucheck.driver_cuda_from_libcuda() == "13.0"
    monkeypatch.setattr(gpucheck.ctypes, "CDLL", lambda name: _FakeLibcuda(12080))
    assert gpucheck.driver_cuda_from_libcuda() == "12.8"


@pytest.mark.parametrize(
    "how, message", [("missing", "libcuda.so.1 not loadable"), ("error", "cuDriverGetVersion returned CUDA error 999")]
)
def test_libcuda_failing_is_a_lookup_error_with_why(how, message, monkeypatch):
    def cdll(name):
        if how == "missing":
            raise OSError("libcuda.so.1: cannot open shared object file")
        return _FakeLibcuda(0, status=999)

    monkeypatch.setattr(gpucheck.ctypes, "CDLL", cdll)
    with pytest.raises(LookupError, match=message):
        gpucheck.driver_cuda_from_libcuda()


def test_nvidia_smi_header_is_read_and_its_failures_named(monkeypatch):
    header = "| NVIDIA-SMI 580.159.04   Driver Version: 580.159.04   CUDA Version: 13.0     |\n"
    monkeypatch.setattr(gpucheck.subprocess, "run", _smi(header))
    assert gpucheck.driver_cuda_from_nvidia_smi() == "13.0"
    monkeypatch.setattr(gpucheck.subprocess, "run", _smi("NVIDIA-SMI has failed", rc=9))
    with pytest.raises(LookupError, match="nvidia-smi exit 9"):
        gpucheck.driver_cuda_from_nvidia_smi()

    def absent(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(gpucheck.subprocess, "run", absent)
    with pytest.raises(LookupError, match="nvidia-smi did not run"):
        gpucheck.driver_cuda_from_nvidia_smi()


def test_torch_without_its_private_driver_api(monkeypatch):
    """torch 2.11 has no torch._C._cuda_getDriverVersion (what made gpucheck exit 3 on an H200)."""
    monkeypatch.delattr(torch._C, "_cuda_getDriverVersion", raising=False)
    with pytest.raises(LookupError, match="torch has no private driver API"):
        gpucheck.driver_cuda_from_torch()
    monkeypatch.setattr(torch._C, "_cuda_getDriverVersion", lambda: 12040, raising=False)
    assert gpucheck.driver_cuda_from_torch() == "12.4"

    def broken():
        raise RuntimeError("CUDA driver error: unknown\nmore")

    monkeypatch.setattr(torch._C, "_cuda_getDriverVersion", broken, raising=False)
    with pytest.raises(LookupError, match="_cuda_getDriverVersion failed .CUDA driver error: unknown."):
        gpucheck.driver_cuda_from_torch()


def test_first_source_that_answers_wins_and_all_failing_says_why(monkeypatch):
    def fails(why):
        def read():
            raise LookupError(why)

        return read

    monkeypatch.setattr(
        gpucheck,
        "DRIVER_CUDA_SOURCES",
        (("libcuda", fails("not loadable")), ("nvidia-smi", lambda: "13.0"), ("torch", fails("x"))),
    )
    assert gpucheck.read_driver_cuda() == ("13.0", "nvidia-smi")
    monkeypatch.setattr(
        gpucheck,
        "DRIVER_CUDA_SOURCES",
        (
            ("libcuda", lambda: None),
            ("nvidia-smi", fails("exit 9")),
            ("torch", fails("torch has no private driver API")),
        ),
    )
    version, why = gpucheck.read_driver_cuda()
    assert version is None
    assert why == "libcuda: reports no driver (version 0); nvidia-smi: exit 9; torch: torch has no private driver API"


def test_unread_driver_and_no_device_is_status_3_naming_every_source(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(gpucheck, "read_driver_cuda", lambda: (None, "libcuda: not loadable; nvidia-smi: did not run"))
    assert gpucheck.main([]) == NO_CUDA_STATUS
    err = capsys.readouterr().err
    assert "no NVIDIA driver found (libcuda: not loadable; nvidia-smi: did not run)" in err


def test_unknown_check_name_is_refused():
    with pytest.raises(SystemExit):
        gpucheck.main(["--checks", "attention,speed"])


def test_plain_attention_equals_torch_backend_in_fp32():
    meta = _packed_meta(2, 0, "cpu", SMALL.vocab)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(meta.num_tokens, h, 32, generator=g) for h in (4, 2, 2))
    k, v = k[meta.key_index], v[meta.key_index]
    ref = get_backend("torch")(q, k, v, meta, 0.2, 0.0)
    assert torch.allclose(plain_bf16_attention(q, k, v, meta, 0.2), ref, atol=1e-5)


def test_attention_check_runs_and_torch_bf16_is_within_budget():
    result = attention_check("torch", episodes=1, device="cpu", shape=SMALL)
    assert result["passed"], result
    assert 0 < result["fwd_err"] <= result["fwd_budget"] and 0 < result["bwd_err"] <= result["bwd_budget"]


def test_packing_check_runs():
    result = packing_check("torch", episodes=2, layers=1, warmup=0, repeats=1, device="cpu", shape=SMALL)
    assert set(result["seconds"]) == {"per_call_padded", "per_call_varlen", "packed"}
    assert result["ideal"] > 1 and result["speedup_vs_per_call"] > 0


# --- the training run: its command, log verdict, timeout ---------------------------------------------
def _compose(cmd: list[str]):
    from hydra import compose, initialize_config_module

    overrides = cmd[cmd.index("verl.trainer.main_ppo") + 1 :]
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def test_train_command_is_the_gpu_recipe_path_and_composes(tiny_models, tmp_path, monkeypatch):
    from verl_memopd.trainer.config import from_config

    monkeypatch.chdir(tmp_path)
    cmd = train_command(tiny_models.student, tiny_models.teacher, Path("/d"), tmp_path)
    assert cmd[:3] == [sys.executable, "-m", "verl.trainer.main_ppo"] and "+profile=cpu" not in cmd
    cfg = _compose(cmd)
    memopd = from_config(cfg)  # the recipe's own validation
    assert memopd.teacher.placement == "colocate" and memopd.teacher.attn_implementation == "memopd_torch_varlen"
    assert cfg.actor_rollout_ref.model.override_config.attn_implementation == "memopd_torch_varlen"
    assert cfg.critic.model.override_config.attn_implementation == "memopd_torch_varlen"
    assert not any("fa2" in arg or "flash" in arg for arg in cmd)  # flash-attn is optional
    assert cfg.actor_rollout_ref.actor.strategy == cfg.actor_rollout_ref.ref.strategy == cfg.critic.strategy == "fsdp"
    assert cfg.actor_rollout_ref.model.use_remove_padding and cfg.critic.model.use_remove_padding
    assert cfg.actor_rollout_ref.rollout.name == "vllm" and cfg.trainer.device == "cuda"
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node, cfg.trainer.total_training_steps) == (1, 1, 2)
    assert cfg.actor_rollout_ref.model.path == str(tiny_models.student) and cfg.data.train_files == "/d/train.parquet"


def _step_line(step: int, **extra: float) -> str:
    metrics = {k: 0.5 for k in TRAIN_METRICS} | extra
    return f"(TaskRunner pid=1) step:{step} - " + " - ".join(f"{k}:{v}" for k, v in metrics.items())


@pytest.mark.parametrize(
    "rc, lines, problem",
    [
        (0, [1, 2], None),
        (1, [1, 2], "exit=1"),
        (0, [1], "steps=[1]"),
        (0, [1, 2, "nan"], "non_finite=actor/memopd/reverse_kl"),
        (0, [1, 2, "missing"], "missing=timing_s/teacher"),
    ],
)
def test_train_verdict(rc, lines, problem):
    log = []
    for item in lines:
        if item == "nan":
            log[-1] = _step_line(2, **{"actor/memopd/reverse_kl": float("nan")})
        elif item == "missing":
            log[-1] = log[-1].replace(" - timing_s/teacher:0.5", "")
        else:
            log.append(_step_line(item))
    result = train_result(rc, "\n".join(log), wall_s=12.0)
    assert result["passed"] == (problem is None), result
    assert problem is None and result["problems"] == "none" or problem in result["problems"]
    line = gpucheck._line("train", result, gpucheck.KEYS["train"])
    assert line.startswith("gpucheck train steps=") and line.endswith("PASS" if problem is None else "FAIL")


def test_train_run_is_killed_at_its_timeout(tmp_path, monkeypatch):
    """A hung run (verl can hang after a worker error) ends at the timeout, its process group killed."""
    pid_file = tmp_path / "child.pid"
    hang = (
        f"import subprocess, sys, time; "
        f"c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        f"open({str(pid_file)!r}, 'w').write(str(c.pid)); print({_step_line(1)!r}, flush=True); time.sleep(600)"
    )
    monkeypatch.setattr(gpucheck, "prepare_tiny", lambda workdir: (tmp_path, tmp_path, tmp_path))
    monkeypatch.setattr(gpucheck, "train_command", lambda *a, **k: [sys.executable, "-c", hang])
    result = train_check(tmp_path, timeout_s=5)
    assert not result["passed"] and "exit=-9" in result["problems"] and "steps=[1]" in result["problems"]
    assert result["wall_s"] < 30 and "killed after the 5s timeout" in (tmp_path / "train.log").read_text()
    child = int(pid_file.read_text())
    deadline = __import__("time").monotonic() + 10
    while Path(f"/proc/{child}").exists() and "Z" not in Path(f"/proc/{child}/stat").read_text().split(") ")[1][:1]:
        assert __import__("time").monotonic() < deadline, "the run's child process outlived the timeout"


def test_absent_packages_are_skips_with_their_reason_not_failures(monkeypatch, tmp_path):
    monkeypatch.setattr(gpucheck, "missing_packages", lambda *names: list(names))  # nothing optional installed
    out = io.StringIO()
    passed, failed, skipped = run_checks(
        [
            ("attention", lambda: attention_check("flash_attn", episodes=1, device="cpu", shape=SMALL)),
            ("rce", lambda: gpucheck.rce_check(tmp_path, "flash_attn")),
            ("packing", lambda: packing_check("flash_attn", device="cpu", shape=SMALL)),
            ("train", lambda: train_check(tmp_path, timeout_s=5)),
            (
                "driver",
                lambda: {
                    "nvidia": "580.1",
                    "driver_cuda": "13.0",
                    "source": "libcuda",
                    "torch": "2.11.0",
                    "torch_cuda": "13.0",
                    "passed": True,
                },
            ),
        ],
        out=out,
    )
    lines = out.getvalue().splitlines()
    assert (passed, failed, skipped) == (1, 0, 4)
    assert lines[0].startswith("gpucheck attention backend=flash_attn reason=flash-attn is not installed (optional")
    assert all(line.endswith(" SKIP") for line in lines[:4]) and "torch_varlen" in lines[0]
    assert lines[3] == (
        "gpucheck train reason=needs verl, vllm, ray (not installed; docker/Dockerfile or bash "
        "docker/install.sh gpu) SKIP"
    )
    assert (
        summary_line(passed, failed, 3.0, skipped)
        == "gpucheck summary checks=5 passed=1 failed=0 skipped=4 wall_s=3 PASS"
    )


def test_a_check_that_raises_is_one_fail_line_and_the_rest_still_run():
    out = io.StringIO()

    def broken():
        raise RuntimeError("CUDA error: no kernel image is available\nmore")

    kl = dict(
        vocab=8,
        tokens=2,
        chunk=2,
        peak_mem_ratio=3.0,
        time_ratio=1.0,
        ms=1.0,
        naive_ms=1.0,
        grad_err=0.0,
        grad_bound=0.0,
        loss_err=0.0,
        loss_bound=0.0,
        naive_peak_gib=1.0,
        chunked_peak_gib=0.3,
        passed=False,
    )
    passed, failed, skipped = run_checks(
        [
            (
                "driver",
                lambda: {
                    "nvidia": "580.1",
                    "driver_cuda": "13.0",
                    "source": "libcuda",
                    "torch": "2.11.0",
                    "torch_cuda": "13.0",
                    "passed": True,
                },
            ),
            ("attention", broken),
            ("kl", lambda: kl),
        ],
        out=out,
    )
    lines = out.getvalue().splitlines()
    assert (passed, failed, skipped) == (1, 2, 0) and len(lines) == 3
    assert lines[1] == "gpucheck attention error=RuntimeError: CUDA error: no kernel image is available FAIL"
    assert lines[2].startswith("gpucheck kl vocab=8 ") and lines[2].endswith(" FAIL")
    assert summary_line(passed, failed, 61.2) == "gpucheck summary checks=3 passed=1 failed=2 skipped=0 wall_s=61 FAIL"
    assert summary_line(8, 0, 300).endswith("failed=0 skipped=0 wall_s=300 PASS")
