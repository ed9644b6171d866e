"""Greedy decoding two ways, for the runner's parity tests: HF ``generate`` on each prompt alone, and
the engine's scheduler and runner over all the prompts at once (greedy is the logits' argmax: the
sampler's other rules are its own tests')."""

from __future__ import annotations

from typing import Any

import torch

from batchpilot.core.llm.scheduler import LLMScheduler
from batchpilot.core.llm.sequence import SamplingParams, Sequence
from batchpilot.models.llm.runner import LLMModelRunner


def hf_greedy(hf: Any, prompts: list[list[int]], max_tokens: int, device: str = "cpu") -> list[list[int]]:
    """Each prompt's ``max_tokens`` greedy tokens from HF ``generate``, one prompt at a time."""
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                              do_sample=False, pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    return out


def engine_greedy(sched: LLMScheduler, runner: LLMModelRunner, prompts: list[list[int]],
                  max_tokens: int) -> list[list[int]]:
    """Every prompt added at once, ``sched`` and ``runner`` stepped to completion; each one's tokens."""
    seqs = [Sequence(i, p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), arrival=i)
            for i, p in enumerate(prompts)]
    for q in seqs:
        assert sched.add(q) is None
    while sched.has_unfinished():
        plan = sched.schedule()
        logits = runner.forward(plan.chunks)
        ids = [c.seq_id for c in plan.chunks if c.sample]
        sched.update(plan, dict(zip(ids, logits.argmax(-1).tolist(), strict=True)))
    return [q.output_token_ids for q in seqs]
