"""A registry of named specs that users extend in their own process: the one shape behind the policy
objectives (`respo_jax.objectives.OBJECTIVES`, `register_objective`) and the training rewards
(`respo_jax.rewards.REWARDS`, `register_reward`).

A registry is a dict from name to spec, so `name in registry`, `registry[name]` and `sorted(registry)`
read as before; what it adds are the rules both share: a name is a letter, then letters, digits, `_` or
`-`; the built-ins (the entries present when `freeze_builtins` is called) can be neither replaced nor
removed; a taken name is replaced only on request. Each error is one line naming the kind, the name and
what is allowed.
"""

from __future__ import annotations

import re
from typing import Generic, TypeVar

SpecT = TypeVar("SpecT")
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_\-]*")


class Registry(dict, Generic[SpecT]):
    """name -> spec of one kind ("objective", "reward"), with its built-ins frozen."""

    def __init__(self, kind: str, entries: dict[str, SpecT] | None = None):
        super().__init__(entries or {})
        self.kind = kind
        self.builtins: frozenset[str] = frozenset()

    def freeze_builtins(self) -> frozenset[str]:
        """Marks the entries present now as the built-ins, and returns their names."""
        self.builtins = frozenset(self)
        return self.builtins

    def names(self) -> list[str]:
        """Every registered name, built-ins first."""
        return sorted(self.builtins) + sorted(set(self) - self.builtins)

    def user_names(self) -> list[str]:
        return sorted(set(self) - self.builtins)

    def check_name(self, name) -> None:
        """ValueError unless `name` is a letter, then letters, digits, `_` or `-`."""
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"{self.kind} name must start with a letter and hold only letters, digits, "
                             f"'_' or '-'; got {name!r}")

    def check_free(self, name: str, replace: bool) -> None:
        """ValueError when `name` is built in, or taken and `replace` is false."""
        if name in self.builtins:
            raise ValueError(f"{self.kind} {name!r} is built in and cannot be replaced; register under a new "
                             "name")
        if name in self and not replace:
            raise ValueError(f"{self.kind} {name!r} is already registered; pass replace=True to replace it")

    def check_new(self, name, replace: bool, well_typed: bool, needs: str, got: str) -> None:
        """The checks before `register_<kind>(name, value)` adds an entry: `check_name`; TypeError unless
        `well_typed` ("register_<kind>(name, ...) needs <needs>; got <got>"); `check_free`."""
        self.check_name(name)
        if not well_typed:
            raise TypeError(f"register_{self.kind}({name!r}, ...) needs {needs}; got {got}")
        self.check_free(name, replace)

    def remove(self, name: str) -> None:
        """Removes a user entry; a built-in raises ValueError, an unknown name KeyError."""
        if name in self.builtins:
            raise ValueError(f"{self.kind} {name!r} is built in and cannot be removed")
        if name not in self:
            raise KeyError(f"no registered {self.kind} {name!r}; user {self.kind}s are {self.user_names()}")
        del self[name]
