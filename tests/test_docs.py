"""The documentation a user reads is self-contained: the README keeps CI's test command, its links and the
docs' links resolve inside the repository, and no tracked file points at notes outside it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "results").glob("*/README.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _tracked_text_files() -> list[Path]:
    done = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    paths = [REPO / p for p in done.stdout.decode().split("\0") if p]
    return [
        p
        for p in paths
        if p.is_file() and p.suffix in {".md", ".py", ".sh", ".yaml", ".yml", ".txt", ".toml", ".cfg", ".json", ""}
    ]


def test_readme_keeps_the_test_command_ci_reads():
    lines = README.read_text().splitlines()
    at = lines.index("<!-- test-command -->")
    assert lines[at + 1] == "```bash" and "python -m pytest tests" in lines[at + 2]
    assert "bash recipes/quickstart_cpu.sh" in README.read_text(), "the main job's command"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve_inside_the_repository(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor
        path = (doc.parent / target.split("#")[0]).resolve()
        if REPO not in path.parents and path != REPO or not path.exists():
            broken.append(target)
    assert not broken, f"{doc.name}: links that leave the repository or lead nowhere: {broken}"


def test_no_tracked_file_points_outside_the_repository():
    outside = re.compile(r"\.\./shared|/work/(shared|wt)/")
    hits = [
        f"{p.relative_to(REPO)}:{n}"
        for p in _tracked_text_files()
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if outside.search(line)
    ]
    assert not hits, hits


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_anchors_of_links_between_the_docs_exist(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target) or "#" not in target:
            continue
        path, anchor = target.split("#", 1)
        page = (doc.parent / path).resolve() if path else doc
        if page.suffix != ".md" or not page.exists():
            continue  # the link test reports missing files
        headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
        if anchor not in {_slug(h) for h in headings}:
            broken.append(target)
    assert not broken, f"{doc.name}: links to headings that do not exist: {broken}"


def test_one_ram_figure_for_the_cpu_quickstart():
    """The README's quickstart and the script's header state the same RAM, and the README the GPU venv's size."""
    readme = README.read_text()
    heading = re.search(r"^## Quickstart \(CPU, 2 cores, (\d+) GB RAM", readme, re.M)
    script = re.search(r"2 CPU cores and (\d+) GB RAM", (REPO / "recipes" / "quickstart_cpu.sh").read_text())
    assert heading and script and heading.group(1) == script.group(1)
    assert set(re.findall(r"(\d+) GB RAM", readme)) == {heading.group(1)}
    assert "the venv is ~11 GB" in readme and "download.pytorch.org/whl/cpu" in readme
