"""The default of a dataclass field or a function parameter, read where it is written (a leaf module), so that a
command line option or a wrapper that restates a library default reads it instead of writing it again."""

from __future__ import annotations

import dataclasses
import inspect


def default_of(owner, name: str):
    """The default of field ``name`` of the dataclass ``owner`` (its ``default_factory`` called), or of parameter
    ``name`` of the function ``owner``.

    Raises:
        KeyError: ``owner`` has no such field or parameter, or it has no default.
    """
    if dataclasses.is_dataclass(owner):
        found = owner.__dataclass_fields__[name]
        if found.default is not dataclasses.MISSING:
            return found.default
        if found.default_factory is not dataclasses.MISSING:
            return found.default_factory()
    else:
        default = inspect.signature(owner).parameters[name].default
        if default is not inspect.Parameter.empty:
            return default
    raise KeyError(f"{getattr(owner, '__name__', owner)}.{name} has no default")
