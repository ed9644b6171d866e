"""Sentence-transformers pooling: how token states become one vector, applied to hidden states.

``PoolingConfig`` names the mode(s) of a Pooling module's ``config.json`` (``modes_from``: the legacy
booleans ``pooling_mode_mean_tokens: true``... or the newer ``pooling_mode: "mean" | [...]``) and whether
the pooled vector is L2-normalised right away (a Normalize module directly after Pooling). Reading the
folder (``modules.json``, the modules after pooling, lengths, prompts) is ``models/st_modules.py``'s.
A plain HF folder gets what sentence-transformers would give it: mean pooling, no normalisation.
Several modes concatenate in sentence-transformers' fixed order.

``pool`` works on padded ``[n, T, H]`` states with either padding side: CLS is the *first real*
token and "last token" the last real one, so left-aligned batches pool the same as right-aligned.
"""

from __future__ import annotations

from dataclasses import dataclass
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
    """How token states become a sentence vector. ``modes`` are applied in order and concatenated;
    ``normalize``: L2-normalise the result (a Normalize module directly after Pooling)."""

    modes: tuple[str, ...] = ("mean",)
    normalize: bool = False

    def __post_init__(self) -> None:
        if not self.modes:
            raise ValueError("pooling: give at least one mode, e.g. ('mean',)")
        for mode in self.modes:
            if mode not in POOLING_MODES:
                raise ValueError(f"pooling: unknown mode {mode!r}; choose from {', '.join(POOLING_MODES)}")


def modes_from(cfg: dict[str, Any]) -> tuple[str, ...]:
    """The pooling modes a Pooling module's ``config.json`` names (mean when it names none)."""
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
