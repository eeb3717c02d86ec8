"""Both commands make standard output and error tolerant of characters their encoding lacks, first."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from deskfleet.agent import cli as agent_cli
from deskfleet.controller import cli as controller_cli


@pytest.mark.parametrize("main", [controller_cli.main, agent_cli.main])
def test_both_commands_make_their_output_tolerant_first(
        main: Callable[[Sequence[str] | None], int], monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[object, ...]] = []
    module = controller_cli if main is controller_cli.main else agent_cli
    monkeypatch.setattr(module, "tolerate_unencodable", lambda *streams: seen.append(streams))
    with pytest.raises(SystemExit):
        main(["--help"])
    assert len(seen) == 1 and len(seen[0]) == 2
