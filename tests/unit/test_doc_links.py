"""README.md and docs/*.md name only files of this repository: every relative Markdown link
resolves inside the repo, and every `path/like/this` whose first part is a top-level entry of the
repo (docs/, bench/, fusefs/, tests/, systemd/, ...) exists."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TOP = {p.name for p in REPO.iterdir() if not p.name.startswith(".")}


def _ids(p: Path) -> str:
    return str(p.relative_to(REPO))


@pytest.mark.parametrize("doc", DOCS, ids=_ids)
def test_markdown_links_resolve_inside_the_repo(doc):
    bad = []
    for m in re.finditer(r"\]\(([^)\s]+)\)", doc.read_text()):
        target = m.group(1).split("#", 1)[0]
        if not target or re.match(r"[a-z][a-z0-9+.-]*:", target):   # an anchor, or http:, mailto:
            continue
        path = (doc.parent / target).resolve()
        if not path.is_relative_to(REPO) or not path.exists():
            bad.append(target)
    assert not bad, f"{_ids(doc)} links files that are not in the repo: {bad}"


@pytest.mark.parametrize("doc", DOCS, ids=_ids)
def test_repo_paths_named_in_code_spans_exist(doc):
    bad = []
    for m in re.finditer(r"`([A-Za-z0-9_.\-]+(?:/[A-Za-z0-9_.\-]+)+/?)`", doc.read_text()):
        path = m.group(1)
        if path.split("/", 1)[0] not in TOP:
            continue   # a path on a host or in a mount (/etc/hintfs, .hintfs/stats), not in the repo
        if not (REPO / path).exists():
            bad.append(path)
    assert not bad, f"{_ids(doc)} names repo paths that do not exist: {bad}"


def test_no_link_leaves_the_repo():
    for doc in DOCS:
        assert "../shared/" not in doc.read_text(), _ids(doc)
