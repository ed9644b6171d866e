"""Which forward an ``EncoderExecutor`` runs, and the padding-free one: a mixin of the executor.

The lean forward (``models/ragged.py``'s ``RaggedEncoder``, else ``models/lean.py``'s ``LeanEncoder``)
copies the HF weights into plain tensors and skips HF's per-call overhead. It is kept only when it
matches HF's own forward on a seeded mixed-length probe batch, collated as ``prepare`` would collate
it; otherwise the executor warns and runs HF. The padding-free path (padding "none") needs the ragged
encoder: the lean one when it is ragged (one weight copy serves both forwards), else one built for it.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch

from batchpilot.models.pooling import PoolingConfig, pool


class ForwardChoice:
    """The forward-choice half of ``EncoderExecutor``; the executor provides the attributes below."""

    model: Any
    model_name: str
    pooling: PoolingConfig
    config: Any
    vocab_size: int
    lean: Any
    _ragged: Any
    _lean_takes_positions: bool
    _h2d: Any

    def _collate(self, ids: list[list[int]], width: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _hidden(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

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
            warnings.warn(f"lean forward unavailable for {self.model_name} ({exc}); using HF", stacklevel=2)
            return None
        if lean is None:
            try:
                from batchpilot.models.lean import LeanEncoder

                lean = LeanEncoder.from_hf(self.model, **kwargs)
            except (ImportError, ValueError, AttributeError) as exc:
                warnings.warn(f"lean forward unavailable for {self.model_name} ({exc}); using HF",
                              stacklevel=2)
                return None
        self._lean_takes_positions = "position_ids" in inspect.signature(lean.hidden_padded).parameters
        diff = self._probe(lean)
        tol = 1e-4 if self.config.dtype == "float32" else 5e-2
        if diff > tol:
            warnings.warn(f"lean forward differs from HF by {diff:.2e} on {self.model_name}; using HF",
                          stacklevel=2)
            return None
        return lean

    def _probe(self, lean: Any) -> float:
        """Max |difference| of the real tokens' last hidden states, lean vs HF, on a seeded mixed batch
        collated exactly as ``prepare`` would (so left padding is probed with its position ids)."""
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
        return float((ref[m].float() - got[m].float()).abs().max())

    def _simple_pooling(self) -> str | None:
        """The pooling the lean/ragged encoders do themselves (one of mean/cls), else None."""
        modes = self.pooling.modes
        return modes[0] if len(modes) == 1 and modes[0] in ("mean", "cls") else None

    def supports_padding_free(self) -> bool:
        """Whether padding 'none' can run on this model (BERT-family layouts and mean/CLS pooling do)."""
        try:
            self._ragged_encoder()
        except (RuntimeError, ValueError, NotImplementedError, AttributeError, KeyError):
            return False
        return True

    def _ragged_encoder(self) -> Any:
        if self.config.dtype == "int8":
            raise RuntimeError("padding 'none' needs the padding-free torch forward, which int8 (quantised "
                               "HF linear layers) does not have; use padding 'dynamic' or 'bucket'")
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
