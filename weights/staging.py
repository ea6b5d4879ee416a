"""Where a conversion may write: real-path containment, and the staging directories it leaves.

`convert_to_orbax` builds its result in a hidden sibling of the output directory and renames it
into place (`weights.orbax_checkpoint`). This module holds the two path rules around that:

* `contains(outer, inner)`: whether directory `inner` is `outer` or lies anywhere below it,
  decided on real paths (symlinks resolved) and on device/inode identity of every ancestor, so
  neither a symlink nor a bind mount makes an output directory look unrelated to its source.
* staging names carry the converting process: `.<name>.converting-<pid>-<host>-<random>` (and
  `.<name>.replaced-...` for a replaced output moved aside). A later conversion into the same
  output removes those whose process, on this host, is gone — what an interrupted conversion
  left — and leaves alone those of a conversion still running, or of another host.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import tempfile

logger = logging.getLogger(__name__)

KINDS = ("converting", "replaced")


def contains(outer: str, inner: str) -> bool:
    """Whether the path `inner` is the directory `outer` or lies anywhere inside it.

    Both are compared as real paths; in addition, when `outer` exists, every existing ancestor
    of `inner` is compared with it by (device, inode), which also sees through bind mounts."""
    outer_real, inner_real = os.path.realpath(outer), os.path.realpath(inner)
    if os.path.commonpath([outer_real, inner_real]) == outer_real:
        return True
    try:
        identity = _identity(outer_real)
    except OSError:
        return False
    path = inner_real
    while True:
        try:
            if _identity(path) == identity:
                return True
        except OSError:
            pass  # not created yet
        parent = os.path.dirname(path)
        if parent == path:
            return False
        path = parent


def make_staging(target: str, kind: str) -> str:
    """A new empty hidden sibling of `target` named for this process (`kind`: "converting" or
    "replaced"), readable as an ordinary directory (mkdtemp alone makes it private)."""
    directory = tempfile.mkdtemp(prefix=f"{_prefix(target, kind)}{os.getpid()}-{_host()}-",
                                 dir=os.path.dirname(target))
    os.chmod(directory, 0o777 & ~_umask())
    return directory


def remove_stale_staging(target: str) -> list[str]:
    """Delete the staging siblings of `target` left by conversions whose process has ended (on
    this host); return their paths. Others are left, and logged."""
    parent, removed = os.path.dirname(target), []
    pattern = re.compile("(?:" + "|".join(re.escape(_prefix(target, kind)) for kind in KINDS) + ")"
                         + r"(?P<pid>\d+)-(?P<host>[A-Za-z0-9._]+)-[a-z0-9_]+")
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return removed
    for name in sorted(names):
        path = os.path.join(parent, name)
        match = pattern.fullmatch(name)
        if not any(name.startswith(_prefix(target, kind)) for kind in KINDS) or os.path.islink(path) \
                or not os.path.isdir(path):
            continue
        if match is None or match["host"] != _host() or _alive(int(match["pid"])):
            logger.info("leaving %s: it may belong to a conversion still running (or on another host); "
                        "delete it if none is", path)
            continue
        logger.info("removing %s, left by an interrupted conversion (process %s)", path, match["pid"])
        shutil.rmtree(path)
        removed.append(path)
    return removed


def _prefix(target: str, kind: str) -> str:
    return f".{os.path.basename(target)}.{kind}-"


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "localhost"


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _identity(path: str) -> tuple[int, int]:
    status = os.stat(path)
    return status.st_dev, status.st_ino


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
