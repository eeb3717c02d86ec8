"""An agent started on a data dir that never joined (a mistyped --data-dir) is refused naming the join
command, and leaves no folders behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from deskfleet.agent.enroll import EnrollmentError
from deskfleet.agent.service import AgentOptions, AgentService


def test_an_unjoined_data_dir_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    typo = tmp_path / "deskfleet-agnet"
    with pytest.raises(EnrollmentError, match=r"has not joined a fleet .*deskfleet-agent join TOKEN --data-dir .*, or, "
                                              r"if this PC joined with --data-dir D, give the agent the same"):
        AgentService(AgentOptions(typo, None))
    assert not typo.exists()
