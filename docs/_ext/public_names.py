"""Griffe extension for the docs' API reference: a name the package root exports that is also a submodule's name
(``h2o_compress.ask`` the function vs ``h2o_compress/ask.py``, ``plan`` vs ``planner/plan.py``) is documented as
what ``import`` gives, the function, not the module that static analysis finds under that name."""

from __future__ import annotations

import griffe


class PublicNames(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        for name in pkg.exports or ():
            obj = pkg.members.get(name)
            if obj is None:
                continue
            target = obj.final_target if obj.is_alias else obj
            while target.is_module and name in target.members:  # the module's own object of that name
                target = target.members[name]
                target = target.final_target if target.is_alias else target
            if target is not obj and not target.is_module:
                pkg.set_member(name, griffe.Alias(name, target, parent=pkg))
