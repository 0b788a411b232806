"""Socket files that libp2p daemons of killed processes left in /tmp.

hivemind's P2P binds a unix socket, /tmp/hivemind-p2pclient-<random>.sock, for its daemon to call
back on, and removes it when it shuts down. A process killed with SIGKILL (the OOM killer, a
`kill -9`, a crashed machine's restart) runs no shutdown: its daemon exits with it, and the file
stays, one per kill, forever. A node starting sweeps those of its own user that nobody listens on.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import time
from pathlib import Path

log = logging.getLogger(__name__)

SOCKET_DIR = Path("/tmp")
PATTERNS = ("hivemind-p2pclient-*.sock", "hivemind-p2pd-*.sock")
MIN_AGE_S = 60.0
"""A socket this young may be one whose owner has bound it and not yet called listen()."""


def remove_stale_sockets(directory: Path = SOCKET_DIR, *, min_age_s: float = MIN_AGE_S) -> int:
    """Remove hivemind's socket files in `directory` owned by this user, older than `min_age_s`,
    that refuse a connection (no process listens on them); returns how many went. Never raises:
    a sweep that cannot look or remove leaves the files where they are."""
    removed = 0
    now = time.time()
    uid = os.getuid()
    bound = _bound_paths()
    for pattern in PATTERNS:
        for path in directory.glob(pattern):
            try:
                info = path.lstat()
            except OSError:
                continue
            if not stat.S_ISSOCK(info.st_mode) or info.st_uid != uid or now - info.st_mtime < min_age_s:
                continue
            # A socket some process holds is never dialled: hivemind's handler of a live process's
            # socket logged each probe as an ERROR traceback (a newcomer saw 9 in 30 min, in every
            # process at once). Only one nobody holds here (or in another network namespace,
            # whose sockets this table does not list) is tried.
            if str(path) not in bound and _nobody_listens(path):
                try:
                    path.unlink()
                    removed += 1
                except OSError:
                    pass
    if removed:
        log.debug("removed %d stale libp2p socket file(s) from %s", removed, directory)
    return removed


def _bound_paths() -> set[str]:
    """The paths of the unix sockets processes hold in this network namespace (Linux's
    /proc/net/unix); empty where it cannot be read."""
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return set()
    return {fields[7] for fields in (line.split() for line in lines) if len(fields) >= 8}


def _nobody_listens(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        probe.connect(str(path))
    except OSError as exc:
        return exc.errno == errno.ECONNREFUSED
    finally:
        probe.close()
    return False
