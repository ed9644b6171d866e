"""The model runner against HF: greedy tokens identical to ``generate()`` on each request alone.

The random model uses ``initializer_range=0.06`` (not HF's 0.02): at 0.02 a random model's top-2
logits can be 3e-4 apart, so float noise from a different batch composition flips greedy ties
(docs/llm.md, "Tests"). At 0.06 the smallest gap measured was 1.6e-3, far above packing/gather noise.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from batchpilot.core.llm.config import LLMSchedulerConfig
from batchpilot.core.llm.scheduler import LLMScheduler
from batchpilot.core.llm.sequence import SamplingParams, Sequence
from batchpilot.models.llm.dense import can_pack
from batchpilot.models.llm.runner import LLMModelRunner, RowPlan
from batchpilot.models.llm.sampler import Sampler, filter_logits
from batchpilot.models.llm.tokenizer import (
    CHAT_TEMPLATE,
    EOS_ID,
    IncrementalDetokenizer,
    build_tokenizer,
    make_decode,
)
from batchpilot.models.llm.weights import LlamaWeights, load_hf_llama
from batchpilot.models.seeded import LLMModelConfig

MAX_TOKENS = 10
LENGTHS = [5, 17, 33, 8, 41, 3]


@pytest.fixture(scope="module")
def hf() -> Any:
    # a 2-layer, 256-wide cut of the default architecture (GQA 4:2): same code paths, 10x cheaper
    cfg = LLMModelConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, initializer_range=0.06, seed=1)
    model = load_hf_llama(None, cfg)
    model.generation_config.eos_token_id = None  # our runs ignore EOS; HF must not stop on it either
    return model


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(7, 4096, (24,), generator=g).tolist()
    out = [torch.randint(7, 4096, (n,), generator=g).tolist() for n in LENGTHS]
    out += [shared + [11, 12, 13], shared + [99]]  # a common 3-block prefix (block size 8)
    return out


@pytest.fixture(scope="module")
def reference(hf: Any, prompts: list[list[int]]) -> list[list[int]]:
    refs = []
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
            refs.append(out[0, len(p):].tolist())
    return refs


def run_greedy(hf: Any, prompts: list[list[int]], late: int = 0, row_plan: RowPlan | None = None,
               packed: bool = False, **cfg: Any) -> tuple[list[list[int]], LLMScheduler]:
    """Drive scheduler + runner to completion; the last ``late`` prompts arrive after 3 steps."""
    config = LLMSchedulerConfig(block_size=8, max_model_len=2048, **cfg)
    sched = LLMScheduler(config)
    # a small bound on a decode run's keys, so a handful of sequences runs in several padded runs
    runner = LLMModelRunner(LlamaWeights.from_hf(hf), config.num_kv_blocks, config.block_size,
                            decode_run_tokens=64, packed=packed)
    runner.row_plan = row_plan or RowPlan()
    sampler = Sampler()
    seqs = [Sequence(i, p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True), arrival=i)
            for i, p in enumerate(prompts)]
    for q in seqs[: len(seqs) - late]:
        assert sched.add(q) is None
    step = 0
    while sched.has_unfinished() or step < 3:
        if step == 3:
            for q in seqs[len(seqs) - late :]:
                assert sched.add(q) is None
        plan = sched.schedule()
        logits = runner.forward(plan.chunks)
        ids = [c.seq_id for c in plan.chunks if c.sample]
        toks = sampler.choose(logits, [sched.seqs[i] for i in ids])
        sched.update(plan, dict(zip(ids, [c.token for c in toks], strict=True)))
        step += 1
    assert sched.block_manager.num_free_blocks == config.num_kv_blocks
    return [q.output_token_ids for q in seqs], sched


def test_mixed_batch_with_late_arrivals_matches_hf(hf: Any, prompts: list[list[int]],
                                                   reference: list[list[int]]) -> None:
    out, _ = run_greedy(hf, prompts, late=3, num_kv_blocks=256, max_num_batched_tokens=1024)
    assert out == reference


@pytest.mark.skipif(not can_pack(torch.device("cpu")), reason="no oneDNN packed linear here")
def test_packed_matrices_match_hf(hf: Any, prompts: list[list[int]], reference: list[list[int]]) -> None:
    # oneDNN's packed float32 kernels sum in another order than the BLAS: greedy tokens still HF's
    out, _ = run_greedy(hf, prompts, late=3, packed=True, num_kv_blocks=256, max_num_batched_tokens=64)
    assert out == reference


def test_chunked_prefill_matches_hf(hf: Any, prompts: list[list[int]], reference: list[list[int]]) -> None:
    out, sched = run_greedy(hf, prompts, num_kv_blocks=256, max_num_batched_tokens=16)
    assert out == reference


def test_padded_rows_match_hf(hf: Any, prompts: list[list[int]], reference: list[list[int]]) -> None:
    # every step's token rows padded by three (decodes, prefill chunks, preemption's recompute alike): the
    # padding rows must change no real row's tokens and leave the cache as it would be without them
    class PadAll(RowPlan):
        asked: ClassVar[list[int]] = []

        def rows(self, t: int) -> int:
            PadAll.asked.append(t)
            return super().rows(t)

    pad_all = PadAll(tuple(t + 3 if t else 0 for t in range(1025)))
    out, sched = run_greedy(hf, prompts, late=2, row_plan=pad_all, num_kv_blocks=10,
                            max_num_batched_tokens=16)
    assert sched.num_preemptions > 0
    assert len(PadAll.asked) > 10 and min(PadAll.asked) >= 1  # every step's forward asked
    assert out == reference
    # one step by hand: the padded runner ran three rows more and its logits are the exact runner's
    from batchpilot.core.llm.scheduler import ScheduledChunk

    chunks = [ScheduledChunk(0, 0, prompts[0], [0, 1, 2, 3], True, False)]
    logits = []
    for plan in (RowPlan(), pad_all):
        runner = LLMModelRunner(LlamaWeights.from_hf(hf), 8, 8)
        runner.row_plan = plan
        logits.append(runner.forward(chunks))
        assert runner.rows_run == len(prompts[0]) + (3 if plan is pad_all else 0)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


def test_forced_preemption_matches_hf(hf: Any, prompts: list[list[int]], reference: list[list[int]]) -> None:
    out, sched = run_greedy(hf, prompts, num_kv_blocks=10, max_num_batched_tokens=64)
    assert sched.num_preemptions > 0
    assert out == reference


def test_prefix_cache_hits_and_matches_hf(hf: Any, prompts: list[list[int]],
                                          reference: list[list[int]]) -> None:
    out, sched = run_greedy(hf, prompts, late=1, num_kv_blocks=256, max_num_batched_tokens=1024,
                            enable_prefix_caching=True)
    assert sched.block_manager.num_cache_hit_tokens >= 24
    assert out == reference


def test_sampler_filters_and_seeds() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0])
    assert torch.isinf(filter_logits(logits, top_k=2, top_p=1.0)).tolist() == [True, False, False, True]
    # softmax([3,2,1,0]) ~ [.64,.24,.09,.03]: top_p 0.8 keeps the first two
    assert torch.isinf(filter_logits(logits, top_k=0, top_p=0.8)).tolist() == [True, False, False, True]
    def tokens(rows: torch.Tensor, params: list[SamplingParams]) -> list[int]:
        seqs = [Sequence(i, [0], p) for i, p in enumerate(params)]
        return [c.token for c in Sampler().choose(rows, seqs)]

    params = SamplingParams(temperature=1.0, seed=5)
    rows = torch.randn(1, 50).repeat(40, 1)
    a = [tokens(rows[i : i + 1], [params])[0] for i in range(3)]
    assert len(set(a)) == 1  # same seed, same first draw
    draws = tokens(rows, [SamplingParams(temperature=1.0)] * 40)
    assert len(set(draws)) > 1  # different sequences draw differently
    greedy = tokens(rows[:2], [SamplingParams(temperature=0)] * 2)
    assert greedy == [int(rows[0].argmax())] * 2


def test_tokenizer_is_offline_deterministic_and_round_trips() -> None:
    tok = build_tokenizer(4096)
    assert len(tok) == 4096 and tok.eos_token_id == EOS_ID
    text = "Hello, wörld! def f(x): return x ** 2  # ünïcode ✓"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=True) == text
    again = build_tokenizer.__wrapped__(4096)  # train a second time, bypassing the cache
    assert again.get_vocab() == tok.get_vocab() and again(text)["input_ids"] == ids
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                   tokenize=False)
    assert chat == "<|user|>\nhi\n<|assistant|>\n" and tok.chat_template == CHAT_TEMPLATE


@pytest.mark.parametrize("stop", [(), ("end",), ("wörld, t", "zzz"), ("e",)])
def test_detokenizer_streams_exactly_the_text_before_the_first_stop(stop: tuple[str, ...]) -> None:
    tok = build_tokenizer(4096)
    text = "Hello wörld, the end is near ✓ done"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(make_decode(tok), stop)
    parts, hit = [], False
    for i in range(len(ids)):
        part, hit = detok.step(ids[: i + 1])
        parts.append(part)
        if hit:
            break
    if not hit:
        parts.append(detok.flush(ids))
    cut = min((text.find(s) for s in stop if s in text), default=len(text))
    assert "".join(parts) == text[:cut] and hit == (cut < len(text))
