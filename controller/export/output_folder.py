"""The output folder of `deskfleet export`: the staging folder beside it, and the move into place.

What it guarantees:
- The export is written into a hidden sibling folder (`.NAME.partial-PID`) and renamed into place at the end,
  so an interrupted export never leaves `out_dir` looking complete.
- SIGTERM and SIGHUP remove that folder before they end the process (only where their handling is the
  default: a program's own handler, or the SIG_IGN that nohup sets for SIGHUP, is left as it is); the process
  then ends as it would have.
- What exports that were killed (SIGKILL, a power cut) left unfinished beside `out_dir` goes with the next
  export to it: only a dead process's (by the PID in the name), and only a staging folder nobody holds the lock
  of. A finished export that was kept, and an old export a killed `--overwrite` had moved aside (whether or not
  its replacement arrived), are the user's: named in a warning by every export to `out_dir`, never removed.
  An export removes only the old export it moved aside itself, once its own is in place.
- An output folder whose replacement would delete the checkpoint, a symbolic link, or anything not a folder
  is refused. An existing `out_dir` is replaced only with `overwrite` and only when it is empty or a deskfleet
  export holding nothing its manifest does not list, checked again at the end; what is moved aside is checked
  once more before it is deleted, and it is removed only after the new export is in place (put back if the
  move fails).
- The move never replaces anything (renameat2's RENAME_NOREPLACE; elsewhere an empty folder claimed first):
  a folder made at `out_dir` while the export ran is never replaced; the finished export is then kept beside
  it and the ExportError (FinishedExportKept) says where.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import re
import shutil
import signal
import stat
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from deskfleet.common.console import ctrl_c_held
from deskfleet.common.file_lock import try_lock_file
from deskfleet.common.model_spec import MANIFEST_NAME, Manifest, ManifestError, NewerManifestError, load_manifest

# The exporter's logger, as before these moved here: the lines on stderr keep the name they had.
log = logging.getLogger("deskfleet.controller.export.exporter")


# What kill, timeout, systemd and a closed terminal send; SIGINT already raises KeyboardInterrupt.
ENDING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))
RENAME_NOREPLACE = 1  # renameat2's flag (linux/fs.h): fail with EEXIST rather than replace the target
AT_FDCWD = -100  # renameat2's "relative to the working directory" (linux/fcntl.h)
# What a file manager leaves in a folder it has shown (thumbnails, view settings): no reason to refuse --overwrite
FOLDER_LITTER = frozenset({".DS_Store", "Thumbs.db", "desktop.ini"})
UNLISTED_SHOWN = 5
NAME_MAX_BYTES = 255  # the longest name a folder may have on ext4, APFS (bytes) and NTFS (UTF-16 units)


class ExportError(RuntimeError):
    """The export could not be written; nothing at the destination was changed."""


class ExportInterrupted(BaseException):
    """SIGTERM or SIGHUP arrived during an export: raised by the export's own handler so that the unfinished
    export is removed before the process ends. A BaseException, as KeyboardInterrupt is, so that no `except
    Exception` on the way turns it into an error the export would report and carry on from."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"export interrupted by {signal.Signals(signum).name}")
        self.signum = signum


class FinishedExportKept(ExportError):
    """The finished export could not be moved into place and is kept where it was written: its message says where."""


# Public methods

def check_output(model_dir: Path, out_dir: Path, overwrite: bool) -> None:
    """Refuse an output folder whose replacement would delete the checkpoint or anything not an export."""
    source, target = model_dir.resolve(), out_dir.resolve()
    if target == source or target in source.parents:
        raise ExportError(f"the output {out_dir} holds the checkpoint {model_dir}: writing the export there would "
                          "delete the checkpoint; choose another folder")
    if out_dir.is_symlink():
        # replacing it would put a real folder where the link was and leave the folder it names unchanged
        raise ExportError(f"{out_dir} is a symbolic link (to {os.readlink(out_dir)}): give the folder it names, "
                          "or another path")
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ExportError(f"{out_dir} exists and is not a folder")
    if os.path.ismount(out_dir):
        # the export is written beside OUT_DIR and renamed into place, which a mount point refuses: with
        # --overwrite the whole export ran, on the parent's disk, and failed only then ("Device or resource busy")
        raise ExportError(f"{out_dir} is a mount point (a drive or share mounted there): an export is renamed into "
                          f"place, which cannot replace it; give a folder inside it, e.g. -o {out_dir / 'model'}")
    # --overwrite is advised only where it would replace the folder: otherwise _check_replaceable's error says
    # why it would not, and what to do (a folder of the user's files was told to pass --overwrite, which then
    # refused it)
    _check_replaceable(out_dir, out_dir)
    if not overwrite:
        raise ExportError(f"{out_dir} already exists; pass --overwrite to replace it")


def is_empty_folder(path: Path) -> bool:
    """Whether `path` is a folder (not a link to one, nor a mount point) with nothing in it but a file manager's
    litter, which does not count."""
    try:
        return not path.is_symlink() and path.is_dir() and not os.path.ismount(path) \
            and all(_is_litter(entry) for entry in path.iterdir())
    except OSError:
        return False


def missing_parents(out_dir: Path) -> list[Path]:
    """The folders above `out_dir` that do not exist yet (the nearest first): make_staging_folder makes them, and
    an export that fails removes them again (remove_empty_folders), as it found the disk."""
    missing = []
    for parent in out_dir.parents:
        if os.path.lexists(parent):
            break
        missing.append(parent)
    return missing


def remove_empty_folders(folders: list[Path]) -> None:
    """Remove each of `folders` (the nearest first) while it is empty; one that is not, or cannot be, stays."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def set_aside_folder(out_dir: Path) -> Path:
    """Where this process moves the old export at `out_dir` aside with --overwrite, until its own is in place."""
    return out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"


def make_staging_folder(out_dir: Path, overwrite: bool = False) -> Path:
    """Make the hidden folder beside `out_dir` that this process writes the export into; with `overwrite`, first
    make sure the name the old export is moved aside to at the end is free."""
    longest = f".{out_dir.name}.deleting-{'9' * 10}"  # of the names made beside it, with the longest PID
    if len(os.fsencode(longest)) > NAME_MAX_BYTES:  # it failed as "File name too long" of a name the user never gave
        spare = NAME_MAX_BYTES - (len(os.fsencode(longest)) - len(os.fsencode(out_dir.name)))
        raise ExportError(f"the output folder's name is too long: the export works beside it in hidden folders whose "
                          f"names add {NAME_MAX_BYTES - spare} bytes to it, past the {NAME_MAX_BYTES} a name may "
                          f"have; give -o a name of at most {spare} bytes")
    staging = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    if os.path.lexists(staging):  # a finished export kept by an earlier call in this process
        raise ExportError(f"{staging} is in the way (an earlier export to {out_dir}): move or remove it")
    set_aside = set_aside_folder(out_dir)
    if overwrite and os.path.lexists(set_aside):
        # An earlier process of this PID, killed with --overwrite, left it (never removed: it is the user's).
        # Moving the old export aside would fail on the name at the very end, after all the export's work.
        raise ExportError(f"{set_aside} is in the way (what was at {out_dir} before an earlier export with "
                          "--overwrite was killed): move it back or remove it, then export again")
    blocking = next((part for part in (out_dir.parent, *out_dir.parent.parents) if part.exists()), None)
    if blocking is not None and not blocking.is_dir():  # "[Errno 20] Not a directory" of the hidden staging folder
        raise ExportError(f"cannot write the export at {out_dir}: {blocking} is a file, not a folder")
    try:
        staging.mkdir(parents=True)
    except OSError as error:
        raise ExportError(f"cannot write the export next to {out_dir}: {error.strerror or error}") from None
    return staging


def flush_to_disk(folder: Path) -> None:
    """fsync every file of `folder`, then the folder itself: before the rename that makes an export visible at
    `out_dir`, so that a power cut just after it cannot leave a manifest naming files whose data never reached
    the disk (ext4 and XFS write a new file's data well after its name)."""
    file_flags = os.O_RDWR if sys.platform == "win32" else os.O_RDONLY  # Windows commits only a writable one
    for path in sorted(folder.iterdir()):
        if path.is_file() and not path.is_symlink():
            _fsync(path, file_flags)
    _fsync(folder, os.O_RDONLY)


def move_into_place(model_dir: Path, staging: Path, out_dir: Path, overwrite: bool) -> None:
    """Move the finished export to `out_dir`. What is there is replaced only with `overwrite` and only when it
    is an export or empty, and removed only after the new export is in place (put back if the move fails).
    Anything that appeared at `out_dir` while the export ran is left as it is; FinishedExportKept then says
    where the finished export is."""
    kept = f"; the finished export is kept at {staging} (move it into place yourself, or remove it)"
    try:
        check_output(model_dir, out_dir, overwrite)  # again: out_dir may have been made or filled meanwhile
    except ExportError as error:
        if not overwrite and os.path.lexists(out_dir):
            # Without --overwrite an existing out_dir was refused at the start: this was made while the export
            # ran. "pass --overwrite" is no advice here: it would run the whole export again to replace what
            # may be the user's (and a folder holding files is refused even then).
            raise FinishedExportKept(
                f"{out_dir} was made while the export ran and is left as it is; the finished export is kept at "
                f"{staging}: move what is at {out_dir} out of the way and move the export into place yourself, "
                "or remove it") from None
        raise FinishedExportKept(f"{error}{kept}") from None
    _keep_folder_attributes(out_dir, staging)
    retired = set_aside_folder(out_dir) if overwrite and os.path.lexists(out_dir) else None
    try:
        if retired is not None:
            try:
                _rename_no_replace(out_dir, retired)
            except OSError as error:
                raise FinishedExportKept(f"cannot move the old export at {out_dir} aside: {error}{kept}") from None
            # What was moved aside is what will be deleted: checked once more, now that no one else can
            # swap it (the check above and the move are two steps).
            _check_replaceable(retired, out_dir)
        _rename_no_replace(staging, out_dir)
    except BaseException as error:
        # A signal's exception (or Ctrl-C's) can come just after a rename has happened: Python runs the
        # handler when the call returns. So what is on disk says how far the move got, not which line raised.
        if not os.path.lexists(staging) and os.path.lexists(out_dir):  # the new export is in place: done
            if retired is not None:
                _discard(retired, out_dir)
            raise
        moved_aside = retired is not None and os.path.lexists(retired) and not os.path.lexists(out_dir)
        restored = _put_back(retired, out_dir) if moved_aside and retired is not None else ""
        if isinstance(error, FinishedExportKept):
            raise
        if isinstance(error, ExportError):
            raise FinishedExportKept(f"{error}{restored}{kept}") from None
        if isinstance(error, OSError):
            raise FinishedExportKept(
                f"cannot move the finished export into {out_dir}: {error}{restored}{kept}") from None
        raise  # interrupted: the old export is back, the caller removes the staging folder
    with contextlib.suppress(OSError):  # the rename itself, on disk; it has happened either way
        _fsync(out_dir.parent, os.O_RDONLY)
    if retired is not None:
        _discard(retired, out_dir)


@contextlib.contextmanager
def ending_signals_clean_up() -> Iterator[Callable[[], None]]:
    """While the export runs, SIGTERM and SIGHUP raise ExportInterrupted instead of ending the process at
    once, so the cleanup runs; then the signal is raised again under its old handling, and the process ends
    as it would have. Only where that handling is the default: a program's own handler, or the SIG_IGN that
    nohup sets for SIGHUP, is left as it is. Ctrl-C's KeyboardInterrupt runs the same cleanup, and is said in
    the same kind of line.

    Yields a check to call between steps: it raises ExportInterrupted again once a signal came. Python may
    run the handler inside a finalizer (__del__) or a library's catch-all, which reports or drops the
    exception and carries on with the export."""
    received: list[int] = []

    def stop_if_signalled() -> None:
        if received:
            raise ExportInterrupted(received[0])

    if threading.current_thread() is not threading.main_thread():
        yield stop_if_signalled  # only the main thread may set handlers (Python runs them there)
        return

    finishing = False

    def interrupt(signum: int, frame: object) -> None:
        if received:  # again while the cleanup runs: let it finish, the first signal still ends the process
            return
        received.append(signum)
        if not finishing:  # while the handlers are put back, an exception would escape the raise below
            raise ExportInterrupted(signum)

    previous = {signum: signal.signal(signum, interrupt) for signum in ENDING_SIGNALS
                if signal.getsignal(signum) is signal.SIG_DFL}
    ctrl_c = False
    try:
        yield stop_if_signalled
    except KeyboardInterrupt:
        # Ctrl-C unwinds through the export's own cleanup (Python's KeyboardInterrupt), which has removed the
        # unfinished export by now: said as SIGTERM's is, where it ended the export with exit 130 and no line
        ctrl_c = True
        raise
    finally:
        finishing = True
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if received:
            log.warning("export stopped by %s; no unfinished export is left behind",
                        signal.Signals(received[0]).name)
            signal.raise_signal(received[0])  # the default handling again: the process ends here
            raise SystemExit(128 + received[0])  # reached only while the signal is blocked in this thread
        if ctrl_c:
            log.warning("export stopped by Ctrl-C (SIGINT); no unfinished export is left behind")


@contextlib.contextmanager
def held(folder: Path) -> Iterator[None]:
    """Hold an advisory lock on `folder` while this export writes it: another export's cleanup removes only a
    staging folder nobody holds (the PID in its name may be another machine's, on a shared folder, or
    another container's)."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:  # Windows opens no folder this way; it is never cleaned up (_process_alive) either
        yield
        return
    try:
        with contextlib.suppress(OSError):  # a file system without locks: the cleanup leaves all alone there
            try_lock_file(descriptor)
        yield
    finally:
        os.close(descriptor)


def check_no_running_export(out_dir: Path) -> None:
    """ExportError when another export to `out_dir` is running (an unfinished `.NAME.partial-PID` whose lock is
    held, or whose process is alive): both ran to the end before, and the second then kept its finished export
    aside with the advice to pass --overwrite, its work wasted. One left by a process that is gone is
    remove_stale_folders'."""
    for entry, kind, pid in _left_beside(out_dir):
        if kind != "partial" or (entry / MANIFEST_NAME).is_file():
            continue
        if pid != os.getpid() and (_lock_held(entry) or _process_alive(pid)):
            raise ExportError(f"another export to {out_dir} is running (process {pid}, writing {entry}): wait for it "
                              f"to finish, or export to another folder; if no export runs, remove {entry}")


def remove_stale_folders(out_dir: Path) -> None:
    """Remove the unfinished staging folders that exports to `out_dir` that were killed (SIGKILL, a power cut)
    left beside it: only a dead process's (by the PID in the name), and only one nobody holds the lock of. A
    finished export that was kept, and an old export a killed `--overwrite` had moved aside, are the user's:
    named in a warning, never removed."""
    for entry, kind, pid in _left_beside(out_dir):
        if _process_alive(pid):
            continue
        if kind == "deleting":  # an old export whose replacement was in place, its deletion cut short
            _delete_old_export(entry)
        elif kind == "old":
            # Never removed here, not even once an export is in place at out_dir: the warning a run printed when
            # it found the folder told the user it was theirs to move back or remove, and a later --overwrite
            # deleted it without a line (an export at out_dir may be one they put back by hand, or another).
            replaced = (f" ({out_dir} holds an export now, most likely the one that replaced it)"
                        if _is_export(out_dir) else "")
            log.warning("%s holds what was at %s before an export with --overwrite was killed%s; it is left for "
                        "you to move back or remove", entry, out_dir, replaced)
        elif (entry / MANIFEST_NAME).is_file():
            log.warning("%s holds a finished export that was never moved into %s; it is left for you to move "
                        "or remove", entry, out_dir)
        else:
            _remove_unheld(entry)


# Private methods

def _keep_folder_attributes(out_dir: Path, staging: Path) -> None:
    """Give the export the mode (setgid included) and group of the folder it replaces, an empty one or an old
    export: a folder set up for a team (drwxrws--- for its group) became the exporting user's drwxr-xr-x. Best
    effort: a group this user is not in, or a file system without modes, keeps the staging folder's own."""
    try:
        status = os.stat(out_dir, follow_symlinks=False)
    except OSError:
        return
    if not stat.S_ISDIR(status.st_mode):
        return
    with contextlib.suppress(OSError, AttributeError):  # os.chown: not on Windows
        os.chown(staging, -1, status.st_gid)
    with contextlib.suppress(OSError):
        os.chmod(staging, stat.S_IMODE(status.st_mode))


def _discard(retired: Path, out_dir: Path) -> None:
    """Delete the old export this export moved aside, now that its own is in place: first renamed to a name that
    only ever means that (`.NAME.deleting-PID`), which remove_stale_folders removes without asking, so that a
    deletion cut short (a power cut, a second Ctrl-C) leaves no half export under the `.old-` name the user is told
    to move back. A first Ctrl-C meanwhile waits for the deletion."""
    with ctrl_c_held():
        deleting = retired.with_name(f".{out_dir.name}.deleting-{os.getpid()}")
        try:
            os.rename(retired, deleting)
        except OSError:  # a folder of that name left by an earlier run of this PID: delete in place
            deleting = retired
        _delete_old_export(deleting)


def _delete_old_export(folder: Path) -> None:
    """Delete an old export an --overwrite replaced; where some of it cannot be deleted (an immutable file, one a
    running `serve` holds open on Windows), warn naming the folder, what it still holds and why, once a run: it was
    left without a word, and each later export tried again as silently."""
    failures: list[tuple[str, BaseException]] = []
    if sys.version_info >= (3, 12):
        shutil.rmtree(folder, onexc=lambda _function, path, error: failures.append((path, error)))
    else:  # 3.11 has onerror alone (deprecated from 3.12)
        shutil.rmtree(folder, onerror=lambda _function, path, info: failures.append((path, info[1])))
    if failures and folder.exists():
        path, error = failures[0]
        reason = error.strerror if isinstance(error, OSError) and error.strerror else error
        log.warning("could not delete all of the replaced export %s (%s left; %s: %s): remove it yourself; "
                    "each export to the folder tries again", folder, _bytes_left(folder), path, reason)


def _bytes_left(folder: Path) -> str:
    """What the files left in `folder` hold, for a warning: a folder that could not be deleted may not be readable
    either (a subfolder that cannot be entered), and the warning must not fail for it."""
    held = 0
    for root, _, names in os.walk(folder):  # errors while walking are skipped: what could be read is counted
        for name in names:
            with contextlib.suppress(OSError):
                held += os.lstat(os.path.join(root, name)).st_size
    return f"{held} bytes"


def _check_replaceable(folder: Path, shown: Path) -> None:
    """Refuse to replace `folder` (named `shown` to the user) unless it is empty or a deskfleet export holding
    only its manifest and the files that lists (and a file manager's litter)."""
    if folder.is_symlink() or not folder.is_dir():
        raise ExportError(f"{shown} is not a folder any more: --overwrite replaces only a deskfleet export or an "
                          "empty folder")
    if all(_is_litter(path) for path in folder.iterdir()):  # empty, as the README has it: litter does not count
        return
    if not (folder / MANIFEST_NAME).is_file():
        raise ExportError(f"{shown} holds files but no {MANIFEST_NAME}: --overwrite replaces only a deskfleet "
                          "export or an empty folder; remove it yourself or choose another folder")
    try:  # read here, not by load_manifest, whose "export the model again" is no advice for another app's file
        manifest = Manifest.from_json((folder / MANIFEST_NAME).read_text(encoding="utf-8"))
    except NewerManifestError:  # "not a deskfleet manifest (... made by a newer deskfleet ...)" said both
        raise ExportError(f"{shown} holds an export made by a newer deskfleet, which this one cannot check for files "
                          "of yours before deleting it: remove it yourself, or choose another folder") from None
    except (ManifestError, OSError, ValueError) as error:
        reason = error.strerror if isinstance(error, OSError) else error
        raise ExportError(f"{shown}/{MANIFEST_NAME} is not a deskfleet manifest ({reason}): --overwrite replaces "
                          "only a deskfleet export or an empty folder; remove it yourself or choose another "
                          "folder") from None
    # An export holds its manifest and the files it lists, nothing else: anything more was put there since
    # (notes, a log, another export in a subfolder) and would be deleted with the old export. A listed name that
    # is a folder (or a link) is not the file it lists: a hand-edited manifest listing a folder had it deleted.
    unlisted = sorted(path.name for path in folder.iterdir()
                      if (path.name not in manifest.files or path.is_symlink() or not path.is_file())
                      and path.name != MANIFEST_NAME and not _is_litter(path))
    if unlisted:
        more = f" and {len(unlisted) - UNLISTED_SHOWN} more" if len(unlisted) > UNLISTED_SHOWN else ""
        is_not, them = ("is not a file", "it") if len(unlisted) == 1 else ("are not files", "them")
        raise ExportError(f"{shown} is an export, but also holds {', '.join(unlisted[:UNLISTED_SHOWN])}{more}, which "
                          f"{is_not} its {MANIFEST_NAME} lists: --overwrite would delete {them} with the old "
                          f"export; move {them} out first, or choose another folder")


def _is_litter(path: Path) -> bool:
    """Whether `path` is a file manager's litter (FOLDER_LITTER): a plain file of one of those names, not a folder
    or link that only bears one (what is in it would be deleted with the folder)."""
    return path.name in FOLDER_LITTER and path.is_file() and not path.is_symlink()


def _put_back(retired: Path, out_dir: Path) -> str:
    """Move the old export back to `out_dir`; what to add to an error message about it."""
    try:
        _rename_no_replace(retired, out_dir)
    except OSError as error:  # something new is at out_dir: both are kept
        log.warning("what was at %s is at %s: it could not be put back (%s)", out_dir, retired, error)
        return f"; what was at {out_dir} is at {retired} (it could not be put back: {error})"
    return ""


def _load_renameat2() -> Any:
    """glibc's renameat2 (Linux, glibc 2.28 or newer), or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_RENAMEAT2 = _load_renameat2()


def _rename_no_replace(source: Path, target: Path) -> None:
    """Rename `source` to `target`, raising OSError (FileExistsError) when anything is at `target`.

    A plain rename replaces an empty folder, or on POSIX any folder emptied in time: a folder the user made
    at `target` since it was checked would be lost, or the files put in it by then.
    """
    if _RENAMEAT2 is not None:
        if _RENAMEAT2(AT_FDCWD, os.fsencode(source), AT_FDCWD, os.fsencode(target), RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOSYS):  # EINVAL: a file system without RENAME_NOREPLACE
            raise OSError(code, os.strerror(code), str(source), None, str(target))
    if sys.platform == "win32":
        os.rename(source, target)  # Windows never replaces an existing target
        return
    # Claim the name with a folder of our own (mkdir fails on anything there) and rename onto that: POSIX
    # replaces only an empty folder, so files put into the claim meanwhile make the rename fail.
    os.mkdir(target)
    try:
        os.rename(source, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.rmdir(target)  # fails unless still empty: never removes anything but the claim
        raise


def _fsync(path: Path, flags: int) -> None:
    """fsync `path`; a folder where it cannot be opened (Windows) or synced (some file systems) is skipped."""
    try:
        descriptor = os.open(path, flags)
    except OSError:
        if path.is_dir():
            return
        raise
    try:
        os.fsync(descriptor)
    except OSError as error:
        if not path.is_dir() or error.errno not in (errno.EINVAL, errno.EBADF, errno.EACCES):
            raise
    finally:
        os.close(descriptor)


def _process_alive(pid: int) -> bool:
    """Whether process `pid` may be running: only ProcessLookupError proves it is not."""
    if sys.platform == "win32":
        return True  # os.kill(pid, 0) there would terminate the process, not probe it
    if pid == os.getpid():
        return False  # an earlier process of the same number (this one has made nothing there yet)
    if pid <= 0:
        return True  # 0 and negatives name process groups to os.kill: no export's name
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # PermissionError: another user's process, running
        return True
    return True


def _is_export(folder: Path) -> bool:
    try:
        load_manifest(folder)
    except (ManifestError, OSError, ValueError):
        return False
    return not folder.is_symlink()


def _left_beside(out_dir: Path) -> Iterator[tuple[Path, str, int]]:
    """The folders exports to `out_dir` made beside it, in name order: each with its kind ("partial", the staging
    folder an export writes; "old", an old export moved aside; "deleting", one being deleted once its replacement
    was in place) and the PID in its name. Links are never one."""
    pattern = re.compile(rf"\.{re.escape(out_dir.name)}\.(partial|old|deleting)-([0-9]{{1,10}})")
    try:
        entries = sorted(out_dir.parent.iterdir())
    except OSError:  # no parent folder yet: it is made with the staging folder
        return
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is not None and not entry.is_symlink() and entry.is_dir():
            yield entry, match[1], int(match[2])


def _lock_held(folder: Path) -> bool:
    """Whether another export holds `folder`'s lock (False where it cannot be told: no lock, no such folder)."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return False
    try:
        return not try_lock_file(descriptor)  # taken here, it goes with the close
    except OSError:
        return False
    finally:
        os.close(descriptor)


def _remove_unheld(folder: Path) -> None:
    """Remove a staging folder unless an export still holds its lock."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        if try_lock_file(descriptor):
            shutil.rmtree(folder, ignore_errors=True)
            log.info("removed %s, left by an export that was killed", folder)
    except OSError:  # a file system without locks: the PID alone is no proof (another machine's), so keep it
        pass
    finally:
        os.close(descriptor)
