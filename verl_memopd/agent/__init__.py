"""Memory agent (stage 1 of the data flow): multi-call rollouts in verl's agent loop.

``context`` assembles each call's exact input ids at the token level (``q`` identical in every
call); it needs only the task code and a tokenizer, so it imports without verl. ``loop`` is the
verl agent loop registered as ``memopd_memory_agent`` that records every call as an invocation and
hands the episode to verl as one packed row; it imports verl (and omegaconf) and registers the loop
on import. ``verl_memopd.plugin`` imports ``loop`` explicitly; this package imports it only when
``MemoryAgentConfig`` or ``MemoryAgentLoop`` is asked for, so ``import verl_memopd.agent.context``
works where verl is not installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MemoryAgentConfig", "MemoryAgentLoop"]

_FROM_LOOP = frozenset(__all__)


def __getattr__(name: str) -> Any:
    """Load the verl agent loop on first use of its names (PEP 562), not on package import."""
    if name in _FROM_LOOP:
        from verl_memopd.agent import loop

        return getattr(loop, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
