"""The documentation site (mkdocs.yml, docs/) builds with ``--strict``, as ``make docs`` and CI build it: a broken
link, a missing anchor or a page named in the nav that does not exist fails the suite. The README stays a quick
start that fits on a screen, and shows the two commands."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _build(tmp_path: Path, config: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(tmp_path / "site")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_docs_site_builds_strictly(tmp_path):
    proc = _build(tmp_path, ROOT / "mkdocs.yml")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-4000:]
    assert (tmp_path / "site" / "operators" / "configuration" / "index.html").exists()
    architecture = (tmp_path / "site" / "contributors" / "architecture" / "index.html").read_text()
    assert "one chat request, from the socket to the engine and back" in architecture   # ARCHITECTURE.md included


def test_a_broken_link_fails_the_build(tmp_path):
    """The check can fail: the same site with one page linking to a page that does not exist."""
    docs = tmp_path / "docs"
    subprocess.run(["cp", "-r", str(ROOT / "docs"), str(docs)], check=True)
    (docs / "getting-started.md").write_text((docs / "getting-started.md").read_text() + "\n[gone](gone.md)\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text((ROOT / "mkdocs.yml").read_text().replace("docs_dir: docs", f"docs_dir: {docs}"))
    proc = _build(tmp_path, config)
    assert proc.returncode != 0 and "gone.md" in proc.stderr


def test_the_readme_is_a_quick_start():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 220
    assert "make serve" in text and "make test" in text


def test_the_readmes_links_point_at_files_that_exist():
    """The README is read on the forge, outside the site's strict build: its relative links are checked here."""
    text = (ROOT / "README.md").read_text()
    links = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t and not t.startswith("#")]
    assert len(links) > 20
    assert [t for t in links if not (ROOT / t).exists()] == []
