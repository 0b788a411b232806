"""A JSONL event stream per node: one JSON object per line (`ts`, `event`, `peer`, `stage`, then
the event's fields), flushed as written so a crash loses at most the line being written.
Experiments and operators read it; nothing in the node reads it back.

Events: started, inner_step, outer_round, checkpoint, stopping, stopped.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any


class EventLog:
    """Disabled (every call a no-op) when `path` is None."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path).expanduser() if path else None
        self._file = None
        self._lock = threading.Lock()
        self.context: dict[str, Any] = {}
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1, encoding="utf-8")

    def bind(self, **context: Any) -> None:
        """Fields added to every later event (peer id and stage, once known)."""
        self.context.update(context)

    def emit(self, event: str, **fields: Any) -> None:
        if self._file is None:
            return
        line = json.dumps({"ts": round(time.time(), 4), "event": event, **self.context, **fields}, default=str)
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_events(path: str | Path) -> list[dict]:
    """Every complete line of an event file (a torn last line from a killed node is skipped)."""
    events = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events
