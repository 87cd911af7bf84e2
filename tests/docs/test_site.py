"""The documentation site as built: ``mkdocs build --strict`` once per session (about 6 s on 2 busy CPU cores), then
checks on its HTML.

- The CLI reference shows every option of every command of the click app (`h2o_compress.cli.click_app`, walked
  recursively), each in its own command's section.
- No page shows a raw Sphinx role (``:class:`...```) or a reStructuredText literal-block marker (``Quick start::``)
  as text: the docstrings are Markdown (Google style), cross-references are ``[Name][h2o_compress.path]``.
- No paragraph holds a list run into it (Python-Markdown needs a blank line before a list: ``What is counted:`` and
  then ``- KV cache: ...`` on the next line renders as one paragraph with the dashes in the text).
- No arithmetic renders as emphasis (``2**24 ... 2**20`` outside a code span makes ``2<strong>24 ... 2</strong>20``)
  and no ``**`` is left as text outside code.
- The API reference documents every name of ``h2o_compress.__all__``, the entry points a user meets first (load a
  model, generate, ...) before the result types, jobs, cache classes and errors.
- The CLI reference's option tables keep each option name on one line (docs/stylesheets/extra.css).
"""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import h2o_compress
from h2o_compress.cli import click_app

REPO = Path(__file__).resolve().parents[2]
PROG_NAME = "h2o-compress"
RAW_ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):(?=\S)")
# a paragraph ending in "word::" (rST: the indented block after it is code); "aten::op" or a code span is not one
LITERAL_MARKER = re.compile(r"\w::\s*</p>")
SECTION_HEADING = re.compile(r'<h[1-6] id="([^"]+)"')
PARAGRAPH = re.compile(r"<p\b[^>]*>(.*?)</p>", re.S)
# a line of a paragraph that starts with a list marker: "- item", "* item", "+ item", "1. item", "2) item"
INLINE_LIST_ITEM = re.compile(r"\n[ \t]*(?:[-*+]|\d+[.)])[ \t]+\S")
# emphasis glued to a word on its outer side: "2<strong>24, ... 2</strong>20" is "2**24, ... 2**20" read as bold
GLUED_STRONG = re.compile(r"[\w)]<strong>|</strong>\w")
FIRST_MET = ["load_model", "generate", "make_cache", "CompressionConfig", "ask", "compress", "generate_batch", "plan"]


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


def without_code(page_html: str) -> str:
    """The page without scripts, styles, ``<pre>`` blocks and ``<code>`` spans (each replaced by ``CODE``)."""
    page_html = re.sub(r"<(script|style)\b.*?</\1>", "", page_html, flags=re.S)
    return re.sub(r"<(pre|code)\b.*?</\1>", "CODE", page_html, flags=re.S)


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


def test_no_paragraph_holds_a_list_run_into_it(site):
    found = []
    for page in sorted(site.rglob("*.html")):
        for paragraph in PARAGRAPH.finditer(without_code(page.read_text())):
            text = html.unescape(re.sub(r"<[^>]+>", "", paragraph.group(1)))
            found += [f"{page.relative_to(site)}: ...{text[max(0, m.start() - 50):m.end() + 20]!r}"
                      for m in INLINE_LIST_ITEM.finditer(text)]
    assert not found, f"{len(found)} list items rendered inside a paragraph (a blank line is missing before the " \
                      f"list), e.g. {found[:10]}"


def test_no_arithmetic_renders_as_emphasis_or_stray_stars(site):
    found = []
    for page in sorted(site.rglob("*.html")):
        page_html = without_code(page.read_text())
        found += [f"{page.relative_to(site)}: ...{page_html[max(0, m.start() - 40):m.end() + 40]!r}"
                  for m in GLUED_STRONG.finditer(page_html)]
        text = html.unescape(re.sub(r"<[^>]+>", "", page_html))
        found += [f"{page.relative_to(site)}: ...{text[max(0, m.start() - 40):m.end() + 20]!r}"
                  for m in re.finditer(r"\*\*", text)]
    assert not found, f"{len(found)} places where ** is text or emphasis glued to a number (write 2**24 as a code " \
                      f"span), e.g. {found[:10]}"


def test_the_api_reference_documents_every_public_name_entry_points_first(site):
    page_html = (site / "reference" / "api" / "index.html").read_text()
    shown = re.findall(r'<h3 id="h2o_compress\.(\w+)"', page_html)
    public = [name for name in h2o_compress.__all__ if not name.startswith("_")]
    assert sorted(shown) == sorted(public), \
        f"docs/reference/api.md's members list and h2o_compress.__all__ differ: " \
        f"missing {sorted(set(public) - set(shown))}, extra {sorted(set(shown) - set(public))}"
    assert shown[:len(FIRST_MET)] == FIRST_MET


def test_the_cli_reference_keeps_option_names_whole(site):
    page_html = (site / "reference" / "cli" / "index.html").read_text()
    assert "stylesheets/extra.css" in page_html
    wrapped = page_html.split('<div class="cli-reference">', 1)
    assert len(wrapped) == 2 and page_html.count("<table") == wrapped[1].count("<table") > 0
    css = (site / "stylesheets" / "extra.css").read_text()
    rule = re.search(r"\.cli-reference table td:first-child code\s*\{([^}]*)\}", css)
    assert rule and "white-space: nowrap" in rule.group(1) and "word-break: keep-all" in rule.group(1)
