"""Sentence-transformers pooling and normalisation, read from a model folder and applied to hidden states.

A sentence-transformers folder says how token states become one vector:

* ``modules.json`` lists the pipeline (Transformer -> Pooling -> optional Normalize);
* ``<pooling dir>/config.json`` names the pooling mode(s), either the legacy booleans
  (``pooling_mode_mean_tokens: true``...) or the newer ``pooling_mode: "mean" | [...]``;
* ``sentence_bert_config.json`` holds ``max_seq_length`` and ``do_lower_case`` for the Transformer.

A plain HF folder without these files gets what sentence-transformers would give it: mean pooling,
no normalisation. Several modes concatenate in sentence-transformers' fixed order.

``pool`` works on padded ``[n, T, H]`` states with either padding side: CLS is the *first real*
token and "last token" the last real one, so left-aligned batches pool the same as right-aligned.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Concatenation order used by sentence-transformers' Pooling.forward (and its legacy flag names).
POOLING_MODES: tuple[str, ...] = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
_LEGACY_FLAGS: dict[str, str] = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}

# older configs spell the modes the long way in "pooling_mode" too
_LONG_NAMES: dict[str, str] = {"cls_token": "cls", "max_tokens": "max", "mean_tokens": "mean",
                               "weightedmean_tokens": "weightedmean"}


@dataclass(frozen=True)
class PoolingConfig:
    """How token states become a sentence vector. ``modes`` are applied in order and concatenated."""

    modes: tuple[str, ...] = ("mean",)
    normalize: bool = False
    st_max_seq_length: int | None = None  # what sentence-transformers would truncate to (informational)
    do_lower_case: bool = False

    def __post_init__(self) -> None:
        if not self.modes:
            raise ValueError("pooling: give at least one mode, e.g. ('mean',)")
        for mode in self.modes:
            if mode not in POOLING_MODES:
                raise ValueError(f"pooling: unknown mode {mode!r}; choose from {', '.join(POOLING_MODES)}")

    @classmethod
    def from_model_dir(cls, path: str | Path) -> PoolingConfig:
        """Read pooling, normalisation and tokenizer casing from a (sentence-transformers) model folder."""
        root = Path(path)
        modules = _read_json(root / "modules.json")
        pooling_dir: Path | None = None
        normalize = False
        if isinstance(modules, list):
            for module in modules:
                kind = str(module.get("type", ""))
                if kind.endswith(".Pooling"):
                    pooling_dir = root / str(module.get("path", ""))
                elif kind.endswith(".Normalize"):
                    normalize = True
                elif not kind.endswith(".Transformer"):
                    # a Dense or other head we do not run would silently change the vectors: refuse
                    raise ValueError(f"{root}: sentence-transformers module {kind!r} is not supported "
                                     "(only Transformer, Pooling, Normalize); serve a model without it")
        elif (root / "1_Pooling" / "config.json").exists():
            pooling_dir = root / "1_Pooling"
        modes: tuple[str, ...] = ("mean",)
        if pooling_dir is not None:
            modes = _modes_from(_read_json(pooling_dir / "config.json") or {})
        st_cfg = _read_json(root / "sentence_bert_config.json") or {}
        max_seq = st_cfg.get("max_seq_length")
        return cls(
            modes=modes,
            normalize=normalize,
            st_max_seq_length=int(max_seq) if max_seq else None,
            do_lower_case=bool(st_cfg.get("do_lower_case", False)),
        )


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def _modes_from(cfg: dict[str, Any]) -> tuple[str, ...]:
    if "pooling_mode" in cfg:
        value = cfg["pooling_mode"]
        modes = (value,) if isinstance(value, str) else tuple(value)
        return tuple(_LONG_NAMES.get(m, m) for m in modes)
    flagged = tuple(mode for flag, mode in _LEGACY_FLAGS.items() if cfg.get(flag, False))
    return flagged or ("mean",)


def pool(hidden: torch.Tensor, mask: torch.Tensor, config: PoolingConfig) -> torch.Tensor:
    """Pool ``hidden [n, T, H]`` under ``mask [n, T]`` (1 = real token) into ``[n, H * len(modes)]``.

    Accumulates in float32 (half-precision sums over 512 tokens lose digits), then normalises if asked.
    """
    states = hidden.float()
    m = mask.to(states.dtype).unsqueeze(-1)
    n, t, h = states.shape
    out: list[torch.Tensor] = []
    mean_sum: torch.Tensor | None = None
    count: torch.Tensor | None = None
    for mode in config.modes:
        if mode == "cls":
            first = mask.to(torch.int32).argmax(dim=1)  # first real token, whatever the padding side
            out.append(states[torch.arange(n, device=states.device), first])
        elif mode == "lasttoken":
            last = t - 1 - mask.flip(1).to(torch.int32).argmax(dim=1)
            out.append(states[torch.arange(n, device=states.device), last])
        elif mode == "max":
            out.append(states.masked_fill(m == 0, float("-inf")).max(dim=1).values)
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            if mean_sum is None:
                mean_sum = (states * m).sum(dim=1)
                count = m.sum(dim=1).clamp(min=1e-9)
            assert count is not None
            out.append(mean_sum / (count if mode == "mean" else count.sqrt()))
        elif mode == "weightedmean":
            # weights 1..L counted from the first real token (sentence-transformers' convention)
            offset = mask.to(torch.int32).argmax(dim=1).view(-1, 1, 1).to(states.dtype)
            pos = torch.arange(1, t + 1, device=states.device, dtype=states.dtype).view(1, -1, 1) - offset
            w = m * pos
            out.append((states * w).sum(dim=1) / w.sum(dim=1).clamp(min=1e-9))
    vec = out[0] if len(out) == 1 else torch.cat(out, dim=-1)
    if config.normalize:
        vec = torch.nn.functional.normalize(vec, p=2.0, dim=-1)
    return vec
