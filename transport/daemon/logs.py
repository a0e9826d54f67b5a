"""The daemon's log: plain lines or JSON lines, to stderr or to a file reopened on SIGHUP."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from pathlib import Path

PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonLines(logging.Formatter):
    """One JSON object per record: ts (UTC, ISO 8601), level, logger, msg[, exc]."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class ReopenableFileHandler(logging.FileHandler):
    """Appends to a file; `reopen()` starts writing to whatever file is at the path now
    (after logrotate moved the old one away)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, mode="a", encoding="utf-8")

    def reopen(self) -> None:
        self.acquire()
        try:
            if self.stream is not None:
                self.stream.close()
            self.stream = self._open()
        finally:
            self.release()


def configure(log_format: str, level: str, path: Path | None) -> ReopenableFileHandler | None:
    """Route the root logger to `path` (or stderr) in `log_format` ("plain" or "json");
    returns the file handler to reopen on SIGHUP, None when logging to stderr."""
    handler: logging.Handler
    file_handler = None
    if path is None:
        handler = logging.StreamHandler(sys.stderr)
    else:
        handler = file_handler = ReopenableFileHandler(path)
    handler.setFormatter(JsonLines() if log_format == "json" else logging.Formatter(PLAIN_FORMAT))
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    return file_handler
