"""The documentation: the site builds with warnings as errors, and the README's links lead somewhere.

The site (mkdocs.yml, docs/) is built by ``mkdocs build --strict``: a broken link or anchor, a
page missing from the navigation, a docstring mkdocstrings cannot render, or an option of
``kvoffload.Options`` that docs/hooks.py cannot place fails it. The README is read on the
repository's web view, without a build: its relative links must name files of the repository.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvoffload

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built from this tree with ``mkdocs build --strict`` into a temporary directory."""
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # the theme's notice about MkDocs 2.0 is no warning of ours
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def test_the_site_builds_with_warnings_as_errors(site: Path) -> None:
    assert (site / "index.html").is_file()
    assert (site / "getting-started" / "quickstart" / "index.html").is_file()


def test_the_api_reference_documents_every_public_name(site: Path) -> None:
    html = (site / "reference" / "api" / "index.html").read_text() + (site / "reference" / "errors" / "index.html").read_text()
    missing = [name for name in kvoffload.__all__ if f'id="kvoffload.{name}"' not in html]
    assert not missing, f"public names without an entry in the API or errors reference: {missing}"


def test_the_options_reference_lists_every_option_once_with_its_default(site: Path) -> None:
    html = (site / "reference" / "options" / "index.html").read_text()
    table = html.split("<table>", 1)[1].split("</table>", 1)[0]
    rows = re.findall(r"<tr>\s*<td><code>(\w+)</code></td>\s*<td>(.*?)</td>", table, re.S)
    assert [name for name, _ in rows] == [f.name for f in dataclasses.fields(kvoffload.Options)]
    defaults = dict(rows)
    assert "<code>134217728</code> (128 MiB)" in defaults["chunk_bytes"]
    assert "<code>'through'</code>" in defaults["remote_write"]


def test_the_cli_reference_is_the_help_of_every_subcommand(site: Path) -> None:
    html = (site / "reference" / "cli" / "index.html").read_text()
    top = subprocess.run([sys.executable, "-m", "kvoffload.cli", "--help"], capture_output=True, text=True, timeout=60).stdout
    match = re.search(r"\{([a-z,]+)\}", top)
    assert match is not None, top
    for command in match[1].split(","):
        assert f"usage: kvoffload {command}" in html, command


def _links(markdown: str) -> list[str]:
    """The targets of the inline links and images of ``markdown``, outside code."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def _github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_readme_link_leads_to_a_file_of_the_repository() -> None:
    readme = README.read_text()
    anchors = {_github_anchor(h) for h in re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", readme, flags=re.S), re.M)}
    links = _links(readme)
    assert len(links) >= 20  # the README points into the docs for everything it dropped
    broken = []
    for target in links:
        if re.match(r"[a-z]+:", target):
            continue  # another site's address
        path, _, anchor = target.partition("#")
        if not path:
            if anchor not in anchors:
                broken.append(target)
        elif not (ROOT / path).exists():
            broken.append(target)
    assert not broken, f"README links to nothing: {broken}"


def test_the_readme_starts_with_the_two_commands() -> None:
    """CI runs the README's test command; the install page shows the same two commands."""
    head = README.read_text().split("\n")[:16]
    assert head[10].startswith("python3 -m venv .venv && ") and head[10].endswith(" -e . && kvoffload demo")
    assert head[14].startswith("python3 -m venv .venv && ") and " -e '.[test]' " in head[14]
    assert head[14].endswith(" && python -m pytest")
    install = (ROOT / "docs" / "getting-started" / "install.md").read_text()
    assert head[10] in install and head[14] in install
