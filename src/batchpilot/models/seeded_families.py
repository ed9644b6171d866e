"""Tiny offline checkpoints of the encoder families batchpilot serves: seeded random weights, real layout,
saved as the sentence-transformers folder a user would serve.

    build_family(family, out_dir, seed=0) -> path              an embedding model
    build_family_classifier(family, out_dir, num_labels=1, seed=0) -> path   its ...ForSequenceClassification

``FAMILIES`` (what each one is modelled on):

    distilbert   DistilBertModel, MiniLM's uncased WordPiece vocabulary; mean pooling, Normalize
    mpnet        MPNetModel (relative position bias), that vocabulary behind MPNet's <s> <pad> </s> <unk>
                 (pad 1, positions from 2), mean pooling, Normalize; prompts "query: " / "passage: ",
                 the default "passage" (E5-style)
    modernbert   ModernBertModel, a byte-level BPE of its own with [CLS] ... [SEP]; one global and one
                 local (16-token window) attention layer, rotary; CLS pooling
    qwen3        Qwen3Model (Qwen3-Embedding): byte-level BPE whose post-processor appends <|endoftext|>,
                 left padding in its tokenizer config, last-token pooling, Normalize, the instruction
                 prompt for queries; sentence-transformers' max_seq_length 128 below 512 positions
    gemma3       Gemma3TextModel (EmbeddingGemma): bidirectional attention, a sliding (16) and a full
                 layer, <bos> ... <eos>, mean pooling, Dense 64 -> 128 -> 64 (2_Dense, 3_Dense), Normalize,
                 its query / document prompts

Every model has 2 layers of hidden size 64 (4 heads) and is built from its ``transformers`` config class
after ``torch.manual_seed(seed)``, at ``initializer_range`` 0.2: at the HF default (0.02) a random model
maps every text to nearly the same vector (cosines between unrelated texts above 0.99), and a parity
check at 0.99999 could then not tell a right forward from a wrong one. The BPE vocabularies (1,024
tokens) are trained on the English documentation bundled with Python (``pydoc_data.topics``), so nothing
is downloaded. ``out_dir`` must be new or empty; a build takes a second or two.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INIT_RANGE = 0.2
HIDDEN, LAYERS, HEADS, FFN = 64, 2, 4, 128
BPE_VOCAB = 1024
POSITIONS = 512


@dataclass(frozen=True)
class Family:
    """How one family's tiny checkpoint is made: its tokenizer, HF config and sentence-transformers files."""

    tokenizer: str  # "wordpiece" (MiniLM's vocabulary), "mpnet" (the same behind MPNet's specials) or "bpe"
    config: Callable[[dict[str, int]], Any]  # token ids (vocab_size, pad, bos, eos, cls, sep) -> HF config
    pooling: str
    normalize: bool = True
    specials: tuple[str, ...] = ()  # bpe: special tokens, ids 0.. in this order
    template: str = ""  # bpe: the post-processor's single-text template ($A the text)
    pair_template: str = ""
    padding_side: str = "right"
    dense: tuple[tuple[int, bool, str], ...] = ()  # (out_features, bias, activation) per Dense module
    max_seq_length: int = POSITIONS
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None


def _distilbert(ids: dict[str, int]) -> Any:
    from transformers import DistilBertConfig

    return DistilBertConfig(vocab_size=ids["vocab_size"], dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS,
                            hidden_dim=FFN, max_position_embeddings=POSITIONS, pad_token_id=ids["pad"],
                            initializer_range=INIT_RANGE)


def _mpnet(ids: dict[str, int]) -> Any:
    from transformers import MPNetConfig

    return MPNetConfig(vocab_size=ids["vocab_size"], hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                       num_attention_heads=HEADS, intermediate_size=FFN,
                       max_position_embeddings=POSITIONS + 2,
                       pad_token_id=ids["pad"], bos_token_id=ids["bos"], eos_token_id=ids["eos"],
                       initializer_range=INIT_RANGE)


def _modernbert(ids: dict[str, int]) -> Any:
    from transformers import ModernBertConfig

    return ModernBertConfig(vocab_size=ids["vocab_size"], hidden_size=HIDDEN, intermediate_size=FFN,
                            num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                            max_position_embeddings=POSITIONS, local_attention=16,
                            layer_types=["full_attention", "sliding_attention"], pad_token_id=ids["pad"],
                            bos_token_id=ids["cls"], eos_token_id=ids["sep"], cls_token_id=ids["cls"],
                            sep_token_id=ids["sep"], initializer_range=INIT_RANGE)


def _qwen3(ids: dict[str, int]) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=ids["vocab_size"], hidden_size=HIDDEN, intermediate_size=FFN,
                       num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=2,
                       head_dim=HIDDEN // HEADS, max_position_embeddings=POSITIONS, pad_token_id=ids["pad"],
                       eos_token_id=ids["eos"], bos_token_id=None, tie_word_embeddings=False,
                       initializer_range=INIT_RANGE)


def _gemma3(ids: dict[str, int]) -> Any:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(vocab_size=ids["vocab_size"], hidden_size=HIDDEN, intermediate_size=FFN,
                            num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=1,
                            head_dim=HIDDEN // HEADS, query_pre_attn_scalar=HIDDEN // HEADS,
                            max_position_embeddings=POSITIONS, sliding_window=16,
                            layer_types=["sliding_attention", "full_attention"],
                            use_bidirectional_attention=True, pad_token_id=ids["pad"],
                            eos_token_id=ids["eos"], bos_token_id=ids["bos"], initializer_range=INIT_RANGE)


QWEN3_QUERY = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
_IDENTITY = "torch.nn.modules.linear.Identity"

FAMILIES: dict[str, Family] = {
    "distilbert": Family("wordpiece", _distilbert, "mean"),
    "mpnet": Family("mpnet", _mpnet, "mean", prompts={"query": "query: ", "passage": "passage: "},
                    default_prompt_name="passage"),
    "modernbert": Family("bpe", _modernbert, "cls", normalize=False,
                         specials=("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"),
                         template="[CLS] $A [SEP]", pair_template="[CLS] $A [SEP] $B:1 [SEP]:1"),
    "qwen3": Family("bpe", _qwen3, "lasttoken", specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                    template="$A <|endoftext|>", pair_template="$A <|endoftext|> $B:1 <|endoftext|>:1",
                    padding_side="left", max_seq_length=128,
                    prompts={"query": QWEN3_QUERY, "document": ""}),
    "gemma3": Family("bpe", _gemma3, "mean", specials=("<pad>", "<eos>", "<bos>", "<unk>"),
                     template="<bos> $A <eos>", pair_template="<bos> $A <eos> $B:1 <eos>:1",
                     dense=((2 * HIDDEN, False, _IDENTITY), (HIDDEN, False, _IDENTITY)), max_seq_length=2048,
                     prompts={"query": "task: search result | query: ", "document": "title: none | text: "}),
}
# the legacy pooling config flags (what most published checkpoints carry) and the mode each names
_POOLING_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                  "pooling_mode_max_tokens": "max",
                  "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                  "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
# the token role of each BPE special token
_BPE_ROLES = {"[PAD]": "pad", "[CLS]": "cls", "[SEP]": "sep", "<|endoftext|>": "pad", "<pad>": "pad",
              "<eos>": "eos", "<bos>": "bos", "[UNK]": "unk", "<unk>": "unk", "[MASK]": "mask"}


def build_family(family: str, out_dir: str | os.PathLike[str], seed: int = 0) -> str:
    """The tiny embedding model of ``family`` as a sentence-transformers folder in ``out_dir``."""
    from transformers import AutoModel

    spec, out = _family(family), _empty_dir(out_dir)
    ids = _save_tokenizer(spec, out)
    _seeded(seed)
    model = AutoModel.from_config(spec.config(ids)).eval()
    model.save_pretrained(out)
    _save_st_files(spec, out, int(model.config.hidden_size), seed)
    return str(out)


def build_family_classifier(family: str, out_dir: str | os.PathLike[str], num_labels: int = 1,
                            seed: int = 0) -> str:
    """The tiny ``...ForSequenceClassification`` of ``family`` (one label: a cross-encoder) in ``out_dir``."""
    from transformers import AutoModelForSequenceClassification

    if num_labels < 1:
        raise ValueError(f"num_labels must be >= 1, got {num_labels}")
    spec, out = _family(family), _empty_dir(out_dir)
    ids = _save_tokenizer(spec, out)
    config = spec.config(ids)
    config.num_labels = num_labels
    config.id2label = {i: f"LABEL_{i}" for i in range(num_labels)}
    config.label2id = {v: k for k, v in config.id2label.items()}
    _seeded(seed)
    AutoModelForSequenceClassification.from_config(config).eval().save_pretrained(out)
    return str(out)


def _family(family: str) -> Family:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    return FAMILIES[family]


def _empty_dir(out_dir: str | os.PathLike[str]) -> Path:
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty; build into a new or empty folder")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _seeded(seed: int) -> None:
    import torch

    torch.manual_seed(seed)


def _save_tokenizer(spec: Family, out: Path) -> dict[str, int]:
    """Save the family's tokenizer into ``out``; its vocabulary size and special token ids."""
    if spec.tokenizer == "bpe":
        tok = _bpe_tokenizer(spec)
    else:
        tok = _wordpiece_tokenizer(spec.tokenizer)
    tok.save_pretrained(out)
    ids = {"vocab_size": len(tok)}
    for role in ("pad", "bos", "eos", "cls", "sep"):
        value = getattr(tok, f"{role}_token_id", None)
        if value is not None:
            ids[role] = int(value)
    return ids


def _wordpiece_tokenizer(kind: str) -> Any:
    """MiniLM's uncased WordPiece vocabulary as DistilBERT's tokenizer, or behind MPNet's four specials
    (<s> <pad> </s> <unk>, ids 0-3) with <mask> last, as MPNet's vocabulary is laid out."""
    from transformers import DistilBertTokenizerFast, MPNetTokenizerFast

    from batchpilot.models.encoder import default_model_path

    words = (Path(default_model_path()) / "vocab.txt").read_text(encoding="utf-8").splitlines()
    if kind == "wordpiece":
        return DistilBertTokenizerFast(vocab={w: i for i, w in enumerate(words)})
    vocab = ["<s>", "<pad>", "</s>", "<unk>", *words, "<mask>"]
    return MPNetTokenizerFast(vocab={w: i for i, w in enumerate(vocab)})


def _bpe_tokenizer(spec: Family) -> Any:
    """A byte-level BPE of ``BPE_VOCAB`` tokens trained on Python's bundled documentation, the family's
    special tokens first and its template as the post-processor (what its real tokenizer adds)."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, special_tokens=list(spec.specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([topics[k] for k in sorted(topics)], trainer)
    used = [s for s in spec.specials if s in spec.template + spec.pair_template]
    tok.post_processor = processors.TemplateProcessing(
        single=spec.template, pair=spec.pair_template,
        special_tokens=[(s, tok.token_to_id(s)) for s in used])
    roles = {f"{_BPE_ROLES[s]}_token": s for s in spec.specials if s in _BPE_ROLES}
    if "<|endoftext|>" in spec.specials:  # Qwen: one token ends a text and pads
        roles["eos_token"] = "<|endoftext|>"
    return PreTrainedTokenizerFast(tokenizer_object=tok, padding_side=spec.padding_side,
                                   model_max_length=POSITIONS, **roles)


def _save_st_files(spec: Family, out: Path, hidden: int, seed: int) -> None:
    """modules.json, the Pooling config, Dense folders, sentence_bert_config.json and
    config_sentence_transformers.json: what ``SentenceTransformer.save`` writes for this pipeline."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]

    def add(kind: str, folder: str) -> Path:
        idx = len(modules)
        modules.append({"idx": idx, "name": str(idx), "path": f"{idx}_{folder}",
                        "type": f"sentence_transformers.models.{kind}"})
        path = out / f"{idx}_{folder}"
        path.mkdir()
        return path

    flags = {flag: spec.pooling == mode for flag, mode in _POOLING_FLAGS.items()}
    _write(add("Pooling", "Pooling") / "config.json",
           {"word_embedding_dimension": hidden, **flags, "include_prompt": True})
    width = hidden
    for i, (out_features, bias, activation) in enumerate(spec.dense):
        _save_dense(add("Dense", "Dense"), width, out_features, bias, activation, seed + 1 + i)
        width = out_features
    if spec.normalize:
        add("Normalize", "Normalize")
    _write(out / "modules.json", modules)
    _write(out / "sentence_bert_config.json", {"max_seq_length": spec.max_seq_length, "do_lower_case": False})
    _write(out / "config_sentence_transformers.json",
           {"model_type": "SentenceTransformer", "prompts": spec.prompts,
            "default_prompt_name": spec.default_prompt_name, "similarity_fn_name": "cosine"})


def _save_dense(path: Path, in_features: int, out_features: int, bias: bool, activation: str,
                seed: int) -> None:
    """One sentence-transformers ``Dense`` module: its config and ``linear.*`` weights (safetensors)."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    bound = 1.0 / in_features ** 0.5  # nn.Linear's own init range
    weights = {"linear.weight": (torch.rand(out_features, in_features, generator=gen) * 2 - 1) * bound}
    if bias:
        weights["linear.bias"] = (torch.rand(out_features, generator=gen) * 2 - 1) * bound
    save_file(weights, str(path / "model.safetensors"))
    _write(path / "config.json", {"in_features": in_features, "out_features": out_features, "bias": bias,
                                  "activation_function": activation})


def _write(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
