"""The stages before the verl wiring import without verl: tasks, the agent's prompt and context building,
records, packing, segments, attention, supervision, the chunked losses, rce, tiny, the benches.

A fresh interpreter (verl, Ray and vLLM are already loaded in this one by other tests) installs a
meta-path finder that makes ``verl``, ``ray``, ``vllm``, ``tensordict``, ``hydra`` and ``omegaconf``
unimportable, then imports every module of the package that is not verl wiring. An import of a blocked
package from one of our modules raises ``ImportError`` naming that module (and the chain of our modules
above it); third-party probes (``importlib.util.find_spec`` in transformers) just see the package as not
installed, as they would on an image without it.

The verl wiring, which needs verl at import and is not checked here (``VERL_WIRED``): ``trainer/``,
``platform/``, ``plugin.py``, the agent loop ``agent/loop.py`` and ``losses/actor.py`` (verl's PPO loss
with MemOPD's terms). Every other module, present or future, must import without them.

Layering, read from the source (function-level imports included, which an import alone never runs): the
stages of the flow and the audit maths (``rce``, ``audit``) import nothing of the verl wiring or of the
blocked packages, so the trainer wires them in and never the other way round (``rce`` -> ``trainer.audit``
-> ``rce`` was an import circle).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "verl_memopd"

#: packages a torch + transformers image may lack; no pure stage may need them at import
BLOCKED = ("verl", "ray", "vllm", "tensordict", "hydra", "omegaconf")

#: module (or package prefix) -> why it needs verl at import
VERL_WIRED = {
    "verl_memopd.trainer": "verl's trainer, engines, worker groups and TransferQueue rows",
    "verl_memopd.platform": "verl's platform registry and the patches of verl / vLLM on CPU",
    "verl_memopd.plugin": "verl's `verl.plugins` entry point: registers everything with verl",
    "verl_memopd.agent.loop": "subclasses verl's AgentLoopBase and registers with its agent-loop registry",
    "verl_memopd.agent.replay": "the memory agent loop replaying recordings, in verl's agent-loop registry",
    "verl_memopd.losses.actor": "verl's PPO policy loss and its TensorDict metrics, plus MemOPD's terms",
}

#: the stages the issue names; each must exist (a rename must update this list, not silently drop it)
STAGES = (
    "verl_memopd",
    "verl_memopd.tasks",
    "verl_memopd.tasks.generator",
    "verl_memopd.tasks.dataset",
    "verl_memopd.tasks.convert",
    "verl_memopd.tasks.prompts",
    "verl_memopd.tasks.reward",
    "verl_memopd.agent",
    "verl_memopd.agent.context",
    "verl_memopd.records",
    "verl_memopd.packing",
    "verl_memopd.streams",
    "verl_memopd.segments",
    "verl_memopd.attention",
    "verl_memopd.supervision",
    "verl_memopd.losses",
    "verl_memopd.losses.chunked",
    "verl_memopd.losses.divergences",
    "verl_memopd.losses.bins",
    "verl_memopd.rce",
    "verl_memopd.bench.tiny",
    "verl_memopd.bench",
    "verl_memopd.bench.kl",
    "verl_memopd.bench.packing",
    "verl_memopd.bench.transport",
)

#: the audit maths, below the trainer that wires it in
AUDIT = ("verl_memopd.rce", "verl_memopd.audit")

_PROBE = r'''
import importlib, json, sys

BLOCKED = frozenset(sys.argv[1].split(","))
OURS = "verl_memopd"


def _ours(name):
    return name == OURS or name.startswith(OURS + ".")


def _our_importers():
    """Our modules on the stack, innermost first, if the import statement itself is in one of them
    (an import from third-party code, e.g. an optional import inside torch, gives [])."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(("importlib", "__main__")):
        frame = frame.f_back  # the import machinery and this probe
    if frame is None or not _ours(frame.f_globals.get("__name__", "")):
        return []
    chain = []
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if _ours(name) and name not in chain:
            chain.append(name)
        frame = frame.f_back
    return chain


class Block:
    """Meta-path finder: the blocked packages are not importable; our imports of them fail by name."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] not in BLOCKED:
            return None
        chain = _our_importers()
        if chain:
            via = f" (via {' <- '.join(chain[1:])})" if len(chain) > 1 else ""
            raise ImportError(f"{chain[0]} imports {name}{via}", name=name)
        return None  # a third-party probe: the package is simply not installed


preloaded = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
if preloaded:
    print(json.dumps({"__preloaded__": preloaded}))
    sys.exit(0)
sys.meta_path.insert(0, Block())
results = {}
for module in sys.argv[2:]:
    try:
        importlib.import_module(module)
        results[module] = None
    except ImportError as e:
        results[module] = f"{type(e).__name__}: {e}"
leaked = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
results["__leaked__"] = leaked
print(json.dumps(results))
'''


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _wired(module: str) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in VERL_WIRED)


def pure_modules() -> list[str]:
    """Every module of the package (files on disk, symlinked config folders not followed) that is not verl wiring."""
    found = []
    for root, dirs, files in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
        found += [_module_name(Path(root) / f) for f in files if f.endswith(".py")]
    return sorted(m for m in set(found) if not _wired(m))


@pytest.fixture(scope="module")
def imported() -> dict:
    """{module: None if it imported, else the ImportError naming the module that pulled a blocked package in}."""
    modules = pure_modules()
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, ",".join(BLOCKED), *modules],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert "__preloaded__" not in results, f"loaded at interpreter start-up: {results.get('__preloaded__')}"
    return results


def test_the_named_stages_are_checked():
    modules = pure_modules()
    assert not [m for m in STAGES if m not in modules], "a named stage is missing or counted as verl wiring"
    assert not [
        p
        for p in VERL_WIRED
        if not (PACKAGE.parent / (p.replace(".", "/") + ".py")).exists()
        and not (PACKAGE.parent / p.replace(".", "/")).is_dir()
    ], "VERL_WIRED names a module that is gone"


@pytest.mark.parametrize("module", pure_modules())
def test_imports_without_verl(imported, module):
    assert imported[module] is None, f"{module} needs one of {', '.join(BLOCKED)} at import: {imported[module]}"


def test_no_blocked_package_was_loaded(imported):
    assert imported["__leaked__"] == [], imported["__leaked__"]


def test_the_probe_names_the_module_that_pulls_verl_in():
    # the check itself: the agent loop imports omegaconf and verl, and the failure names it
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, ",".join(BLOCKED), "verl_memopd.agent.loop", "verl_memopd.plugin"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert results["verl_memopd.agent.loop"].startswith("ImportError: verl_memopd.agent.loop imports omegaconf")
    assert results["verl_memopd.plugin"].startswith("ImportError: verl_memopd.plugin imports verl")


def _imports(module: str) -> list[tuple[int, str]]:
    """Every absolute import in ``module``'s source, at any depth: (line, imported module)."""
    import ast

    path = PACKAGE.parent / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = PACKAGE.parent / module.replace(".", "/") / "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return found


@pytest.mark.parametrize("module", STAGES + AUDIT)
def test_stages_and_audit_import_nothing_of_the_verl_wiring(module):
    bad = [
        f"line {line}: {name}" for line, name in _imports(module) if _wired(name) or name.partition(".")[0] in BLOCKED
    ]
    assert not bad, f"{module} reaches into the verl wiring (even inside a function): {bad}"
