"""Offline models for tests and benchmarks: seeded random weights, real layout.

``build_word_encoder`` makes a small BERT embedding model with a word-level vocabulary of its own (no
downloaded tokenizer at all: what the GPU check runs on).

``build_cross_encoder`` makes a ``BertForSequenceClassification`` with one output (a reranker's relevance
score) and ``build_classifier`` one with a label per class, both from the embedded MiniLM folder's config
(all-MiniLM-L6-v2: vocab 30522, hidden 384, 6 layers unless ``layers`` says fewer) after
``torch.manual_seed(seed)``, saved with ``save_pretrained`` next to MiniLM's tokenizer. Nothing is
downloaded; the folder loads with HF ``AutoModelForSequenceClassification`` and sentence-transformers
``CrossEncoder``. The weights are random, so scores mean nothing, but the compute is that of a real
MiniLM-sized cross-encoder (ms-marco-MiniLM-L-6-v2 has this shape).

A build writes ``seeded_build.json`` (its arguments) last, into a temporary sibling folder that is then
renamed into place: a folder holding that marker with the same arguments is complete and is returned as
is; one built with other arguments is rebuilt. A non-empty folder without the marker is never touched.

    python -m batchpilot.models.seeded {cross-encoder,classifier} OUT [--seed N] [--layers N]
                                       [--labels a,b,c] [--multi-label]
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MARKER = "seeded_build.json"
_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def build_cross_encoder(out_dir: str | os.PathLike[str], seed: int = 0, layers: int | None = None) -> str:
    """A one-output (score) cross-encoder in ``out_dir``; returns its path."""
    return _build(out_dir, {"kind": "cross-encoder", "seed": seed, "layers": layers, "labels": None,
                            "multi_label": False})


def build_classifier(out_dir: str | os.PathLike[str],
                     labels: Sequence[str] = ("negative", "neutral", "positive"), seed: int = 0,
                     multi_label: bool = False, layers: int | None = None) -> str:
    """A ``len(labels)``-way classifier (``id2label`` in label order) in ``out_dir``; returns its path."""
    labels = [str(x) for x in labels]
    if not labels or len(set(labels)) != len(labels):
        raise ValueError(f"classifier labels must be non-empty and distinct, got {labels}")
    return _build(out_dir, {"kind": "classifier", "seed": seed, "layers": layers, "labels": labels,
                            "multi_label": bool(multi_label)})


def build_word_encoder(out_dir: str | os.PathLike[str], words: int = 400, hidden: int = 128,
                       layers: int = 2, heads: int = 4, max_positions: int = 256, normalize: bool = True,
                       seed: int = 0) -> str:
    """A seeded BERT embedding model that needs no downloaded tokenizer: a word-level vocabulary
    ``w0 .. w{words-1}`` (texts are those words joined by spaces), mean pooling, optionally
    normalised, as a sentence-transformers folder. For machines with no weights at all (the GPU check)."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = out / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
                                *(f"w{i}" for i in range(words))]) + "\n")
    BertTokenizerFast(vocab=str(vocab)).save_pretrained(out)  # transformers 5 ignores vocab_file=
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=words + 5, hidden_size=hidden, num_hidden_layers=layers,
                     num_attention_heads=heads, intermediate_size=4 * hidden,
                     max_position_embeddings=max_positions)
    BertModel(cfg).eval().save_pretrained(out)
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "mean"}))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(modules))
    return str(out)


def _build(out_dir: str | os.PathLike[str], spec: dict[str, Any]) -> str:
    out = Path(out_dir)
    if spec["layers"] is not None and spec["layers"] < 1:
        raise ValueError(f"layers must be >= 1 (or None for MiniLM's 6), got {spec['layers']}")
    if _complete(out, spec):
        return str(out)
    if out.exists() and any(out.iterdir()) and not (out / MARKER).exists():
        raise ValueError(f"{out} exists and is not a seeded checkpoint; choose an empty or new folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would keep the checkpoint from other users
        _save(tmp, spec)
        if out.exists():
            shutil.rmtree(out)  # empty, or an earlier seeded build with other arguments
        try:
            os.replace(tmp, out)
        except OSError:
            if not _complete(out, spec):  # not a concurrent build of the same model
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def _complete(out: Path, spec: dict[str, Any]) -> bool:
    try:
        saved = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return bool(saved == spec and all((out / f).is_file() for f in _FILES))


def _save(out: Path, spec: dict[str, Any]) -> None:
    import torch
    from transformers import AutoConfig, AutoTokenizer, BertForSequenceClassification

    from batchpilot.models.encoder import default_model_path

    base = default_model_path()
    labels = spec["labels"] or ["LABEL_0"]
    extra: dict[str, Any] = {
        "num_labels": len(labels),
        "id2label": dict(enumerate(labels)),
        "label2id": {name: i for i, name in enumerate(labels)},
    }
    if spec["layers"] is not None:
        extra["num_hidden_layers"] = spec["layers"]
    if spec["multi_label"]:
        extra["problem_type"] = "multi_label_classification"
    elif spec["kind"] == "classifier":
        extra["problem_type"] = "single_label_classification"
    config = AutoConfig.from_pretrained(base, local_files_only=True, **extra)
    config.architectures = ["BertForSequenceClassification"]
    torch.manual_seed(spec["seed"])
    BertForSequenceClassification(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(base, local_files_only=True).save_pretrained(out)
    (out / MARKER).write_text(json.dumps(spec, indent=1) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m batchpilot.models.seeded``: the flags are ``models.cli.seeded_parser``'s."""
    from batchpilot.models.cli import seeded_parser

    parser = seeded_parser()
    args = parser.parse_args(argv)
    try:
        if args.kind == "cross-encoder":
            path = build_cross_encoder(args.out, seed=args.seed, layers=args.layers)
        else:
            labels = [x.strip() for x in args.labels.split(",") if x.strip()]
            path = build_classifier(args.out, labels=labels, seed=args.seed, multi_label=args.multi_label,
                                    layers=args.layers)
    except ValueError as exc:
        parser.error(str(exc))
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


# The default generative model: a small Llama built from a config with seeded random weights.
#
# No download: ``LlamaForCausalLM(LlamaConfig(...))`` after ``torch.manual_seed(seed)``. 6 layers x 512
# hidden, 8 query heads sharing 4 KV heads (GQA), SwiGLU 1376, vocab 4096 (the built-in tokenizer's
# size) runs on 2 CPU cores. ``initializer_range`` 0.02 is the HF default; tests that compare greedy
# tokens with HF use 0.06 because a random model at 0.02 has near-tied logits (a top-2 gap down to
# ~3e-4).

@dataclass(frozen=True)
class LLMModelConfig:
    vocab_size: int = 4096
    hidden_size: int = 512
    intermediate_size: int = 1376
    num_hidden_layers: int = 6
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    seed: int = 0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("llm model: hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("llm model: num_attention_heads must be a multiple of num_key_value_heads")
        if self.vocab_size < 300:
            raise ValueError(f"llm model: vocab_size must be >= 300 for the built-in tokenizer, got "
                             f"{self.vocab_size}")

    def to_hf(self) -> Any:
        from transformers import LlamaConfig

        from batchpilot.models.llm.tokenizer import BOS_ID, EOS_ID, PAD_ID

        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps,
            initializer_range=self.initializer_range,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
            tie_word_embeddings=False,
        )
