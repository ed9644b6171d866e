"""What a checkpoint is, and the executor that serves it.

    detect_task(path) -> "embed" | "score" | "classify"
    load_model(path, name, task, max_length, num_threads) -> an executor with ``.task``

From the folder's ``config.json``: an architecture ending in ``ForSequenceClassification`` is a
cross-encoder (``score``: one output, served by /v1/rerank and /v1/score) or a classifier
(``classify``: one output per label, /v1/classify); anything else (a sentence-transformers folder, a
bare ``BertModel``...) is an embedding model (``embed``, /v1/embeddings). ``task`` overrides the
detection where the checkpoint allows it: a classification checkpoint can be served as ``embed`` (its
encoder, pooled as its folder says) and a one-output model as ``classify``; ``score`` needs exactly
one output, and ``score`` / ``classify`` need a classification head.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TASKS = ("embed", "score", "classify")


def _config(path: str | None) -> dict[str, Any]:
    if path is None:
        return {}
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        raise ValueError(f"{path} has no config.json: give a local Hugging Face model folder")
    data = json.loads(cfg.read_text())
    return data if isinstance(data, dict) else {}


def num_outputs(cfg: dict[str, Any]) -> int:
    labels = cfg.get("id2label")
    return int(cfg.get("num_labels") or (len(labels) if isinstance(labels, dict) else 2))


def is_classifier(cfg: dict[str, Any]) -> bool:
    return any(str(a).endswith("ForSequenceClassification") for a in cfg.get("architectures") or ())


def detect_task(path: str | None) -> str:
    """The task the checkpoint at ``path`` was made for (None: the embedded embedding model)."""
    cfg = _config(path)
    if not is_classifier(cfg):
        return "embed"
    return "score" if num_outputs(cfg) == 1 else "classify"


def resolve_task(path: str | None, task: str = "auto") -> str:
    """``task`` checked against the checkpoint (``auto``: detected); a clear ValueError when the
    checkpoint cannot serve it."""
    detected = detect_task(path)
    if task == "auto":
        return detected
    if task not in TASKS:
        raise ValueError(f"task = {task!r}; choose auto or one of {', '.join(TASKS)}")
    cfg = _config(path)
    if task in ("score", "classify") and not is_classifier(cfg):
        raise ValueError(f"{path or 'the embedded model'} has no classification head "
                         f"(architectures: {cfg.get('architectures')}); it can only be served as embed")
    if task == "score" and num_outputs(cfg) != 1:
        raise ValueError(f"{path} has {num_outputs(cfg)} outputs; score (rerank) needs a one-output "
                         "cross-encoder: serve it as classify")
    return task


def load_model(path: str | None, name: str | None = None, task: str = "auto",
               max_length: int | None = None, num_threads: int | None = None, dtype: str = "float32",
               min_cosine: float = 0.999, backend: str = "torch", cache_dir: str | None = None,
               thread_plan: Any = None) -> Any:
    """The executor for the checkpoint at ``path`` serving ``task`` (see ``resolve_task``). An
    embedding model runs at ``dtype`` as ``models.precision.choose_precision`` decides (``auto``:
    measured here, under the accuracy guard) on ``backend`` (torch, or onnx: ``models/onnx_encoder``,
    its export cached in ``cache_dir``); the report is the executor's ``precision``. Its intra-op
    threads per batch are ``models.encoder.plan_for``'s: ``num_threads`` fixed, else ``thread_plan`` (a
    profile's), else measured here. Cross-encoders
    and classifiers run float32 on torch."""
    task = resolve_task(path, task)
    if task == "embed":
        from batchpilot.models.device import resolve_device
        from batchpilot.models.encoder import EncoderConfig, EncoderExecutor, plan_for
        from batchpilot.models.precision import choose_precision

        def load(d: str) -> Any:
            cfg = EncoderConfig(model_path=path, model_name=name, max_length=max_length,
                                num_threads=num_threads, dtype=d)  # type: ignore[arg-type]
            if backend == "onnx":
                from batchpilot.models.onnx_encoder import OnnxEncoderExecutor

                return OnnxEncoderExecutor(cfg, cache_dir)
            return EncoderExecutor(cfg)

        device = resolve_device("cpu" if backend == "onnx" else "auto")
        executor, report = choose_precision(load, dtype, device, min_cosine, backend)
        executor.precision = report
        executor.threads = plan_for(executor, num_threads, thread_plan)
        return executor
    from batchpilot.models.cross_encoder import ClassifierConfig, SequenceClassifierExecutor

    assert path is not None
    if backend != "torch":
        raise ValueError(f"{task} models run on the torch backend; --backend {backend} serves embeddings")
    executor = SequenceClassifierExecutor(ClassifierConfig(model_path=path, model_name=name,
                                                           max_length=max_length, num_threads=num_threads))
    executor.task = task
    return executor
