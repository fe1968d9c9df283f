"""Making a rename survive a crash of the machine, not only of the process.

A file renamed into a directory is durable once the directory itself is fsynced: the rename is
an entry in the directory, and until that entry reaches the disk a power loss may undo it even
though the file's own bytes were synced. The payload store (a payload a group names, committed a
moment later) and the weight publisher (a version the workers load) both rely on it.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: str | os.PathLike[str] | Path) -> None:
    """fsync the directory `path`: every rename into it before the call is durable after it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
