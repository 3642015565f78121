"""The plugin alone, next to an existing verl stack: ``pip install --no-deps`` (docs/install.md, "Plugin only").

The existing stack is this environment's (verl 0.9.1, vLLM, torch, transformers and verl's own
dependencies) with verl-memopd taken out: a new virtual environment whose site-packages links every entry
of this one except the plugin's (its editable path entry, its dist-info). Into it, from a copy of the working
tree, ``pip install --no-deps --no-build-isolation --no-index`` (a regular, non-editable install; nothing is
fetched). A fresh interpreter there then finds our entry points (``verl.plugins`` memopd,
``vllm.general_plugins``) in the installed distribution, ``import verl`` registers every component
(``verl_memopd.plugin.registered``), and Hydra composes ``+profile=cpu +recipe=memopd`` from the installed
package data (the ``hydra_plugins`` search-path plugin and the YAML files travel with the wheel).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: this environment's site-packages (the stack the plugin goes next to)
SITE = Path(sysconfig.get_paths()["purelib"])


def _ours(name: str) -> bool:
    """An entry of site-packages that belongs to verl-memopd (editable install or regular). ``hydra_plugins``
    too: a regular install puts our search-path plugin there, and the new install must write a directory of its
    own, never into a link to this environment's."""
    low = name.lower().replace("-", "_")
    return low.startswith(("verl_memopd", "__editable__.verl_memopd", "__editable___verl_memopd")) or low in (
        "hydra_plugins",
    )


def _stack_without_the_plugin(root: Path) -> Path:
    """A venv at ``root`` that sees this environment's packages except verl-memopd; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    for entry in SITE.iterdir():
        if not _ours(entry.name) and not (site / entry.name).exists():
            (site / entry.name).symlink_to(entry)
    return python


def _copy_working_tree(dst: Path) -> None:
    """The repository's tracked files as they are in the working tree (symlinks kept: verl_memopd/hydra_configs)."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.decode()
    for rel in filter(None, files.split("\0")):
        src, out = REPO / rel, dst / rel
        if not (src.exists() or src.is_symlink()):
            continue  # deleted in the working tree
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            out.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, out)


CHECK = r"""
import importlib.metadata as md, json, sys
from pathlib import Path

site = Path(sys.argv[1]).resolve()
dist = md.distribution("verl-memopd")
eps = {(ep.group, ep.name): ep for ep in dist.entry_points}
plugin, vllm_hook = eps[("verl.plugins", "memopd")], eps[("vllm.general_plugins", "memopd_cpu_weight_sync")]
import verl_memopd

import verl  # loads every verl.plugins entry point, ours included
from verl_memopd.plugin import registered

from hydra import compose, initialize_config_module
with initialize_config_module(config_module="verl.trainer.config", version_base=None):
    cfg = compose(config_name="ppo_trainer", overrides=["+profile=cpu", "+recipe=memopd"])
print(json.dumps({
    "dist_in_stack": Path(str(dist.locate_file(""))).resolve() == site,
    "editable": json.loads(dist.read_text("direct_url.json") or "{}").get("dir_info", {}).get("editable", False),
    "module": str(Path(verl_memopd.__file__).resolve()),
    "plugin": plugin.value,
    "plugin_loaded": "verl_memopd.plugin" in sys.modules,
    "vllm_hook": callable(vllm_hook.load()),
    "registered": registered(),
    "recipe": "memopd" in cfg and cfg.memopd.layout == "packed",
    "verl": md.version("verl"),
}))
"""


def test_pip_install_no_deps_next_to_an_existing_verl_stack(tmp_path):
    python = _stack_without_the_plugin(tmp_path / "stack")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VERL_PLATFORM="cpu", PIP_NO_INDEX="1")
    run = dict(cwd=tmp_path, env=env, capture_output=True, text=True)

    before = subprocess.run(
        [str(python), "-c", "import importlib.util as u, verl; print(u.find_spec('verl_memopd') is None)"],
        timeout=300,
        **run,
    )
    assert before.returncode == 0 and before.stdout.split()[-1] == "True", before.stderr[-2000:]

    _copy_working_tree(tmp_path / "src")
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", str(tmp_path / "src")],
        timeout=600,
        **run,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True, **run
    ).stdout.strip()
    check = subprocess.run([str(python), "-W", "ignore", "-c", CHECK, site], timeout=300, **run)
    assert check.returncode == 0, check.stderr[-3000:]
    got = json.loads(check.stdout.strip().splitlines()[-1])
    assert got["dist_in_stack"] and not got["editable"], got
    assert Path(got["module"]).is_relative_to(Path(site).resolve()) and not Path(got["module"]).is_relative_to(REPO)
    assert got["plugin"] == "verl_memopd.plugin" and got["plugin_loaded"] and got["vllm_hook"], got
    assert got["registered"] and all(got["registered"].values()), got["registered"]
    assert got["recipe"] and got["verl"] == "0.9.1", got
