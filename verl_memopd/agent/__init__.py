"""Memory agent (stage 1 of the data flow): multi-call rollouts in verl's agent loop.

``context`` assembles each call's exact input ids at the token level (``q`` identical in every
call); ``loop`` is the verl agent loop registered as ``memopd_memory_agent`` that records every
call as an invocation and hands the episode to verl as one packed row. Importing this package
registers the loop with verl (that is its only side effect).
"""

from verl_memopd.agent.loop import MemoryAgentConfig, MemoryAgentLoop

__all__ = ["MemoryAgentConfig", "MemoryAgentLoop"]
