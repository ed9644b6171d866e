"""Each decoder family the LLM runner serves: greedy parity with HF, throughput against HF static batches.

Each family's tiny seeded checkpoint (``models/llm/seeded_families.py``: 2 layers, hidden 256, vocab 4096,
float32, a window of 16 positions where the family has one), saved and loaded from its folder as a user's.

* ``parity``: 8 prompts of 3 to 41 tokens, 32 greedy steps each, against HF ``generate`` on each prompt
  alone; batchpilot's scheduler and runner on each prompt alone, and on the 8 inside a crowd of 16
  streams (the others share their first 16 tokens) with a token budget of 32 (chunked prefill) and
  prefix caching on. Counted: greedy steps equal up to each prompt's first difference.
* ``throughput``: a conv-llm slice (``--num-requests`` rows: prompt and output lengths from the trace,
  outputs clipped to ``--max-output`` and prompts to the positions left, prompts seeded random ids, EOS
  ignored, all at t=0), batchpilot's
  engine (``benchmarks/llm_throughput.run_batchpilot``: max_num_batched_tokens 512, 64 sequences, 2048
  blocks of 16) against HF ``generate`` on fixed batches of 16 (``run_hf_static``), on the same requests;
  ``--rounds`` rounds, the two taking turns (the order flipped each round); output tok/s median (min-max)
  and the ratio per round.

    .venv/bin/python benchmarks/decoder_families.py [--part all] [--rounds 3] [--families llama qwen2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark's runs
from llm_throughput import make_requests, run_batchpilot, run_hf_static, warmup_requests  # noqa: E402

from batchpilot.core.llm.config import LLMSchedulerConfig  # noqa: E402
from batchpilot.core.llm.scheduler import LLMScheduler  # noqa: E402
from batchpilot.core.llm.sequence import SamplingParams, Sequence  # noqa: E402
from batchpilot.models.llm.runner import LLMModelRunner  # noqa: E402
from batchpilot.models.llm.seeded_families import build  # noqa: E402
from batchpilot.models.llm.weights import FAMILIES, LlamaWeights, load_hf_llama  # noqa: E402

STEPS, PROMPTS, CROWD = 32, 8, 16
LENGTHS = (5, 17, 33, 8, 41, 3, 24, 12, 29, 6, 19, 37, 10, 26, 15, 44)


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(7, 4096, (m,), generator=g).tolist() for m in LENGTHS[:n]]


def hf_greedy(hf: Any, ps: list[list[int]]) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for p in ps:
            ids = torch.tensor([p])
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS, do_sample=False,
                              pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    return out


def runner_greedy(weights: LlamaWeights, ps: list[list[int]], **cfg: Any) -> list[list[int]]:
    config = LLMSchedulerConfig(block_size=8, max_model_len=512, **cfg)
    runner = LLMModelRunner(weights, config.num_kv_blocks, config.block_size, decode_run_tokens=64)
    sched = LLMScheduler(config)
    seqs = [Sequence(i, p, SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True), arrival=i)
            for i, p in enumerate(ps)]
    for q in seqs:
        sched.add(q)
    while sched.has_unfinished():
        plan = sched.schedule()
        logits = runner.forward(plan.chunks)
        ids = [c.seq_id for c in plan.chunks if c.sample]
        sched.update(plan, dict(zip(ids, logits.argmax(-1).tolist(), strict=True)))
    return [q.output_token_ids for q in seqs]


def equal_steps(got: list[list[int]], want: list[list[int]]) -> int:
    return sum(next((i for i, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), len(w))
               for g, w in zip(got, want, strict=True))


def loaded(model_type: str) -> tuple[Any, LlamaWeights]:
    """The seeded HF model and the runner's weights loaded from its saved folder."""
    hf = build(model_type)
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        return hf, LlamaWeights.from_hf(load_hf_llama(folder))


def run_parity(families: list[str]) -> None:
    print(f"| family | greedy steps equal to HF `generate`, alone | in a crowd of {CROWD} |\n|---|---|---|")
    for model_type in families:
        hf, weights = loaded(model_type)
        ps = prompts(PROMPTS, 3)
        want = hf_greedy(hf, ps)
        alone = [runner_greedy(weights, [p])[0] for p in ps]
        others = [p[:16] + o for p, o in zip(ps, prompts(CROWD - PROMPTS, 4), strict=False)]
        crowd = runner_greedy(weights, others + ps, max_num_batched_tokens=32, enable_prefix_caching=True)
        total = PROMPTS * STEPS
        print(f"| {model_type} | {equal_steps(alone, want)}/{total} | "
              f"{equal_steps(crowd[len(others):], want)}/{total} |", flush=True)


def run_throughput(families: list[str], args: argparse.Namespace) -> None:
    print("| family | batchpilot tok/s | HF static tok/s | ratio per round |\n|---|---|---|---|")
    for model_type in families:
        hf, _ = loaded(model_type)
        text = hf.config.get_text_config()
        hf.config.vocab_size = text.vocab_size  # what run_batchpilot's tokenizer is built for
        room = int(text.max_position_embeddings) - args.max_output  # the tiny models' 512 positions
        prompts_, outs = make_requests(args.num_requests, args.start, args.seed, 4096)
        reqs = ([p[:room] for p in prompts_], [min(n, args.max_output) for n in outs])
        warm_prompts, warm_outs = warmup_requests(args.seed, 4096)
        warm = ([p[:room] for p in warm_prompts], warm_outs)
        tok: dict[str, list[float]] = {"batchpilot": [], "HF static": []}
        for r in range(args.rounds):
            for name in ("batchpilot", "HF static") if r % 2 == 0 else ("HF static", "batchpilot"):
                row = (run_batchpilot(hf, reqs, warm, 512, args) if name == "batchpilot"
                       else run_hf_static(hf, reqs, warm, 16))
                if not row["tokens_ok"]:
                    raise RuntimeError(f"{model_type} {name}: {row['produced']} tokens, not as asked")
                tok[name].append(row["tok_s"])
        ratios = [a / b for a, b in zip(tok["batchpilot"], tok["HF static"], strict=True)]
        cell = {k: f"{statistics.median(v):.0f} ({min(v):.0f}-{max(v):.0f})" for k, v in tok.items()}
        print(f"| {model_type} | {cell['batchpilot']} | {cell['HF static']} | "
              f"{', '.join(f'{x:.2f}' for x in ratios)} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("parity", "throughput", "all"), default="all")
    ap.add_argument("--families", nargs="+", default=sorted(FAMILIES), choices=sorted(FAMILIES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-output", type=int, default=64)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    args = ap.parse_args()
    args.max_num_seqs, args.kv_blocks = 64, 2048  # what run_batchpilot reads
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.part in ("parity", "all"):
        run_parity(args.families)
    if args.part in ("throughput", "all"):
        run_throughput(args.families, args)


if __name__ == "__main__":
    main()
