"""Token-level call inputs of the memory agent: ``q`` once, then ``[q | memory | chunk]`` per call.

Every call of an episode starts with the same prefix ids ``q``; only the context after it
changes. Both come from the model's chat template, rendered as text and split there::

    render(prompt)                                   -> q      "<|im_start|>user\\n<task+questions><|im_end|>\\n"
    render(prompt + [user: message], gen. prompt)    =  q-text + delta
    delta = head + MEMORY + tail                     -> x_t = enc(head) + memory_ids + enc(tail)

    memory call t:  message = "Memory:\\n<MEMORY>\\n\\nChunk t+1 of N:\\n<chunk>\\n\\n<write instruction>"
    answer call:    message = "Memory:\\n<MEMORY>\\n\\n<answer instruction>"

``memory_ids`` are the exact ids the model sampled as memory in the previous call (never
re-tokenized text); with no memory (first call, or the model wrote none) the prompts'
``empty_memory`` text is encoded in its place. ``enc`` is ``tokenizer.encode(...,
add_special_tokens=False)``, the same function that encodes ``q``.
"""

from __future__ import annotations

from typing import Any, Sequence

from verl_memopd.tasks.prompts import MemoryPrompts

__all__ = ["CallContext", "MEMORY_PLACEHOLDER"]

#: Stand-in for the memory while rendering the chat template (private-use characters).
MEMORY_PLACEHOLDER = "\ue000memopd-memory\ue000"


class CallContext:
    """Builds the exact input ids of one episode's calls (see module docstring).

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        prompt: the row's chat messages (``raw_prompt``): the source of ``q``.
        prompts: the per-call message texts.
        chat_template_kwargs: extra ``apply_chat_template`` arguments (verl's
            ``data.apply_chat_template_kwargs``).
        where: names the row in errors.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt: Sequence[dict],
        prompts: MemoryPrompts,
        chat_template_kwargs: dict | None = None,
        where: str = "row ?",
    ):
        self.tokenizer, self.prompts, self.where = tokenizer, prompts, where
        self.prompt = [dict(m) for m in prompt]
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._prefix_text = self._render(self.prompt, add_generation_prompt=False)
        self.prefix_ids: tuple[int, ...] = self._encode(self._prefix_text)
        if not self.prefix_ids:
            raise ValueError(f"{where}: the prompt renders to no tokens")
        self._empty_ids = self._encode(prompts.empty_memory)

    def memory_call(self, memory_ids: Sequence[int], chunk: str, index: int, total: int) -> tuple[int, ...]:
        """``x_t`` of memory call ``index`` (0-based) over ``chunk``: the ids after ``q``."""
        return self._context(self.prompts.memory_message(MEMORY_PLACEHOLDER, chunk, index, total), memory_ids)

    def answer_call(self, memory_ids: Sequence[int]) -> tuple[int, ...]:
        """``x_T`` of the final call, which answers from memory alone."""
        return self._context(self.prompts.answer_message(MEMORY_PLACEHOLDER), memory_ids)

    def _context(self, message: str, memory_ids: Sequence[int]) -> tuple[int, ...]:
        full = self._render(self.prompt + [{"role": "user", "content": message}], add_generation_prompt=True)
        if not full.startswith(self._prefix_text):
            raise ValueError(
                f"{self.where}: the chat template renders the prompt differently once a message follows it, "
                "so the prefix q could not be identical in every call"
            )
        parts = full[len(self._prefix_text) :].split(MEMORY_PLACEHOLDER)
        if len(parts) != 2:
            raise ValueError(
                f"{self.where}: the chat template altered the call message (memory slot found "
                f"{len(parts) - 1} times, expected once)"
            )
        head, tail = parts
        return self._encode(head) + (tuple(memory_ids) or self._empty_ids) + self._encode(tail)

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.chat_template_kwargs
        )

    def _encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))
