"""A command group that imports a command's module only when that command runs (or its own ``--help`` is asked).

The commands' modules import torch and transformers (through the library they call); ``h2o-compress --help``,
``--version`` and a mistyped command name need neither, so the group lists its commands from `LazyCommand`
declarations, each with the module and name of the command and its summary kept as a string here. This module
imports nothing of the package.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass

import typer
from typer.core import TyperCommand, TyperGroup


@dataclass(frozen=True)
class LazyCommand:
    """A command declared without importing it.

    Attributes:
        module: the module that defines it (``"h2o_compress.cli.generate"``).
        attr: the command function in ``module``, or a ``typer.Typer`` (a group of commands, e.g. ``eval``).
        summary: the one-paragraph help ``h2o-compress --help`` lists; a test checks it against the command's own.
        cls: ``"module:Class"``, the click command class of a function (``None``: typer's default); not for a group.
    """

    module: str
    attr: str
    summary: str
    cls: str | None = None


def _resolve(path: str):
    """The object ``"package.module:name"`` names (the module imported)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@functools.lru_cache(maxsize=None)
def load_command(name: str, declared: LazyCommand):
    """The click command ``declared`` names, called ``name``: its module imported, the command built once (typer's
    own conversion of the function or ``typer.Typer``)."""
    target = getattr(importlib.import_module(declared.module), declared.attr)
    if isinstance(target, typer.Typer):
        command = typer.main.get_command(target)
        command.name = name
        return command
    single = typer.Typer(add_completion=False)
    single.command(name, cls=_resolve(declared.cls) if declared.cls else None)(target)
    return typer.main.get_command(single)


class LazyCommands(MutableMapping):
    """The commands of a `LazyGroup` by name, in declaration order: a declared command is imported when it is first
    looked up (``commands["generate"]``, ``.get``, ``.items()``); its name alone (``in``, iteration, ``keys()``)
    imports nothing."""

    def __init__(self, declared: dict[str, LazyCommand], loaded: dict | None = None):
        self.declared = dict(declared)
        self.loaded = dict(loaded or {})

    def __getitem__(self, name: str):
        """The command ``name``, imported on first access. Raises KeyError: no such command."""
        if name not in self.loaded:
            if name not in self.declared:
                raise KeyError(name)
            self.loaded[name] = load_command(name, self.declared[name])
        return self.loaded[name]

    def __setitem__(self, name: str, command) -> None:
        self.loaded[name] = command

    def __delitem__(self, name: str) -> None:
        if name not in self:
            raise KeyError(name)
        self.declared.pop(name, None)
        self.loaded.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return name in self.declared or name in self.loaded

    def __iter__(self) -> Iterator[str]:
        yield from self.declared
        yield from (name for name in self.loaded if name not in self.declared)

    def __len__(self) -> int:
        return len(self.declared.keys() | self.loaded.keys())

    def summary(self, name: str):
        """The command ``name`` for a listing: the loaded one, else a stand-in with its declared summary only."""
        if name in self.loaded or name not in self.declared:
            return self.loaded.get(name)
        return TyperCommand(name, help=self.declared[name].summary)


class LazyGroup(TyperGroup):
    """A typer group whose commands are `LazyCommand` declarations (`declare`): ``--help`` lists their summaries,
    running a command (or its ``--help``) imports its module."""

    #: The declared commands, by name, in the order ``--help`` lists them (set by `declare`).
    declared: dict[str, LazyCommand] = {}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.commands = LazyCommands(self.declared, self.commands)
        self._listing = False

    @classmethod
    def declare(cls, commands: dict[str, LazyCommand]) -> type[LazyGroup]:
        """A subclass of this group with these commands (the ``cls`` of a ``typer.Typer``)."""
        return type(cls.__name__, (cls,), {"declared": dict(commands), "__doc__": cls.__doc__})

    def list_commands(self, ctx) -> list[str]:
        """The command names, in declaration order (nothing imported)."""
        return list(self.commands)

    def get_command(self, ctx, cmd_name: str):
        """The command ``cmd_name`` (imported now), or ``None``; while ``--help`` lists the commands, a stand-in
        with its declared summary."""
        if self._listing:
            return self.commands.summary(cmd_name)
        return self.commands.get(cmd_name)

    def format_help(self, ctx, formatter) -> None:
        """The group's help, its command list from the declared summaries."""
        self._listing = True  # the command list shows the declared summaries: no command module imported
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False

    def load_all(self) -> LazyGroup:
        """This group with every command imported (for what walks the whole tree, e.g. the CLI reference)."""
        for name in list(self.commands):
            self.commands[name]
        return self
