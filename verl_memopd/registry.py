"""Key -> implementation registries, in verl's style: divergences and supervision transports (built from a name),
attention backends, packing layouts, and the divergence kernel of each teacher-target type.

A key registered twice is refused; a lookup of an unknown key names the valid ones.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, TypeVar

T = TypeVar("T")


class UnknownKeyError(KeyError, ValueError):
    """A registry has nothing under the key (a ``KeyError`` for lookups, a ``ValueError`` for config checks)."""

    def __str__(self) -> str:
        return str(self.args[0])


def _label(key: Hashable) -> str:
    return key.__name__ if isinstance(key, type) else str(key)


class Registry(dict):
    """A ``{key: entry}`` registry for one kind of component (e.g. ``"divergence"``); keys are names, or types."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def add(self, key: Hashable, entry: Any) -> None:
        """Register ``entry`` under ``key``; a key already registered is refused."""
        if key in self:
            raise ValueError(f"{self.kind} {_label(key)!r} is already registered ({self[key]})")
        self[key] = entry

    def register(self, key: Hashable) -> Callable[[T], T]:
        """Decorator: register the decorated object under ``key`` (a class registered by name gets ``cls.name``)."""

        def decorator(obj: T) -> T:
            self.add(key, obj)
            if isinstance(obj, type) and isinstance(key, str):
                obj.name = key
            return obj

        return decorator

    def lookup(self, key: Hashable) -> Any:
        """The entry under ``key``; an unknown key raises ``UnknownKeyError`` naming the valid ones."""
        if key not in self:
            valid = ", ".join(sorted(map(_label, self)))
            raise UnknownKeyError(f"unknown {self.kind} {_label(key)!r}; valid {self.kind}s: {valid}")
        return self[key]

    def build(self, name: str, **params: Any) -> Any:
        """Instantiate the class registered as ``name`` with ``params``."""
        return self.lookup(name)(**params)
