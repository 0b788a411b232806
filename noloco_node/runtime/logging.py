"""Log format for node processes, set up once by the CLI; library code never adds handlers."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: str = "INFO", prefix: str = "") -> None:
    """Route all logs to stderr as `time level [prefix] logger: message`."""
    tag = f"[{prefix}] " if prefix else ""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {tag}%(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("hivemind", "datasets", "filelock", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


class ProgressLine:
    """A single rewritten status line on a TTY; silent otherwise (logs stay clean)."""

    def __init__(self, stream=sys.stderr) -> None:
        self.stream = stream
        self.enabled = stream.isatty()

    def update(self, text: str) -> None:
        if self.enabled:
            self.stream.write("\r\033[K" + text)
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
