from __future__ import annotations

from deskfleet.common.log_limit import LogEvery
from tests.fake_clock import FakeClock


def test_a_key_is_due_first_then_once_an_interval_each_key_on_its_own() -> None:
    clock = FakeClock(100.0)
    limit = LogEvery(clock)
    assert limit.due("pc1", 60.0) and not limit.due("pc1", 60.0)
    assert limit.due("pc2", 60.0)  # another key: due at once
    clock.now += 59.0
    assert not limit.due("pc1", 60.0)
    clock.now += 1.0
    assert limit.due("pc1", 60.0) and not limit.due("pc1", 60.0)
    assert limit.due("pc1", 0.0)  # the interval is the caller's, read at each call


def test_past_its_bound_it_forgets_every_key() -> None:
    limit = LogEvery(FakeClock(100.0), max_keys=2)
    assert limit.due("a", 60.0) and limit.due("b", 60.0)
    assert limit.due("c", 60.0)  # a third key: the two before are forgotten
    assert limit.due("a", 60.0) and not limit.due("c", 60.0)


def test_a_record_made_one_line_keeps_its_words_loses_its_traceback_and_its_level_is_capped() -> None:
    import logging
    import sys

    from deskfleet.common.log_limit import as_one_line

    try:
        raise OSError(101, "Network is unreachable")
    except OSError:
        exc_info = sys.exc_info()
    loud = logging.LogRecord("lib", logging.ERROR, "f.py", 1, "Error with socket %d", (18,), exc_info)
    as_one_line(loud, "its address went", logging.INFO)
    assert (loud.getMessage(), loud.levelno, loud.levelname, loud.exc_info) == (
        "Error with socket 18: its address went", logging.INFO, "INFO", None)
    quiet = logging.LogRecord("lib", logging.DEBUG, "f.py", 1, "%s sure", ("100%",), None)  # a lower level stays
    as_one_line(quiet, "said before", logging.WARNING)
    assert (quiet.getMessage(), quiet.levelno) == ("100% sure: said before", logging.DEBUG)
