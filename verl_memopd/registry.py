"""Name -> implementation registries (divergences, supervision transports), in verl's style.

Duplicate names are refused; a lookup of an unknown name lists the valid ones.
"""

from __future__ import annotations

from typing import Any, Callable


class Registry(dict):
    """A ``{name: class}`` registry for one kind of component (e.g. ``"divergence"``)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def register(self, name: str) -> Callable[[type], type]:
        """Class decorator: register ``cls`` under ``name`` (and set ``cls.name``)."""

        def decorator(cls: type) -> type:
            if name in self:
                raise ValueError(f"{self.kind} {name!r} is already registered ({self[name]})")
            cls.name = name
            self[name] = cls
            return cls

        return decorator

    def build(self, name: str, **params: Any) -> Any:
        """Instantiate the class registered as ``name`` with ``params``."""
        if name not in self:
            raise ValueError(f"unknown {self.kind} {name!r}; valid {self.kind}s: {sorted(self)}")
        return self[name](**params)
