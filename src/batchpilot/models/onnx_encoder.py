"""The ONNX Runtime backend for embedding models: the torch executor's tokenisation, collation and
pooling, with the forward in an onnxruntime session.

    OnnxEncoderExecutor(EncoderConfig(dtype="float32" | "int8"), cache_dir)

The model is exported from its HF weights at first use (``torch.onnx.export``, dynamic batch and
sequence axes; int8: onnxruntime's dynamic quantisation of that export) and cached in ``cache_dir``
(``serve --profile p.json``: beside the profile; otherwise ``$BATCHPILOT_CACHE`` or
``~/.cache/batchpilot``), named by a digest of the weights, the torch and onnxruntime versions and
the precision, so a changed model or library exports afresh. Batches are padded (``prepare`` is the
torch executor's); there is no padding-free forward, so a deployment asking for padding ``none``
serves ``dynamic``. The session uses the executor's CPU threads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from batchpilot.models.encoder import EncoderConfig, EncoderExecutor, PreparedBatch
from batchpilot.models.pooling import pool

log = logging.getLogger("batchpilot.models")

ONNX_PRECISIONS = ("float32", "int8")


def default_cache_dir() -> Path:
    return Path(os.environ.get("BATCHPILOT_CACHE") or Path.home() / ".cache" / "batchpilot")


class OnnxEncoderExecutor(EncoderExecutor):
    """An ``EncoderExecutor`` whose ``run`` is an onnxruntime session."""

    backend = "onnx"

    def __init__(self, config: EncoderConfig | None = None, cache_dir: str | Path | None = None) -> None:
        import onnxruntime as ort

        cfg = config or EncoderConfig()
        if cfg.dtype not in ONNX_PRECISIONS:
            raise ValueError(f"the onnx backend runs {' or '.join(ONNX_PRECISIONS)}, not {cfg.dtype}; use "
                             "the torch backend for half precision")
        if cfg.device not in ("auto", "cpu"):
            raise ValueError("the onnx backend runs on CPU here (CPUExecutionProvider); use device cpu")
        # the torch model, float32 on CPU, is what is exported; the lean forward is not needed
        super().__init__(dataclasses.replace(cfg, dtype="float32", device="cpu", lean_forward=False))
        self.config = cfg
        self.onnx_path = export(self.model, self._has_token_types, Path(cache_dir or default_cache_dir()),
                                self.model_path, cfg.dtype)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.num_threads
        opts.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(self.onnx_path), opts, providers=["CPUExecutionProvider"])
        self._inputs = [i.name for i in self.session.get_inputs()]
        self.forward_impl = f"onnxruntime {ort.__version__}"

    def supports_padding_free(self) -> bool:
        return False

    def run(self, prepared: PreparedBatch) -> list[np.ndarray]:
        if prepared.staged is None:
            raise ValueError("the onnx backend runs padded batches only; use padding dynamic or bucket")
        t = prepared.staged.wait()
        feeds = {name: (t[name] if name in t else torch.zeros_like(t["input_ids"])).numpy()
                 for name in self._inputs}
        hidden = self.session.run(["last_hidden_state"], feeds)[0]
        vec = self.st.head(pool(torch.from_numpy(hidden), t["attention_mask"], self.pooling))
        arr = vec.numpy()
        if arr.shape[0] != prepared.n:
            raise RuntimeError(f"onnx session returned {arr.shape[0]} vectors for a batch of {prepared.n}")
        return list(arr)


class _Hidden(torch.nn.Module):
    """The HF model called by keyword (its positional order changes between versions), returning the
    last hidden state only."""

    def __init__(self, model: torch.nn.Module, names: list[str]) -> None:
        super().__init__()
        self.model = model
        self.names = names

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.model(**dict(zip(self.names, inputs, strict=True))).last_hidden_state
        return out


def _digest(model_path: str, dtype: str) -> str:
    import onnxruntime as ort

    h = hashlib.sha256(f"{torch.__version__}|{ort.__version__}|{dtype}".encode())
    for f in sorted(Path(model_path).glob("*.safetensors")) + sorted(Path(model_path).glob("*.bin")):
        st = f.stat()
        h.update(f"{f.name}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def export(model: torch.nn.Module, token_types: bool, cache_dir: Path, model_path: str, dtype: str) -> Path:
    """The cached ONNX file of ``model`` at ``dtype`` (exported, and for int8 quantised, if missing)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    name = Path(model_path).name
    fp32 = cache_dir / f"{name}-{_digest(model_path, 'float32')}.onnx"
    if not fp32.exists():
        log.info("onnx: exporting %s to %s", name, fp32)
        tmp = fp32.with_suffix(".tmp.onnx")
        ids = torch.ones(2, 16, dtype=torch.int64)
        args: tuple[torch.Tensor, ...] = (ids, torch.ones_like(ids))
        names = ["input_ids", "attention_mask"]
        if token_types:
            args += (torch.zeros_like(ids),)
            names.append("token_type_ids")
        axes = {n: {0: "batch", 1: "sequence"} for n in names}
        axes["last_hidden_state"] = {0: "batch", 1: "sequence"}
        with warnings.catch_warnings(), torch.inference_mode():
            warnings.simplefilter("ignore")
            torch.onnx.export(_Hidden(model, names), args, str(tmp), input_names=names,
                              output_names=["last_hidden_state"], dynamic_axes=axes, opset_version=17,
                              dynamo=False)
        tmp.replace(fp32)
    if dtype == "float32":
        return fp32
    int8 = cache_dir / f"{name}-{_digest(model_path, 'int8')}.onnx"
    if not int8.exists():
        from onnxruntime.quantization import QuantType, quantize_dynamic

        log.info("onnx: quantising %s to int8 at %s", name, int8)
        tmp = int8.with_suffix(".tmp.onnx")
        quantize_dynamic(str(fp32), str(tmp), weight_type=QuantType.QInt8)
        tmp.replace(int8)
    return int8


def load_onnx(model_path: str | None, dtype: str, cache_dir: str | Path | None = None, **config: Any) -> Any:
    return OnnxEncoderExecutor(EncoderConfig(model_path=model_path, dtype=dtype, **config), cache_dir)  # type: ignore[arg-type]
