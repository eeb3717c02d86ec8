"""An operating system's error in words a user can act on: what failed, on which path, and the usual way out.

`[Errno 30] Read-only file system: '/srv/fleet/.serve.lock'` named the file but not what to do, and an error
raised with no path (`[Errno 28] No space left on device`) not even where. Pure: no I/O.
"""

from __future__ import annotations

import errno

_DENIED = "this user may not: run the command as the user that owns it, or give it a folder of its own"
_WAY_OUT = {
    errno.ENOSPC: "the disk is full: make room on it",
    errno.EDQUOT: "this user's disk quota is used up: make room, or ask for a larger quota",
    errno.EROFS: "that file system is mounted read-only: give a folder on a writable disk",
    errno.EACCES: _DENIED,
    errno.EPERM: _DENIED,
    errno.ENAMETOOLONG: "a name in that path is longer than its file system takes (usually 255 bytes)",
    errno.ELOOP: "the path goes round a loop of symbolic links",
    errno.ENOTDIR: "a part of that path is a file, where a folder is needed",
    errno.EISDIR: "that is a folder, where a file is needed",
    errno.EMFILE: "this process has as many files open as its limit lets it (ulimit -n): raise the limit",
    errno.ENFILE: "the system has as many files open as it takes",
    errno.EIO: "the disk reported an input/output error: check it",
    # what making a folder says where something else is in the way (a file, a link to nothing or round a loop)
    errno.EEXIST: "something that is no folder is in its place (a file, or a link that leads nowhere)",
}


def os_error_text(error: OSError) -> str:
    """`error` as one line: its reason, the path(s) it names, and the usual way out where its errno has one."""
    reason = error.strerror or str(error) or type(error).__name__
    paths = [str(path) for path in (error.filename, error.filename2) if path is not None]
    text = f"{reason}: {' -> '.join(paths)}" if paths and error.strerror else reason
    way_out = _WAY_OUT.get(error.errno) if error.errno is not None else None
    return f"{text} ({way_out})" if way_out else text


__all__ = ["os_error_text"]
