"""Named entries registered by extension (a framework, a context-parallel implementation, a tensor-parallel
overlap mode, ...): one place for adding, listing and looking them up, with one-line errors.

Entries keep their registration order, so the first registered (a module's default) is listed first.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Generic, TypeVar

from pipewright.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """Entries by name. ``what`` names an entry in errors ("framework"); ``flag`` is the option that
    chooses one ("--framework")."""

    def __init__(self, what: str, flag: str) -> None:
        self.what = what
        self.flag = flag
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T, *, override: bool = False) -> T:
        """Register ``entry`` as ``name``; a one-line error for a name taken (unless ``override``)."""
        if name in self._entries and not override:
            raise ConfigError(f"{self.what} {name!r} is already registered")
        self._entries[name] = entry
        return entry

    def remove(self, name: str) -> None:
        """Forget ``name`` (nothing if it is not registered)."""
        self._entries.pop(name, None)

    def get(self, name: str) -> T:
        """The entry ``name``; a one-line ConfigError naming the choices otherwise."""
        entry = self._entries.get(name)
        if entry is None:
            raise ConfigError(f"unknown {self.flag} {name!r}; choose one of: {', '.join(self._entries)}")
        return entry

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._entries)

    def view(self) -> Mapping[str, T]:
        """The entries by name (read-only, live)."""
        return MappingProxyType(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries
