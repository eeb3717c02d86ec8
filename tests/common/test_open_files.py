"""raise_open_files_limit: the soft limit goes up to what is wanted or to the hard limit, never down."""

from __future__ import annotations

import pytest

from deskfleet.common.open_files import raise_open_files_limit


@pytest.mark.parametrize(("soft", "hard", "after"), [
    (1024, 524288, 65536),  # systemd's usual limits for a user service
    (1024, 4096, 4096),  # a hard limit below what is wanted: up to it
    (100000, 524288, 100000),  # above what is wanted already: kept
    (1024, -1, 65536),  # no hard limit
])
def test_the_soft_limit_rises_to_what_is_wanted_or_the_hard_limit(soft: int, hard: int, after: int) -> None:
    state = {"limits": (soft, hard)}

    def set_limit(pair: tuple[int, int]) -> None:
        state["limits"] = pair

    assert raise_open_files_limit(limits=(lambda: state["limits"], set_limit)) == (soft, after)
    assert state["limits"] == (after, hard)


def test_a_refused_raise_leaves_the_limit() -> None:
    def refuse(pair: tuple[int, int]) -> None:
        raise ValueError("not allowed")

    assert raise_open_files_limit(limits=(lambda: (1024, 4096), refuse)) is None


def test_this_process_can_raise_its_own() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, soft), hard))  # a service manager's usual soft limit
        raised = raise_open_files_limit()
        wanted = 65536 if hard == resource.RLIM_INFINITY else min(65536, hard)
        assert raised == (min(1024, soft), max(wanted, min(1024, soft)))
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (raised[1], hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))  # the rest of the run as it was
