from __future__ import annotations

import errno
import os

from deskfleet.common.os_error_text import os_error_text


def test_the_path_and_the_way_out_are_named() -> None:
    error = OSError(errno.EROFS, os.strerror(errno.EROFS), "/srv/fleet/.serve.lock")
    assert os_error_text(error) == ("Read-only file system: /srv/fleet/.serve.lock (that file system is mounted "
                                    "read-only: give a folder on a writable disk)")


def test_an_error_with_no_path_still_says_what_to_do() -> None:
    assert os_error_text(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))) == \
        "No space left on device (the disk is full: make room on it)"


def test_a_rename_names_both_paths() -> None:
    error = PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/a/x.tmp", None, "/a/x")
    assert os_error_text(error).startswith("Permission denied: /a/x.tmp -> /a/x (this user may not: run the command")


def test_an_error_of_our_own_words_is_kept_as_it_is() -> None:
    assert os_error_text(OSError("cannot open the lock file /d/.lock: it is a folder")) == \
        "cannot open the lock file /d/.lock: it is a folder"
    assert os_error_text(ConnectionResetError()) == "ConnectionResetError"


def test_an_errno_without_a_known_way_out_is_its_reason_and_path() -> None:
    error = OSError(errno.EBUSY, os.strerror(errno.EBUSY), "/mnt")
    assert os_error_text(error) == f"{os.strerror(errno.EBUSY)}: /mnt"


def test_a_folder_that_cannot_be_made_for_something_in_its_place_says_so() -> None:
    # an agent's cache that was a link round a loop said only "File exists: .../cache"
    assert os_error_text(FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), "/d/cache")) == (
        "File exists: /d/cache (something that is no folder is in its place (a file, or a link that leads nowhere))")
