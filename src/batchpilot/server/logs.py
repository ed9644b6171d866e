"""Logging setup for ``batchpilot serve``: human-readable text, or one JSON object per line.

JSON lines (``--log-format json``) are what log shippers (Loki, Elasticsearch, CloudWatch) parse
without regexes: ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``message``, and ``exc_info`` (the
formatted traceback) when there is one. Tracebacks go to the log, never into HTTP responses.
uvicorn's own loggers are routed through the same handler so the whole process speaks one format.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import sys
from typing import Any

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_UVICORN = ("uvicorn", "uvicorn.error", "uvicorn.access")


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": _dt.datetime.fromtimestamp(record.created, _dt.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure(level: str = "info", fmt: str = "text") -> None:
    """Route the root logger (and uvicorn's) to stderr in ``fmt``; safe to call again (it replaces)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}; choose one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in _UVICORN:
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True


def uvicorn_log_config(fmt: str) -> dict[str, Any] | None:
    """For ``uvicorn.run(log_config=...)``: None keeps our handlers (uvicorn would install its own)."""
    return None if fmt == "json" else None
