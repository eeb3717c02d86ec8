"""Export's output folder: what "-o" may name, and that nothing the user had there is lost."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from deskfleet.common.file_lock import try_lock_file
from deskfleet.common.model_spec import WeightFormat, load_manifest, verify_files
from deskfleet.controller.export import exporter, output_folder
from deskfleet.controller.export.exporter import ExportError, export_checkpoint


@pytest.fixture
def checkpoint(checkpoint_factory: Callable[..., Path]) -> Path:
    return checkpoint_factory("export-output", num_hidden_layers=1)


@pytest.fixture
def no_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the export starts converting IR: the refusal must come before that work."""
    def converting(*args: object, **kwargs: object) -> None:
        raise AssertionError("the export converted IR before refusing the output")

    monkeypatch.setattr(exporter, "_convert", converting)


def names(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


def test_the_working_directory_as_output(checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # "-o ." has no name of its own: the export must still land in the folder it names
    out = tmp_path / "exp"
    out.mkdir()
    monkeypatch.chdir(out)
    export_checkpoint(checkpoint, Path("."), WeightFormat.F32, overwrite=True)
    verify_files(out, load_manifest(out))
    assert names(tmp_path) == ["exp"]  # no staging or old folder left beside it
    # the old folder was swapped out from under the working directory, as a shell in it would see
    with pytest.raises(ExportError, match="the working directory no longer exists"):
        export_checkpoint(checkpoint, Path("."), WeightFormat.F32)
    monkeypatch.chdir(out)
    with pytest.raises(ExportError, match=f"{out} already exists; pass --overwrite"):
        export_checkpoint(checkpoint, Path("."), WeightFormat.F32)


def test_a_symbolic_link_as_output_is_refused(checkpoint: Path, tmp_path: Path, tiny_export: Path,
                                              no_conversion: None) -> None:
    # e.g. models/current -> v1: --overwrite would put a folder where the link was and leave v1 as it was
    shutil.copytree(tiny_export, tmp_path / "v1")
    (tmp_path / "current").symlink_to("v1")
    (tmp_path / "dangling").symlink_to("nowhere")
    for link in ("current", "dangling"):
        for overwrite in (True, False):
            with pytest.raises(ExportError, match=rf"{link} is a symbolic link \(to (v1|nowhere)\)"):
                export_checkpoint(checkpoint, tmp_path / link, WeightFormat.F32, overwrite=overwrite)
    assert names(tmp_path) == ["current", "dangling", "v1"]
    assert (tmp_path / "current").readlink() == Path("v1") and names(tmp_path / "v1") == names(tiny_export)


def test_a_mount_point_as_output_is_refused_before_any_work(checkpoint: Path, tmp_path: Path, no_conversion: None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # a USB drive or share mounted at OUT_DIR: with --overwrite the whole export ran, on the parent's disk, and
    # then could not move the mount point aside ("Device or resource busy")
    mount = tmp_path / "usb"
    mount.mkdir()
    (mount / "notes.txt").write_text("mine")
    is_mount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda path: Path(path) == mount or is_mount(path))
    for overwrite in (True, False):
        with pytest.raises(ExportError, match=rf"{mount} is a mount point \(a drive or share mounted there\): .* give "
                                              rf"a folder inside it, e.g. -o {mount / 'model'}"):
            export_checkpoint(checkpoint, mount, WeightFormat.F32, overwrite=overwrite)
    assert names(tmp_path) == ["usb"] and names(mount) == ["notes.txt"]


# A folder made at OUT_DIR while the export runs (the output check at the start saw nothing there).

def _kept_staging(parent: Path, message: str) -> Path:
    """The finished export the error says was kept: a whole, verified export."""
    (staging,) = [path for path in parent.iterdir() if path.name.startswith(".out.partial-")]
    assert f"the finished export is kept at {staging}" in message
    verify_files(staging, load_manifest(staging))
    return staging


@pytest.mark.parametrize("holds_a_file", [True, False])
def test_a_folder_made_during_the_export_is_kept_without_overwrite(
        checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, holds_a_file: bool) -> None:
    out = tmp_path / "out"
    export_into = exporter._export_into

    def user_makes_the_folder(*args: object) -> object:
        manifest = export_into(*args)  # type: ignore[arg-type]
        out.mkdir()
        if holds_a_file:
            (out / "thesis.txt").write_text("my only copy")
        return manifest

    monkeypatch.setattr(exporter, "_export_into", user_makes_the_folder)
    with pytest.raises(ExportError, match=f"{out} was made while the export ran and is left as it is; the "
                                          "finished export is kept at") as raised:
        export_checkpoint(checkpoint, out, WeightFormat.F32)
    # --overwrite would run the whole export again (and refuse a folder of the user's files): not advised
    assert "--overwrite" not in str(raised.value)
    assert names(out) == (["thesis.txt"] if holds_a_file else [])
    if holds_a_file:
        assert (out / "thesis.txt").read_text() == "my only copy"
    _kept_staging(tmp_path, str(raised.value))


@pytest.mark.parametrize("renameat2", [True, False], ids=["renameat2", "mkdir-claim"])
@pytest.mark.parametrize("holds_a_file", [True, False])
def test_a_folder_made_between_the_last_check_and_the_move_is_kept(
        checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, renameat2: bool,
        holds_a_file: bool) -> None:
    # The last check passes, then the folder appears: a plain rename would replace an empty one silently.
    if not renameat2:
        monkeypatch.setattr(output_folder, "_RENAMEAT2", None)  # as on a system or file system without it
    out = tmp_path / "out"
    rename = output_folder._rename_no_replace

    def user_makes_the_folder(source: Path, target: Path) -> None:
        if target == out:
            out.mkdir()
            if holds_a_file:
                (out / "thesis.txt").write_text("my only copy")
        rename(source, target)

    monkeypatch.setattr(output_folder, "_rename_no_replace", user_makes_the_folder)
    with pytest.raises(ExportError, match=f"cannot move the finished export into {out}: .*File exists") as raised:
        export_checkpoint(checkpoint, out, WeightFormat.F32)
    assert names(out) == (["thesis.txt"] if holds_a_file else [])
    _kept_staging(tmp_path, str(raised.value))


def test_an_export_replaced_by_other_files_during_the_export_is_kept_with_overwrite(
        checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_export: Path) -> None:
    # OUT_DIR was an old export when checked; by the end, the user's files are there instead
    out = tmp_path / "out"
    shutil.copytree(tiny_export, out)
    export_into = exporter._export_into

    def user_replaces_it(*args: object) -> object:
        manifest = export_into(*args)  # type: ignore[arg-type]
        shutil.rmtree(out)
        out.mkdir()
        (out / "thesis.txt").write_text("my only copy")
        return manifest

    monkeypatch.setattr(exporter, "_export_into", user_replaces_it)
    with pytest.raises(ExportError, match=r"out holds files but no manifest\.json") as raised:
        export_checkpoint(checkpoint, out, WeightFormat.F32, overwrite=True)
    assert names(out) == ["thesis.txt"]
    _kept_staging(tmp_path, str(raised.value))


def test_what_is_moved_aside_is_checked_again_before_it_is_deleted(
        checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_export: Path) -> None:
    # OUT_DIR is swapped for the user's files between the last check and the move aside: they are put back
    out = tmp_path / "out"
    shutil.copytree(tiny_export, out)
    rename = output_folder._rename_no_replace

    def user_swaps_it(source: Path, target: Path) -> None:
        if source == out:
            shutil.rmtree(out)
            out.mkdir()
            (out / "thesis.txt").write_text("my only copy")
        rename(source, target)

    monkeypatch.setattr(output_folder, "_rename_no_replace", user_swaps_it)
    with pytest.raises(ExportError, match=r"out holds files but no manifest\.json") as raised:
        export_checkpoint(checkpoint, out, WeightFormat.F32, overwrite=True)
    assert names(out) == ["thesis.txt"]
    assert [path.name for path in tmp_path.iterdir() if ".old-" in path.name] == []
    _kept_staging(tmp_path, str(raised.value))


def test_an_old_export_is_replaced_and_removed_with_overwrite(checkpoint: Path, tmp_path: Path,
                                                              tiny_export: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(tiny_export, out)
    export_checkpoint(checkpoint, out, WeightFormat.F32, overwrite=True)
    assert load_manifest(out).spec.num_layers == 1 and names(tmp_path) == ["out"]


@pytest.mark.parametrize("renameat2", ["present", "absent", "unsupported"])
def test_rename_no_replace_never_replaces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, renameat2: str) -> None:
    if renameat2 == "absent":
        monkeypatch.setattr(output_folder, "_RENAMEAT2", None)
    elif renameat2 == "unsupported":  # a file system without RENAME_NOREPLACE answers EINVAL
        def einval(*args: object) -> int:
            ctypes.set_errno(errno.EINVAL)
            return -1

        monkeypatch.setattr(output_folder, "_RENAMEAT2", einval)
    source, target = tmp_path / "source", tmp_path / "target"
    source.mkdir()
    (source / "a").write_text("new")
    target.mkdir()  # empty: what a plain rename would replace
    with pytest.raises(FileExistsError):
        output_folder._rename_no_replace(source, target)
    (target / "b").write_text("old")
    with pytest.raises(FileExistsError):
        output_folder._rename_no_replace(source, target)
    (tmp_path / "link").symlink_to("nowhere")
    with pytest.raises(FileExistsError):
        output_folder._rename_no_replace(source, tmp_path / "link")
    assert names(source) == ["a"] and names(target) == ["b"] and (tmp_path / "link").is_symlink()
    output_folder._rename_no_replace(source, tmp_path / "moved")
    assert names(tmp_path) == ["link", "moved", "target"] and names(tmp_path / "moved") == ["a"]


# SIGTERM and SIGHUP mid-export, and what a killed export left behind.

SIGNALLED_EXPORT = """
import os, signal, sys
from pathlib import Path
from deskfleet.common.model_spec import WeightFormat
from deskfleet.controller.export import exporter

checkpoint, out, signum, when = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
signal.signal(signum, signal.SIG_DFL)  # the case under test, whatever the test run inherited (nohup ignores SIGHUP)
save, set_handler = exporter._save, signal.signal

def save_then_signal(*args, **kwargs):
    save(*args, **kwargs)
    try:
        os.kill(os.getpid(), signum)  # as `kill`, `timeout` or a closed terminal would, mid-export
        sum(range(1000))  # the handler runs by now
    except BaseException:
        if when != "dropped":
            raise
        # dropped, as when the handler ran inside a finalizer (__del__) or a library's catch-all

def signal_then_set_handler(number, handler):
    if number == signum and handler is signal.SIG_DFL:  # the export done, its handler being put back
        os.kill(os.getpid(), signum)
        sum(range(1000))
    return set_handler(number, handler)

if when == "finishing":
    signal.signal = signal_then_set_handler
else:
    exporter._save = save_then_signal
exporter.export_checkpoint(checkpoint, out, WeightFormat.F32)
print("the export went on past the signal")
"""


@pytest.mark.parametrize(("signum", "when"), [(signal.SIGTERM, "mid-export"), (signal.SIGHUP, "mid-export"),
                                              (signal.SIGTERM, "dropped"), (signal.SIGTERM, "finishing")],
                         ids=["SIGTERM", "SIGHUP", "SIGTERM-exception-dropped", "SIGTERM-as-handlers-are-restored"])
def test_a_terminating_signal_removes_the_unfinished_export_then_ends_the_process(
        checkpoint: Path, tmp_path: Path, signum: int, when: str) -> None:
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run([sys.executable, "-c", SIGNALLED_EXPORT, str(checkpoint), str(work / "out"), str(signum),
                           when], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == -signum, done.stderr  # ended by the signal, as without the export's handler
    assert "Traceback" not in done.stderr
    # no full-size hidden staging folder left; an export that had finished is in place
    assert names(work) == (["out"] if when == "finishing" else [])
    assert f"export stopped by {signal.Signals(signum).name}" in done.stderr


# In a fresh interpreter: signals sent to the test process itself crashed it (SIGSEGV inside kill) after some
# earlier tests in the same process had run OpenVINO and asyncio loops (seen with `-k` selections only; the cause,
# OpenVINO Cores unmapping a thread's alternate signal stack, is in agent/openvino_core.py).
HANDLERS_KEPT = """
import os, signal, sys
from pathlib import Path
from deskfleet.common.model_spec import WeightFormat, load_manifest
from deskfleet.controller.export import exporter

checkpoint, work = Path(sys.argv[1]), Path(sys.argv[2])
handled, during = [], []

def own_handler(signum, frame):
    handled.append(signum)

save = exporter._save

def save_and_look(*args, **kwargs):
    save(*args, **kwargs)
    during.append({signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGHUP)})

signal.signal(signal.SIGTERM, signal.SIG_DFL)
signal.signal(signal.SIGHUP, signal.SIG_DFL)
exporter._save = save_and_look
exporter.export_checkpoint(checkpoint, work / "default", WeightFormat.F32)
assert during[0][signal.SIGTERM] not in (signal.SIG_DFL, signal.SIG_IGN)  # the export's own, meanwhile
assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
signal.signal(signal.SIGHUP, signal.SIG_IGN)
signal.signal(signal.SIGTERM, own_handler)
during.clear()
# nohup's SIG_IGN and a program's own handler are left in place, and still do what they did
exporter._save = lambda *args, **kwargs: (save_and_look(*args, **kwargs), os.kill(os.getpid(), signal.SIGHUP),
                                          os.kill(os.getpid(), signal.SIGTERM))
exporter.export_checkpoint(checkpoint, work / "handled", WeightFormat.F32)
assert during[0] == {signal.SIGTERM: own_handler, signal.SIGHUP: signal.SIG_IGN}, during
assert handled and set(handled) == {signal.SIGTERM}, handled
load_manifest(work / "handled")
assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN and signal.getsignal(signal.SIGTERM) is own_handler
print("ok")
"""


def test_signal_handlers_are_set_only_where_the_default_would_kill_and_restored(checkpoint: Path,
                                                                              tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", HANDLERS_KEPT, str(checkpoint), str(tmp_path)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_an_export_outside_the_main_thread_sets_no_handlers(checkpoint: Path, tmp_path: Path) -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            export_checkpoint(checkpoint, tmp_path / "out", WeightFormat.F32)
        except BaseException as error:  # signal.signal raises ValueError outside the main thread
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert errors == [] and load_manifest(tmp_path / "out").spec.num_layers == 1


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_what_killed_exports_left_is_removed_only_when_dead_unheld_and_unfinished(
        checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_export: Path) -> None:
    warnings: list[str] = []
    monkeypatch.setattr(output_folder.log, "warning", lambda text, *args: warnings.append(text % args))
    pids = [_dead_pid() for _ in range(6)]
    assert len(set(pids)) == 6
    work = tmp_path / "work"
    folders = {"unfinished": f".out.partial-{pids[0]}", "live": f".out.partial-{os.getppid()}",
               "held": f".out.partial-{pids[1]}", "finished": f".out.partial-{pids[2]}",
               "old": f".out.old-{pids[3]}", "other name": f".other.partial-{pids[4]}"}
    for name in folders.values():
        (work / name).mkdir(parents=True)
        (work / name / "layer_000.bin").write_text("half a layer")
    shutil.copyfile(tiny_export / "manifest.json", work / folders["finished"] / "manifest.json")
    shutil.copytree(tiny_export, work / folders["old"], dirs_exist_ok=True)  # an old export moved aside
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "precious.txt").write_text("mine")
    (work / f".out.partial-{pids[5]}").symlink_to(tmp_path / "elsewhere")
    held = os.open(work / folders["held"], os.O_RDONLY)  # an export on another machine sharing the folder
    try:
        assert try_lock_file(held)
        output_folder.remove_stale_folders(work / "out")
        left = set(names(work))
        assert folders["unfinished"] not in left
        assert {folders[kind] for kind in ("live", "held", "finished", "old", "other name")} <= left
        assert (tmp_path / "elsewhere" / "precious.txt").read_text() == "mine"
        # the old export's replacement never arrived: it may be the only copy, so it is named, not removed
        assert any(f"{work / folders['old']} holds what was at {work / 'out'}" in text for text in warnings)
        assert any(f"{work / folders['finished']} holds a finished export" in text for text in warnings)
        # an export to out while those two may still be writing it is refused, and removes nothing
        with pytest.raises(ExportError, match=r"another export to .*out is running"):
            export_checkpoint(checkpoint, work / "out", WeightFormat.F32)
        assert left == set(names(work))
    finally:
        os.close(held)
    shutil.rmtree(work / folders["live"])  # its export ended; the held one's lock went with the close
    export_checkpoint(checkpoint, work / "out", WeightFormat.F32)
    assert folders["held"] not in names(work)  # dead and no longer held: removed
    warnings.clear()
    export_checkpoint(checkpoint, work / "out", WeightFormat.F32, overwrite=True)
    # an export is in place at out now, but the warning told the user the old one is theirs: it stays, named again
    assert {folders[kind] for kind in ("old", "finished", "other name")} <= set(names(work))
    assert any(f"{work / folders['old']} holds what was at {work / 'out'}" in text and "holds an export now" in text
               for text in warnings)


@pytest.mark.parametrize("interrupted_after", [1, 2])
def test_an_interrupt_just_after_a_rename_leaves_one_whole_export_at_out_dir(
        checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_export: Path,
        interrupted_after: int) -> None:
    # Python runs a signal handler when the C call returns, so its exception comes after the rename: after
    # the first (the old export moved aside) the old export must be put back; after the second (the new one
    # in place) the export is done. Either way OUT_DIR holds one whole export and nothing hidden is left.
    out = tmp_path / "out"
    shutil.copytree(tiny_export, out)
    old_manifest = (out / "manifest.json").read_text()
    rename = output_folder._rename_no_replace
    renames: list[Path] = []

    def interrupted_on_return(source: Path, target: Path) -> None:
        rename(source, target)
        renames.append(target)
        if len(renames) == interrupted_after:
            raise KeyboardInterrupt

    monkeypatch.setattr(output_folder, "_rename_no_replace", interrupted_on_return)
    with pytest.raises(KeyboardInterrupt):
        export_checkpoint(checkpoint, out, WeightFormat.F32, overwrite=True)
    assert names(tmp_path) == ["out"]  # no .out.old-PID, no .out.partial-PID
    manifest = load_manifest(out)
    verify_files(out, manifest)
    is_old = (out / "manifest.json").read_text() == old_manifest
    assert is_old == (interrupted_after == 1)


def test_an_export_given_where_the_checkpoint_belongs_is_named_as_one(tiny_export: Path, tmp_path: Path) -> None:
    # It said the folder has no model.safetensors ("only safetensors checkpoints are supported")
    with pytest.raises(ExportError, match=r"is already a deskfleet export \(it holds manifest\.json\): give the "
                                          r"Hugging Face checkpoint folder"):
        export_checkpoint(tiny_export, tmp_path / "again")
    assert not (tmp_path / "again").exists()


def test_an_output_path_below_a_file_is_named_as_such(tmp_path: Path) -> None:
    # "cannot write the export next to afile/sub: [Errno 20] Not a directory: 'afile/.sub.partial-6892'"
    (tmp_path / "afile").write_text("")
    with pytest.raises(ExportError, match=rf"at {tmp_path / 'afile' / 'x' / 'sub'}: {tmp_path / 'afile'} is a "
                                          "file, not a folder"):
        output_folder.make_staging_folder(tmp_path / "afile" / "x" / "sub")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["afile"]


def test_a_conversion_that_is_interrupted_leaves_the_root_logger_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    # OpenVINO's converter sets the root logger to ERROR while it runs and puts it back only when it returns:
    # after a SIGTERM during a conversion the export's "stopped by SIGTERM; no unfinished export is left behind"
    # warning was filtered out
    import logging

    import torch

    def converter_stopped(*args: object, **kwargs: object) -> None:
        root = logging.getLogger()
        root.setLevel("ERROR")
        root.addHandler(logging.NullHandler())
        raise KeyboardInterrupt

    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    monkeypatch.setattr(exporter.ov, "convert_model", converter_stopped)
    with pytest.raises(KeyboardInterrupt):
        exporter._convert(torch.nn.Identity(), (torch.zeros(1),), [[-1]], ["x"], ["y"])
    assert (root.level, root.handlers) == (level, handlers)


@pytest.mark.parametrize("how", ["held", "alive"])
def test_an_export_to_a_folder_another_export_is_writing_is_refused_at_once(
        checkpoint: Path, tmp_path: Path, no_conversion: None, how: str) -> None:
    # both ran to the end, and the second kept its finished export aside, telling the user to pass --overwrite
    out = tmp_path / "out"
    if how == "alive":
        writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        pid = writer.pid
    else:
        ended = subprocess.Popen([sys.executable, "-c", "pass"])
        ended.wait()
        pid = ended.pid  # no such process now: only the lock says an export holds it (another machine's, say)
    staging = tmp_path / f".out.partial-{pid}"
    staging.mkdir()
    descriptor = os.open(staging, os.O_RDONLY)
    try:
        if how == "held":
            assert try_lock_file(descriptor)
        with pytest.raises(ExportError, match=rf"another export to {out} is running \(process {pid}, writing "
                                              rf"{staging}\): wait for it to finish"):
            export_checkpoint(checkpoint, out, WeightFormat.F32)
    finally:
        os.close(descriptor)
        if how == "alive":
            writer.kill()
            writer.wait()
    assert names(tmp_path) == [f".out.partial-{pid}"]


def test_an_old_export_that_cannot_all_be_deleted_is_warned_of_naming_what_is_left(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # an immutable file (or one a running serve holds open on Windows) left the whole old export, without a word,
    # and each later export tried again as silently
    from tests.log_records import records_of

    old = tmp_path / ".out.deleting-123"
    old.mkdir()
    (old / "layer_0.bin").write_bytes(b"x" * 10)
    (old / "stuck.bin").write_bytes(b"y" * 7)
    unlink = os.unlink

    def refusing(path: object, *args: object, **kwargs: object) -> None:
        if str(path).endswith("stuck.bin"):
            raise PermissionError(errno.EPERM, "Operation not permitted")
        unlink(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "unlink", refusing)
    with records_of("deskfleet.controller.export", logging.WARNING) as logged:
        output_folder._delete_old_export(old)
    (warned,) = logged.messages()
    assert warned.startswith(f"could not delete all of the replaced export {old} (7 bytes left; ")
    assert "stuck.bin: Operation not permitted): remove it yourself" in warned
    assert sorted(path.name for path in old.iterdir()) == ["stuck.bin"]


def test_an_export_into_an_empty_folder_keeps_the_folders_mode_and_group(
        checkpoint_factory: Callable[..., Path], tmp_path: Path) -> None:
    # a folder set up for a team (drwxrws---, its group) became the exporting user's drwxr-xr-x
    out = tmp_path / "shared"
    out.mkdir()
    group = next((gid for gid in os.getgroups() if gid != os.stat(out).st_gid), os.stat(out).st_gid)
    os.chown(out, -1, group)
    out.chmod(0o2770)
    export_checkpoint(checkpoint_factory("tiny", num_hidden_layers=4), out, WeightFormat.F32)
    status = os.stat(out)
    assert (status.st_mode & 0o7777, status.st_gid) == (0o2770, group)
    assert (out / "manifest.json").is_file()
