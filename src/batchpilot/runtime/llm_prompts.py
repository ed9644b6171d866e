"""Prompts to token ids, in a small thread pool so that a long prompt or a chat template never holds the
event loop (health checks and every stream keep going while it runs).

Each worker thread uses its own copy of the tokenizer: HF fast tokenizers are not safe to share between
threads (a call that changes truncation or padding borrows the Rust object mutably). A prompt the
tokenizer or template cannot take (a lone surrogate, roles out of order) is a ``RequestRejected`` with a
fixed message; the tokenizer's own text goes to the log only.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from batchpilot.runtime.llm_errors import RequestRejected

log = logging.getLogger("batchpilot.llm")


class PromptEncoder:
    def __init__(self, tokenizer: Any, vocab_size: int | None, threads: int = 0) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.threads = threads or os.cpu_count() or 1
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="batchpilot-llm-tokenize")
        self._local = threading.local()

    # -- on any thread, with a given tokenizer -----------------------------------------------
    def encode(self, prompt: str | list[int], tokenizer: Any = None) -> list[int]:
        """Token ids of a text prompt, or the given ids checked against the vocabulary."""
        if isinstance(prompt, str):
            try:
                ids = list((tokenizer or self.tokenizer)(prompt)["input_ids"])
            except Exception as exc:
                log.info("prompt not tokenisable: %r", exc)
                raise RequestRejected("the prompt could not be tokenised (is it valid Unicode text?)",
                                      "invalid_value", "prompt") from None
            if not ids:
                raise RequestRejected("the prompt encodes to no tokens; give a non-empty prompt",
                                      "invalid_value", "prompt")
            return ids
        vocab = self.vocab_size
        bad = [t for t in prompt if t < 0 or (vocab is not None and t >= vocab)][:3]
        if bad or not prompt:
            raise RequestRejected(f"prompt token ids must be in [0, {vocab}); got {bad or 'no tokens'}",
                                  "invalid_value", "prompt")
        return [int(t) for t in prompt]

    def encode_chat(self, messages: list[dict[str, str]], tokenizer: Any = None) -> list[int]:
        tok = tokenizer or self.tokenizer
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = list(tok(text, add_special_tokens=False)["input_ids"])
        except Exception as exc:  # a template that refuses the conversation (e.g. role order), bad text
            log.info("chat template failed: %r", exc)
            raise RequestRejected("the chat template could not render these messages (check the order "
                                  "of roles and that the text is valid Unicode)", "invalid_value",
                                  "messages") from None
        if not ids:
            raise RequestRejected("the messages encode to no tokens", "invalid_value", "messages")
        return ids

    # -- off the event loop ------------------------------------------------------------------
    async def encode_async(self, prompt: str | list[int]) -> list[int]:
        return await self._run(self.encode, prompt)

    async def encode_chat_async(self, messages: list[dict[str, str]]) -> list[int]:
        return await self._run(self.encode_chat, messages)

    async def _run(self, fn: Any, arg: Any) -> list[int]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(arg, self._thread_tokenizer()))

    def _thread_tokenizer(self) -> Any:
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            tok = self._local.tokenizer = copy.deepcopy(self.tokenizer)
        return tok

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
