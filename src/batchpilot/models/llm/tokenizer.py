"""An offline tokenizer for the random default model: byte-level BPE trained on Python's own docs.

No hub: the corpus is ``pydoc_data.topics`` (English documentation bundled with CPython), the trainer
is the ``tokenizers`` library, and the result is deterministic (same merges on every machine, checked
in tests). Any text round-trips because the base alphabet is the 256 bytes. A local checkpoint brings
its own tokenizer instead (``load_tokenizer(path)``).
"""

from __future__ import annotations

import functools
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

# role markers are special tokens; the assistant turn is left open for the model to complete
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
        tok.chat_template = CHAT_TEMPLATE
    return tok
