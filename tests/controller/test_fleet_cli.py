"""`deskfleet fleet` commands that need no agents: init, token, plan on paper, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deskfleet.common import join_tokens
from deskfleet.controller.cli import main


def test_init_token_and_a_paper_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = ["--data-dir", str(tmp_path / "ctl")]
    assert main(["fleet", "init", "--address", "10.0.0.5:7341", *data]) == 0
    capsys.readouterr()
    assert main(["fleet", "token", "--ttl", "2h", "--uses", "3", *data]) == 0
    token = join_tokens.decode_join_token(capsys.readouterr().out)
    assert token.controller_addresses == ("10.0.0.5:7341",)
    gb = 1_000_000_000
    model = ["fleet", "plan", "--layers", "80", "--layer-bytes", str(0.45 * gb), "--embed-bytes", str(gb),
             "--head-bytes", str(gb), *data]
    # 38 GB of files, held as a CPU deploy holds them (x1.3): 49.4 GB, more than three 16 GB PCs' 43.2 usable
    assert main([*model, "--json", *["--assume-agent", str(16 * gb)] * 3]) == 1
    capsys.readouterr()
    assert main([*model, "--json", *["--assume-agent", str(16 * gb)] * 4]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["feasible"] and plan["stages"][0][1] == 0 and plan["stages"][-1][2] == 80
    assert main([*model, "--assume-agent", str(8 * gb)]) == 1  # 38 GB on one 8 GB PC: infeasible
    assert "memory short" in capsys.readouterr().out


def test_errors_name_the_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fleet", "token", "--data-dir", str(tmp_path / "none")]) == 2
    assert "fleet init" in capsys.readouterr().err
    assert main(["fleet", "init", "--data-dir", str(tmp_path / "ctl"), "--address", "10.0.0.5:1"]) == 0
    assert main(["fleet", "token", "--ttl", "soon", "--data-dir", str(tmp_path / "ctl")]) == 2
    assert "soon" in capsys.readouterr().err
    assert main(["fleet", "plan", "--data-dir", str(tmp_path / "ctl")]) == 2
    assert "--layers" in capsys.readouterr().err


@pytest.mark.parametrize(("option", "value"), [("--layer-bytes", "-1e9"), ("--kv-bytes-per-token", "-1e6"),
                                               ("--head-bytes", "inf"), ("--assume-agent", "nan"),
                                               ("--context", "-1000000"), ("--layers", "0")])
def test_a_paper_plan_refuses_sizes_that_are_not_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        option: str, value: str) -> None:
    # a negative KV size made a "feasible" plan of -16 GB of KV; inf gave an OverflowError traceback
    assert main(["fleet", "init", "--data-dir", str(tmp_path / "ctl"), "--address", "10.0.0.5:1"]) == 0
    paper = {"--layers": "4", "--layer-bytes": "1e9", "--assume-agent": "8e9", option: value}
    arguments = [part for name, setting in paper.items() for part in (name, setting)]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["fleet", "plan", *arguments, f"{option}={value}", "--data-dir", str(tmp_path / "ctl")])
    assert exit_.value.code == 2
    assert option in capsys.readouterr().err
