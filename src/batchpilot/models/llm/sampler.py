"""Token choice per sequence: greedy, temperature, top-k, top-p, with a per-request seed.

Greedy rows are one vectorised ``argmax``. Sampled rows each use their own ``torch.Generator``
seeded from the request's ``seed`` (or from ``base_seed`` and the sequence id), so a request's
samples do not depend on which other requests shared its batches.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchpilot.core.llm.sequence import SamplingParams


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) everything outside the top-k and the top-p nucleus of a 1-D logit row."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked before it already cover top_p (the first always stays)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


class Sampler:
    def __init__(self, base_seed: int = 0) -> None:
        self.base_seed = base_seed
        self._generators: dict[int, torch.Generator] = {}

    def _generator(self, seq_id: int, params: SamplingParams) -> torch.Generator:
        g = self._generators.get(seq_id)
        if g is None:
            seed = params.seed if params.seed is not None else self.base_seed * 1_000_003 + seq_id
            g = torch.Generator().manual_seed(seed)
            self._generators[seq_id] = g
        return g

    def forget(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)

    def sample(
        self, logits: torch.Tensor, seq_ids: Sequence[int], params: Sequence[SamplingParams]
    ) -> list[int]:
        """One token per row of ``logits [N, vocab]``."""
        if logits.shape[0] == 0:
            return []
        out = logits.argmax(dim=-1).tolist()
        for i, (sid, p) in enumerate(zip(seq_ids, params, strict=True)):
            if p.is_greedy:
                continue
            row = filter_logits(logits[i].float().cpu() / p.temperature, p.top_k, p.top_p)
            probs = torch.softmax(row, dim=-1)
            out[i] = int(torch.multinomial(probs, 1, generator=self._generator(sid, p)).item())
        return [int(t) for t in out]
