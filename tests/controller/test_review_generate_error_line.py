"""A run that fails after text has streamed ends that text's line first: the error starts a line of its own
(it was printed on the streamed text's line)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deskfleet.agent.stage_executor import StageExecutor
from deskfleet.common.wire import Forward, ForwardResult
from deskfleet.controller.cli import main


@pytest.mark.parametrize("fail_at", [6, None])
def test_the_error_after_streamed_text_starts_its_own_line(tiny_export: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str],
                                                           fail_at: int | None) -> None:
    run = StageExecutor.run
    calls = {"count": 0}

    def fail_midway(self: StageExecutor, message: Forward, return_logits: bool = False) -> Forward | ForwardResult:
        calls["count"] += 1
        if calls["count"] == fail_at:
            raise RuntimeError("out of memory")
        return run(self, message, return_logits)

    monkeypatch.setattr(StageExecutor, "run", fail_midway)
    capsys.readouterr()
    code = main(["generate", "--model", str(tiny_export), "--prompt", "def f(x):", "--max-new-tokens", "12",
                 "--ignore-eos", "--precision", "f32"])
    out, err = capsys.readouterr()
    if fail_at is None:
        assert code == 0 and out.endswith("\n")
        return
    assert code != 0 and "out of memory" in err and err.startswith("deskfleet: error:")
    assert out.strip(), "the test needs text streamed before the failure"
    assert out.endswith("\n") and not out.endswith("\n\n")
