"""What the docs site generates rather than states: the options table and the command-line reference.

Two mkdocs hooks and a griffe extension, loaded by mkdocs.yml:

- ``<!-- kvoffload:options -->`` in a page becomes the table of every field of ``kvoffload.Options``:
  its default, its unit and the section that explains it, with the field's attribute docstring. A
  field without an entry in ``EXPLAINED`` below (or an entry without a field) fails the build, so a
  new option cannot be left out of the reference.
- ``<!-- kvoffload:cli -->`` becomes the ``--help`` of ``kvoffload`` and of each of its subcommands,
  whatever subcommands the installed CLI has.
- ``SphinxRoles`` turns the Sphinx roles of the docstrings (``:class:`Transfer```, ``:meth:`start```)
  into Markdown for mkdocstrings: a link for a public name of ``kvoffload``, a code span otherwise.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import re
import subprocess
import sys
from types import ModuleType
from typing import Any

import griffe
from mkdocs.exceptions import PluginError

# Each option: (its unit or values, the page and section that explains it; links relative to docs/).
EXPLAINED: dict[str, tuple[str, str]] = {
    "host_blocks": ("slots", "how-to/sizing.md#how-big-each-tier-is"),
    "host_bytes": ("bytes: an int or a string such as `\"64GiB\"`", "how-to/sizing.md#how-big-each-tier-is"),
    "disk_path": ("a path: the file, or a directory to put it in", "how-to/disk-tier.md"),
    "disk_blocks": ("slots", "how-to/disk-tier.md#sizing"),
    "disk_bytes": ("bytes: an int or a string such as `\"400GiB\"`", "how-to/disk-tier.md#sizing"),
    "chunk_bytes": ("bytes (an int)", "how-to/sizing.md#every-memory-kvoffload-takes"),
    "bounce_bytes": ("bytes: an int or a string such as `\"32MiB\"`", "how-to/sizing.md#every-memory-kvoffload-takes"),
    "gather_ctas": ("CTAs per copy-kernel launch", "PERFORMANCE.md#choosing-the-gpu-copy-options"),
    "copy_engine": ("`\"kernel\"` or `\"dma\"`", "PERFORMANCE.md#choosing-the-gpu-copy-options"),
    "use_batch_copy": ("bool", "explanations/platforms.md"),
    "io_threads": ("threads", "how-to/disk-tier.md#io"),
    "use_page_cache": ("bool", "how-to/disk-tier.md#page-cache"),
    "expedited_loads": ("bool", "how-to/per-layer-loads.md#expedited-loads"),
    "promote": ("bool", "how-to/disk-tier.md#promotion"),
    "persist": ("bool", "how-to/persistence.md"),
    "fingerprint": ("a str or bytes", "how-to/persistence.md#cache-identity"),
    "verify": ("bool", "how-to/persistence.md#what-is-on-disk"),
    "remote": ("a Redis URL or a `redis.asyncio` client", "how-to/remote.md"),
    "remote_shard": ("a str", "how-to/remote.md"),
    "remote_write": ("`\"through\"`, `\"evict\"` or `\"none\"`", "how-to/remote.md#when-blocks-are-written"),
    "remote_secret": ("bytes, `\"env:NAME\"`, or a list of them", "security.md"),
    "namespace": ("a str of up to 128 printable characters", "security.md"),
    "encryption_key": ("32 bytes, `\"env:NAME\"` or `\"file:PATH\"`", "security.md"),
}

OPTIONS_MARK = "<!-- kvoffload:options -->"
CLI_MARK = "<!-- kvoffload:cli -->"


def on_page_markdown(markdown: str, page: Any, config: Any, **kwargs: Any) -> str:
    """Fill the marks of a page with what they stand for."""
    if OPTIONS_MARK in markdown:
        markdown = markdown.replace(OPTIONS_MARK, options_table(page.file.src_uri, config["docs_dir"]))
    if CLI_MARK in markdown:
        markdown = markdown.replace(CLI_MARK, cli_reference())
    return markdown


# -- the options ---------------------------------------------------------------------------------


def options_table(src_uri: str, docs_dir: str) -> str:
    """The Markdown table of ``kvoffload.Options``' fields, for the page at ``src_uri`` of ``docs_dir``."""
    from kvoffload._core.base import options as module
    from kvoffload._core.base.options import Options, format_size

    fields = [f.name for f in dataclasses.fields(Options)]
    missing, extra = set(fields) - set(EXPLAINED), set(EXPLAINED) - set(fields)
    if missing or extra:
        raise PluginError(
            f"docs/hooks.py: EXPLAINED and kvoffload.Options differ: give a unit and a section for {sorted(missing)}, "
            f"drop {sorted(extra)}"
        )
    docs = attribute_docstrings(module, "Options")
    up = "../" * src_uri.count("/")  # links in EXPLAINED are relative to docs/
    rows = ["| option | default | unit | what it does | explained in |", "|---|---|---|---|---|"]
    for field in dataclasses.fields(Options):
        default = field.default
        shown = f"`{default!r}`"
        if isinstance(default, int) and not isinstance(default, bool) and field.name.endswith("_bytes"):
            shown += f" ({format_size(default)})"
        unit, section = EXPLAINED[field.name]
        doc = " ".join(roles_to_markdown(docs.get(field.name, "")).split()).replace("|", "\\|")
        if not doc:
            raise PluginError(f"docs/hooks.py: Options.{field.name} has no attribute docstring")
        rows.append(f"| `{field.name}` | {shown} | {unit} | {doc} | [{section_title(docs_dir, section)}]({up}{section}) |")
    return "\n".join(rows)


def section_title(docs_dir: str, section: str) -> str:
    """``"Page title"`` or ``"Page title: Section"`` for a link ``page.md#anchor`` relative to ``docs_dir``
    (a page that is not there yet is named by its file: the build fails on the broken link anyway)."""
    from markdown.extensions.toc import slugify

    path, _, anchor = section.partition("#")
    try:
        with open(os.path.join(docs_dir, path)) as f:
            headings = [line.lstrip("#").strip() for line in f if re.match(r"#{1,6} ", line)]
    except FileNotFoundError:
        return path
    title = headings[0] if headings else path
    if not anchor:
        return title
    for heading in headings:
        if slugify(heading.replace("`", ""), "-") == anchor:
            return f"{title}: {heading}"
    raise PluginError(f"docs/hooks.py: {path} has no section #{anchor}")


def attribute_docstrings(module: ModuleType, name: str) -> dict[str, str]:
    """The docstrings written under the attributes of class ``name`` of ``module`` (PEP 257 attribute
    docstrings; from the module's source: kvoffload reports ``kvoffload`` as its classes' module)."""
    tree = ast.parse(inspect.getsource(module))
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    found: dict[str, str] = {}
    for stmt, after in zip(body.body, body.body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            found[stmt.target.id] = inspect.cleandoc(after.value.value)
    return found


# -- the command line ----------------------------------------------------------------------------


def cli_reference() -> str:
    """``kvoffload --help`` and each subcommand's, as the installed CLI prints them."""
    top = _help([])
    choices = re.search(r"\{([a-z,]+)\}", top)
    if choices is None:
        raise PluginError(f"docs/hooks.py: no subcommands in `kvoffload --help`:\n{top}")
    parts = ["## `kvoffload`", "", "```text", top.rstrip(), "```"]
    for command in choices[1].split(","):
        parts += ["", f"## `kvoffload {command}`", "", "```text", _help([command]).rstrip(), "```"]
    return "\n".join(parts)


def _help(args: list[str]) -> str:
    env = dict(os.environ, COLUMNS="100", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "kvoffload.cli", *args, "--help"], capture_output=True, text=True,
                          timeout=120, env=env)
    if proc.returncode != 0:
        raise PluginError(f"docs/hooks.py: `kvoffload {' '.join(args)} --help` failed:\n{proc.stdout}{proc.stderr}")
    return proc.stdout.replace("usage: __main__.py", "usage: kvoffload").replace("usage: cli.py", "usage: kvoffload")


# -- the docstrings ------------------------------------------------------------------------------

_ROLE = re.compile(r":(?:class|meth|func|data|attr|exc|mod|obj):`~?([^`]+)`")


def _public() -> frozenset[str]:
    import kvoffload

    return frozenset(kvoffload.__all__)


def roles_to_markdown(text: str) -> str:
    """``:class:`Transfer``` -> a link to ``kvoffload.Transfer``; any other role -> a code span."""

    def one(m: re.Match[str]) -> str:
        target = m[1].removeprefix("kvoffload.").strip()
        if target in _public():
            return f"[`{target}`][kvoffload.{target}]"
        return f"`{target}`"

    return _ROLE.sub(one, text)


class SphinxRoles(griffe.Extension):
    """A griffe extension: the Sphinx roles of every docstring made Markdown (see :func:`roles_to_markdown`)."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = roles_to_markdown(obj.docstring.value)
