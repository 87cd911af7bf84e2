"""The command line as a plain ``click`` command tree: what the documentation's CLI reference (mkdocs-click) reads.

Typer builds its commands on its own copy of click (``typer._click``), whose options are not ``click.Option``
objects and carry no click type, so mkdocs-click, which lists the ``click.Option`` parameters of a command, shows
none of them. `click_command` mirrors `h2o_compress.cli.click_app` command by command: each option with its
names, type (as ``--help`` shows it), default and help text; the arguments as a table in the command's text; and
each command's whole first paragraph as its summary. Rich markup (``\\[ray]``) is turned into plain text.

`click_command` is built on first use: only the documentation needs ``click`` (mkdocs-click brings it).
"""

from __future__ import annotations

import html

from rich.markup import render

from h2o_compress.cli import click_app

PROG_NAME = "h2o-compress"
REQUIRED = "required"  # the default column of an option that has none because it must be given


def __getattr__(name: str):
    if name == "click_command":
        return mirror_command(click_app, PROG_NAME)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def mirror_command(command, name: str, parent=None):
    """A ``click.Command`` (or ``click.Group``) documenting the Typer ``command`` called ``name``."""
    import click  # deferred: a documentation dependency (mkdocs-click), not one of the package

    context = command.context_class(command, info_name=name, parent=parent)
    text = plain_text(command.help or "")
    summary = " ".join(text.split("\n\n")[0].split())
    params = command.get_params(context)  # --help included
    arguments = [param for param in params if param.param_type_name == "argument"]
    mirrored = [click.Argument([param.name], required=param.required) for param in arguments]
    mirrored += [mirror_option(param, context) for param in params if param.param_type_name == "option"]
    settings = dict(params=mirrored, help=text + arguments_table(arguments, context), short_help=summary,
                    hidden=command.hidden, add_help_option=False)
    subcommands = getattr(command, "commands", None)
    if subcommands is None:
        return click.Command(name, **settings)
    return click.Group(name, commands=[mirror_command(sub, sub_name, context) for sub_name, sub in subcommands.items()],
                       **settings)


def mirror_option(param, context):
    """A ``click.Option`` with the names, type name, default and help of the Typer option ``param``."""
    import click  # deferred: a documentation dependency (mkdocs-click), not one of the package

    names = list(param.opts)
    if param.secondary_opts:  # a --flag/--no-flag pair
        names = [f"{param.opts[0]}/{param.secondary_opts[0]}", *param.opts[1:]]
    option = click.Option(names, is_flag=bool(param.secondary_opts), hidden=param.hidden,
                          help=table_cell(param.help or ""))
    option.type = ShownType(type_name(param, context))
    option.default = default_shown(param)
    return option


def type_name(param, context) -> str:
    """The type ``--help`` shows (``int``, ``str``, ``list[str]``...)."""
    if hasattr(param, "display_type"):  # Typer's own click: "<int>"
        return param.display_type(context).strip("<>")
    return param.type.name  # Typer on click: a click type


def default_shown(param):
    """What the default column says: the value, the flag a --flag/--no-flag pair is on, or that it is required."""
    if param.required:
        return REQUIRED
    default = param.default
    if callable(default):
        return "(dynamic)"
    if getattr(param, "is_flag", False) and not param.secondary_opts and default is None:  # --help
        return False
    if param.secondary_opts and isinstance(default, bool):
        return param.opts[0] if default else param.secondary_opts[0]
    if isinstance(default, (list, tuple)):
        return ", ".join(map(str, default)) or None
    return default


def arguments_table(arguments, context) -> str:
    """The command's arguments as a Markdown table (mkdocs-click lists options only)."""
    if not arguments:
        return ""
    rows = [f"| `{param.name.upper()}` | {type_name(param, context)} | {table_cell(param.help or '')} |"
            for param in arguments]
    return "\n\n**Arguments:**\n\n| Name | Type | Description |\n| ---- | ---- | ----------- |\n" + "\n".join(rows)


def plain_text(text: str) -> str:
    """Text without Rich markup (``\\[ray]`` -> ``[ray]``), as ``--help`` prints it."""
    return render(text).plain


def table_cell(text: str) -> str:
    """One line of Markdown for a table cell: plain text, HTML-escaped, no ``|``."""
    return html.escape(" ".join(plain_text(text).split()), quote=False).replace("|", "&#124;")


class ShownType:
    """A click type that is only a name: mkdocs-click prints an option's ``type.name``."""

    def __init__(self, name: str):
        self.name = name
