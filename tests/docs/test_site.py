"""The documentation site as built: ``mkdocs build --strict`` once per session (about 6 s on 2 busy CPU cores), then
checks on its HTML.

- The CLI reference shows every option of every command of the click app (`h2o_compress.cli.click_app`, walked
  recursively), each in its own command's section.
- No page shows a raw Sphinx role (``:class:`...```) or a reStructuredText literal-block marker (``Quick start::``)
  as text: the docstrings are Markdown (Google style), cross-references are ``[Name][h2o_compress.path]``.
"""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from h2o_compress.cli import click_app

REPO = Path(__file__).resolve().parents[2]
PROG_NAME = "h2o-compress"
RAW_ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):(?=\S)")
# a paragraph ending in "word::" (rST: the indented block after it is code); "aten::op" or a code span is not one
LITERAL_MARKER = re.compile(r"\w::\s*</p>")
SECTION_HEADING = re.compile(r'<h[1-6] id="([^"]+)"')


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> Path:
    """The site built from this checkout, strictly (a warning fails the build)."""
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(out)], cwd=REPO,
        capture_output=True, text=True, timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stdout}\n{build.stderr}"
    return out


def page_text(page_html: str) -> str:
    """What a reader sees: no scripts, styles or tags, entities decoded."""
    page_html = re.sub(r"<(script|style)\b.*?</\1>", "", page_html, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", "", page_html))


def commands(command, path: tuple[str, ...] = (PROG_NAME,)):
    """Every command of the app, groups included, with its path (``("h2o-compress", "eval", "needle")``)."""
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from commands(sub, (*path, name))


def sections(page_html: str) -> dict[str, str]:
    """The HTML under each heading, by the heading's id."""
    parts = SECTION_HEADING.split(page_html)
    return dict(zip(parts[1::2], parts[2::2]))


def test_the_cli_reference_shows_every_option_of_every_command(site):
    by_id = sections((site / "reference" / "cli" / "index.html").read_text())
    missing = []
    for path, command in commands(click_app):
        section = by_id.get("-".join(path))
        if section is None:
            missing.append(f"{' '.join(path)}: no section")
            continue
        context = command.context_class(command, info_name=path[-1])
        for param in command.get_params(context):
            if getattr(param, "hidden", False):
                continue
            names = [param.name.upper()] if param.param_type_name == "argument" else param.opts + param.secondary_opts
            missing += [f"{' '.join(path)} {name}" for name in names if f"<code>{name}</code>" not in section]
    assert not missing, f"options missing from the CLI reference: {missing}"


def test_no_page_shows_raw_sphinx_roles_or_rst_literal_markers(site):
    found = []
    for page in sorted(site.rglob("*.html")):
        page_html = page.read_text()
        text = page_text(page_html)
        found += [f"{page.relative_to(site)}: ...{text[max(0, m.start() - 40):m.end() + 40]!r}"
                  for m in RAW_ROLE.finditer(text)]
        found += [f"{page.relative_to(site)}: ...{page_html[max(0, m.start() - 60):m.end()]!r}"
                  for m in LITERAL_MARKER.finditer(page_html)]
    assert not found, f"{len(found)} raw reStructuredText leftovers on the site, e.g. {found[:10]}"
