"""Token choice per sequence: from a step's logits to each sampling sequence's token (and its logprobs).

    Sampler(base_seed, constraints=None)
        .choose(logits, seqs)    -> one ``Choice`` per row: the token, and its logprobs when asked
        .forget(seq_id)          a sequence is done: drop its generator and matcher

What happens to a row, in this order (each only where the row's ``SamplingParams`` asks for it; rows that
ask for nothing are one vectorised ``argmax``):

1. logprobs, of the model's own distribution: ``log_softmax`` of the raw logits (what HF's scores give),
   the chosen token's and the ``logprobs`` most likely alternatives';
2. the structured-output mask (tokens the grammar does not allow next go to -inf);
3. ``logit_bias`` added; EOS and ``stop_token_ids`` to -inf while fewer than ``min_tokens`` are out;
4. ``repetition_penalty`` over the prompt and output tokens (HF's rule: a positive logit divided by it,
   a negative one multiplied), then ``frequency_penalty`` x count and ``presence_penalty`` for each
   token already in the output (OpenAI's rule);
5. greedy ``argmax``, or temperature, top-k, top-p and a draw from the row's own ``torch.Generator``,
   seeded from the request's ``seed`` (or from ``base_seed`` and the sequence id), so a request's
   samples do not depend on which other requests shared its batches.

The chosen token then advances the row's grammar matcher.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from batchpilot.core.llm.sequence import SamplingParams, Sequence
from batchpilot.models.llm.grammar import Constraints, grammars_for

TopLogprobs = tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class Choice:
    """One row's token; ``logprob`` and ``top`` (the most likely ids and their logprobs, best first) only
    when its params ask for logprobs."""

    token: int
    logprob: float | None = None
    top: TopLogprobs = ()


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


def penalise(row: torch.Tensor, seq: Sequence, eos_ids: Seq[int]) -> None:
    """Steps 3 and 4 of the module docstring on one float32 logit row, in place."""
    p = seq.params
    if p.logit_bias:
        ids = torch.tensor([i for i, _ in p.logit_bias])
        row.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], dtype=row.dtype))
    if seq.num_output_tokens < p.min_tokens:
        held = [t for t in (*([] if p.ignore_eos else eos_ids), *p.stop_token_ids) if t < row.shape[0]]
        if held:
            row[held] = float("-inf")
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.prompt_token_ids) | set(seq.output_token_ids)))
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.output_token_ids:
        counts = torch.bincount(torch.tensor(seq.output_token_ids), minlength=row.shape[0])[: row.shape[0]]
        row -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty * (counts > 0).to(row.dtype)


class Sampler:
    def __init__(self, base_seed: int = 0, constraints: Constraints | None = None,
                 eos_ids: Seq[int] = ()) -> None:
        self.base_seed = base_seed
        self.constraints = constraints
        self.eos_ids = tuple(eos_ids)
        self._generators: dict[int, torch.Generator] = {}

    def bind(self, tokenizer: Any, vocab_size: int, eos_ids: Seq[int]) -> None:
        """Serve a model: its EOS ids (held back under ``min_tokens``) and its tokenizer's grammars."""
        self.eos_ids = tuple(eos_ids)
        if self.constraints is None:
            self.constraints = Constraints(lambda: grammars_for(tokenizer, vocab_size, self.eos_ids))

    def _generator(self, seq_id: int, params: SamplingParams) -> torch.Generator:
        g = self._generators.get(seq_id)
        if g is None:
            seed = params.seed if params.seed is not None else self.base_seed * 1_000_003 + seq_id
            g = torch.Generator().manual_seed(seed)
            self._generators[seq_id] = g
        return g

    def forget(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)
        if self.constraints is not None:
            self.constraints.forget(seq_id)

    def choose(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> list[Choice]:
        """One choice per row of ``logits [N, vocab]``, row i for ``seqs[i]``."""
        if logits.shape[0] == 0:
            return []
        logprobs = self._logprobs(logits, seqs)
        scores = self._processed(logits, seqs)
        tokens = scores.argmax(dim=-1).tolist()
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.is_greedy:
                continue
            row = filter_logits(scores[i].float().cpu() / p.temperature, p.top_k, p.top_p)
            probs = torch.softmax(row, dim=-1)
            tokens[i] = int(torch.multinomial(probs, 1, generator=self._generator(seq.seq_id, p)).item())
        out = []
        for i, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            if self.constraints is not None and seq.params.structured is not None:
                self.constraints.accept(seq, int(token))
            lp = logprobs.get(i)
            out.append(Choice(int(token)) if lp is None else
                       Choice(int(token), float(lp[0][int(token)]), lp[1]))
        return out

    def _logprobs(self, logits: torch.Tensor, seqs: Seq[Sequence]
                  ) -> dict[int, tuple[torch.Tensor, TopLogprobs]]:
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if not rows:
            return {}
        lp = torch.log_softmax(logits[rows].float(), dim=-1).cpu()
        out: dict[int, tuple[torch.Tensor, TopLogprobs]] = {}
        for j, i in enumerate(rows):
            k = int(seqs[i].params.logprobs or 0)
            top: TopLogprobs = ()
            if k:
                vals, ids = torch.topk(lp[j], k)
                top = tuple(zip(ids.tolist(), vals.tolist(), strict=True))
            out[i] = (lp[j], top)
        return out

    def _processed(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
        """The logits after steps 2-4; the given tensor itself when no row asks for any of them."""
        masks = self.constraints.masks(seqs) if self.constraints is not None else None
        touched = [i for i, s in enumerate(seqs) if s.params.penalised or s.params.logit_bias]
        if masks is None and not touched:
            return logits
        scores = logits.float().clone()
        if masks is not None:
            bitmask, rows = masks
            self.constraints.grammars.xgr.apply_token_bitmask_inplace(scores, bitmask, indices=rows)  # type: ignore[union-attr]
        for i in touched:
            penalise(scores[i], seqs[i], self.eos_ids)
        return scores
