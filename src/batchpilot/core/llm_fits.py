"""Whether a sequence can ever run to completion within an engine's limits: ``never_fits(config, seq)``.

A sequence is refused at admission, with a reason a client can act on, when its worst case (prompt +
``max_tokens``) passes the model's context length or needs more KV blocks than the whole pool, or when
its prompt exceeds the step's token budget with chunked prefill off. Everything else fits: alone on
the engine it always runs to the end, which is what lets the scheduler promise progress.
"""

from __future__ import annotations

from batchpilot.core.llm_config import LLMSchedulerConfig
from batchpilot.core.sequence import Sequence


def never_fits(c: LLMSchedulerConfig, seq: Sequence) -> str | None:
    """Why ``seq`` can never run to completion under ``c`` (None if it can). Pure and config-only."""
    worst = seq.num_prompt_tokens + seq.params.max_tokens
    if worst > c.max_model_len:
        return (
            f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({seq.params.max_tokens}) = {worst} "
            f"exceeds the model's context length of {c.max_model_len} tokens; shorten the prompt or "
            f"lower max_tokens"
        )
    blocks = -(-seq.max_total_tokens // c.block_size)
    if blocks > c.num_kv_blocks:
        return (
            f"prompt + max_tokens needs {blocks} KV blocks of {c.block_size} tokens but the pool has "
            f"only {c.num_kv_blocks}; lower max_tokens or raise num_kv_blocks"
        )
    if not c.enable_chunked_prefill and seq.num_prompt_tokens > c.max_num_batched_tokens:
        return (
            f"prompt ({seq.num_prompt_tokens} tokens) exceeds max_num_batched_tokens "
            f"({c.max_num_batched_tokens}) with chunked prefill off; enable it or raise the budget"
        )
    return None
