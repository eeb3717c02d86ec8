"""Advisory file locks: a second holder is refused until the first lets go."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from deskfleet.common.file_lock import lock_file, pid_lock, try_lock_file, unlock_file


def test_a_held_lock_refuses_a_second_holder_until_released(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    with open(path, "a+") as first, open(path, "a+") as second:  # two opens conflict, as two processes would
        lock_file(first.fileno())
        assert not try_lock_file(second.fileno())
        unlock_file(first.fileno())
        assert try_lock_file(second.fileno())
        unlock_file(second.fileno())


def test_a_holder_that_wrote_into_the_file_still_shuts_a_newcomer_out(tmp_path: Path) -> None:
    # Windows locks the byte at the current position: after the holder appended its pid, a newcomer opening
    # in append mode sat elsewhere and took "the lock" too. Every call now works on byte 0.
    path = tmp_path / "x.lock"
    path.write_text("\n123456")
    with open(path, "a+") as first, open(path, "a+") as second:
        assert try_lock_file(first.fileno())
        first.write("\n42")
        first.flush()
        assert not try_lock_file(second.fileno())
        unlock_file(first.fileno())


def test_a_pid_lock_names_its_holder_to_the_next_comer_and_is_free_again_after(tmp_path: Path) -> None:
    path = tmp_path / "serve.lock"
    refused: list[tuple[str, str]] = []

    def refusal(pid: str, holder: str) -> Exception:
        refused.append((pid, holder))
        return RuntimeError(f"held by {pid}")

    with pid_lock(path, refusal, "fleet init --force"):
        with open(path, "a+") as other:  # another process's open, as far as the lock is concerned
            assert not try_lock_file(other.fileno())
        with pytest.raises(RuntimeError, match=f"held by {os.getpid()}"):
            with pid_lock(path, refusal):
                pass
    # and what holds it: six `fleet init --force` at once were told a `fleet serve` held the data dir
    assert refused == [(str(os.getpid()), "fleet init --force")]
    with pid_lock(path, refusal):  # let go: taken at once
        pass


def test_a_holder_that_has_not_written_yet_is_waited_for_an_instant(tmp_path: Path) -> None:
    # four `fleet serve` at once: one read the lock file between its holder's truncate and write, "pid unknown"
    import threading

    path = tmp_path / "serve.lock"
    with open(path, "a+b") as holder:
        assert try_lock_file(holder.fileno())
        late = threading.Timer(0.05, lambda: (holder.write(b"\n4242 fleet serve"), holder.flush()))
        late.start()
        with pytest.raises(RuntimeError, match=r"^4242 fleet serve$"):
            with pid_lock(path, lambda pid, what: RuntimeError(f"{pid} {what}")):
                pass
        late.join()
    with open(path, "a+b") as holder:  # one that never writes: said unknown, after the wait
        holder.truncate(0)
        assert try_lock_file(holder.fileno())
        with pytest.raises(RuntimeError, match=r"^unknown $"):
            with pid_lock(path, lambda pid, what: RuntimeError(f"{pid} {what}")):
                pass


@pytest.mark.skipif(os.name == "nt", reason="symbolic links need privileges on Windows")
def test_a_lock_file_that_is_a_link_is_refused_and_nothing_is_written_through_it(tmp_path: Path) -> None:
    # a link planted as an agent's state/agent.lock had the agent (as root) write its pid over the file it named
    victim = tmp_path / "victim"
    victim.write_text("VICTIM-CONTENT")
    lock = tmp_path / "agent.lock"
    lock.symlink_to(victim)
    with pytest.raises(OSError, match=rf"the lock file {lock} is a symbolic link \(to {victim}\): remove it"), \
            pid_lock(lock, lambda pid, holder: RuntimeError(pid)):
        pass
    assert victim.read_text() == "VICTIM-CONTENT"
