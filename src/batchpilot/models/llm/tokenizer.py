"""An offline tokenizer for the random default model: byte-level BPE trained on Python's own docs.

No hub: the corpus is ``pydoc_data.topics`` (English documentation bundled with CPython), the trainer
is the ``tokenizers`` library, and the result is deterministic (same merges on every machine, checked
in tests). Any text round-trips because the base alphabet is the 256 bytes. A local checkpoint brings
its own tokenizer instead (``load_tokenizer(path)``), and its own chat template (``chat_prompt_ids``: the
template of ``tokenizer_config.json`` or ``chat_template.jinja``; the built-in format only for a
checkpoint without one). The last section turns token ids back into streamed text
(``IncrementalDetokenizer``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

# the built-in chat format, the default tokenizer's template: role markers (special tokens there, text in
# a checkpoint's tokenizer), the assistant turn left open for the model to complete
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}\n{% endif %}"
)


@functools.lru_cache(maxsize=4)
def build_tokenizer(vocab_size: int = 4096) -> PreTrainedTokenizerFast:
    """Train (once per process, ~1 s) the default byte-level BPE tokenizer with ``vocab_size`` ids."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < 300:
        raise ValueError(f"tokenizer: vocab_size must be >= 300 (256 bytes + specials), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([topics[k] for k in sorted(topics)], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS_ID)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=list(SPECIAL_TOKENS[3:]),
        chat_template=CHAT_TEMPLATE,
    )


def load_tokenizer(model_path: str | Path | None, vocab_size: int = 4096) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer for a local path (no hub), else the built-in BPE tokenizer."""
    if model_path is None:
        return build_tokenizer(vocab_size)
    tok = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
    if getattr(tok, "chat_template", None) is None:
        log.warning("llm chat: %s has no chat template; chat prompts use the built-in format (<|role|> "
                    "lines) with the tokenizer's special tokens", model_path)
    else:
        log.info("llm chat: chat prompts use the chat template of %s", model_path)
    return tok


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """A chat's prompt ids. With the tokenizer's own template (the checkpoint's), exactly what
    ``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`` gives: rendered, then
    tokenized without special tokens, since the template writes the BOS where the model wants one (adding
    the tokenizer's would put a second one in front). Without one, the built-in format (``CHAT_TEMPLATE``),
    tokenized as a completion prompt is, with the tokenizer's special tokens (its BOS): that format
    writes none. Raises what the template raises (e.g. on roles out of order)."""
    own = getattr(tokenizer, "chat_template", None) is not None
    text = tokenizer.apply_chat_template(messages, chat_template=None if own else CHAT_TEMPLATE,
                                         add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=not own)["input_ids"])


# -- Incremental detokenizing ----------------------------------------------------------------------
# Token ids to streamed text, one token at a time, with stop strings.
#
# Two offsets (TGI's scheme): decode ``ids[prefix:read]`` and ``ids[prefix:]`` and emit the difference,
# so byte-level BPE tokens that split a UTF-8 character (or merge with a neighbour's leading space)
# never produce garbage; an incomplete character (``\ufffd`` at the end) waits for the next token.
#
# With stop strings, the last ``longest - 1`` characters are held back until they can no longer begin a
# stop string, so no part of a stop string is ever emitted, and the text ends right before the first
# match (OpenAI semantics).

def make_decode(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    """``ids -> text`` skipping special tokens; the Rust tokenizer directly when it is equivalent
    (~4x less overhead per call than HF's Python wrapper, measured), else ``tokenizer.decode``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: str(backend.decode(list(ids), skip_special_tokens=True)) if ids else ""
    return lambda ids: str(tokenizer.decode(list(ids), skip_special_tokens=True)) if ids else ""


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()) -> None:
        self.decode = decode
        self.stop = tuple(stop)
        self.longest = max((len(s) for s in self.stop), default=0)
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # with stop strings: all text so far, of which ``emitted`` characters were sent
        self.emitted = 0

    def step(self, ids: Sequence[int]) -> tuple[str, bool]:
        """``ids``: all output tokens including the new one. Returns (text to emit, stop string hit)."""
        prefix = self.decode(ids[self.prefix_offset : self.read_offset])
        full = self.decode(ids[self.prefix_offset :])
        delta = ""
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        if not self.stop:
            return delta, False
        old = len(self.text)
        self.text += delta
        scan_from = max(0, old - self.longest + 1)
        cut = min((i for i in (self.text.find(s, scan_from) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            end = max(cut, self.emitted)
            out, self.emitted = self.text[self.emitted : end], end
            return out, True
        safe = max(self.emitted, len(self.text) - self.longest + 1)
        out, self.emitted = self.text[self.emitted : safe], safe
        return out, False

    def flush(self, ids: Sequence[int]) -> str:
        """Everything not emitted yet, at the end of a sequence that did not stop on a stop string."""
        prefix = self.decode(ids[self.prefix_offset : self.read_offset])
        full = self.decode(ids[self.prefix_offset :])
        tail = full[len(prefix) :] if len(full) > len(prefix) else ""
        if not self.stop:
            return tail
        self.text += tail
        out, self.emitted = self.text[self.emitted :], len(self.text)
        return out
