"""Logging set-up: text or one JSON object per line."""

from __future__ import annotations

import json
import logging
import sys
import time

# The accepted values of --log-level and --log-format (and their environment
# variables); setup_logging refuses anything else rather than guess.
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(level: str, fmt: str) -> None:
    # Checked before anything changes: an unknown level used to end in a
    # traceback from logging, and an unknown format silently meant text.
    if level not in LOG_LEVELS:
        raise ValueError(f"unknown log level {level!r} (choose from {', '.join(LOG_LEVELS)})")
    if fmt not in LOG_FORMATS:
        raise ValueError(f"unknown log format {fmt!r} (choose from {', '.join(LOG_FORMATS)})")
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
