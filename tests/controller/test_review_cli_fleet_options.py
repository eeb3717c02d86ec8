"""generate and chat refuse, naming it, an option the run would ignore (exit 2): --stages on the fleet (its
deployment decides the stages), the compile options on the fleet without --draft, --data-dir and
--max-failovers off it. An option with an effect is taken."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any, cast

import pytest

from deskfleet.agent.stage import CompileSettings, Precision
from deskfleet.controller.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(list(argv))
    return code, capsys.readouterr().err


GENERATE = ["generate", "--model", "m", "--prompt", "hi"]
CHAT = ["chat", "--model", "m"]


@pytest.mark.parametrize(("argv", "message"), [
    ([*GENERATE, "--fleet", "--stages", "3"], "--stages 3 with --fleet: the fleet's deployed plan decides the stages"),
    ([*CHAT, "--fleet", "--stages", "2"], "--stages 2 with --fleet: the fleet's deployed plan decides the stages"),
    ([*GENERATE, "--data-dir", "d"], "--data-dir without --fleet"),
    ([*GENERATE, "--max-failovers", "0"], "--max-failovers without --fleet"),
    ([*CHAT, "--data-dir", "d"], "--data-dir without --fleet"),
    ([*CHAT, "--max-failovers", "3"], "--max-failovers without --fleet"),
    ([*GENERATE, "--discover-seconds", "0"], "--discover-seconds without --fleet"),
    ([*CHAT, "--discover-seconds", "3"], "--discover-seconds without --fleet"),
    # without --draft they would compile nothing: the PCs compile as the model was deployed
    ([*GENERATE, "--fleet", "--precision", "f32"], "--precision with --fleet and no --draft: the PCs compile their "
     "stages as the model was deployed (`deskfleet fleet deploy --precision`); leave it out"),
    ([*GENERATE, "--fleet", "--prompt-lookup", "--device", "GPU", "--threads", "2"],
     "--device, --threads with --fleet and no --draft: the PCs compile their stages as the model was deployed "
     "(`deskfleet fleet deploy --device`), each with its device's own thread count; leave them out"),
    ([*CHAT, "--fleet", "--threads", "2"], "--threads with --fleet and no --draft: the PCs compile their stages each "
     "with its device's own thread count; leave it out"),  # fleet deploy has no --threads: it named it there
    ([*CHAT, "--fleet", "--kv-cache", "f32"], "--kv-cache with --fleet and no --draft"),
    ([*GENERATE, "--fleet", "--precision", "fast"], "--precision with --fleet and no --draft"),  # even the default
])
def test_an_option_the_run_would_ignore_is_refused(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                   message: str) -> None:
    code, err = run(capsys, *argv)
    assert code == 2
    assert err.startswith(f"deskfleet: error: {message}")


def test_options_with_an_effect_on_the_fleet_are_taken(capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import deskfleet.controller.chat as chat

    calls: list[tuple[Any, ...]] = []

    def generate_on_fleet(options: Any, data_dir: Path | None, stream_text: bool = False,
                          max_failovers: int = -1, discover_seconds: float | None = -1.0) -> dict[str, object]:
        calls.append((options, data_dir, max_failovers, discover_seconds))
        return {"generated_tokens": 0, "tok_s": 0.0, "stages": 2, "tokens": [], "text": ""}

    monkeypatch.setattr(chat, "generate_on_fleet", generate_on_fleet)
    draft = tmp_path / "draft"
    assert run(capsys, *GENERATE, "--fleet", "--json")[0] == 0
    assert run(capsys, *GENERATE, "--fleet", "--draft", str(draft), "--precision", "f32", "--threads", "2",
               "--data-dir", str(tmp_path), "--max-failovers", "0", "--discover-seconds", "0", "--json")[0] == 0
    (plain, plain_dir, plain_failovers, plain_browse), (drafting, data_dir, failovers, browse) = calls
    assert plain.stages == 1 and plain_dir is None and plain_failovers == 2 and plain_browse is None
    assert browse == 0.0
    assert plain.settings == CompileSettings()
    assert drafting.settings == CompileSettings(precision=Precision.F32, num_threads=2)
    assert (data_dir, failovers) == (tmp_path, 0)


def test_local_defaults_are_unchanged(tiny_export: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import deskfleet.controller.run as run_module

    seen: list[tuple[int, CompileSettings]] = []
    real = run_module.LocalPipeline

    def recording(model: Path, stages: int, settings: CompileSettings, manifest: Any = None) -> Any:
        seen.append((stages, settings))
        return real(model, stages, settings, manifest)

    monkeypatch.setattr(run_module, "LocalPipeline", recording)
    argv = ["generate", "--model", str(tiny_export), "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--json"]
    assert run(capsys, *argv)[0] == 0
    assert run(capsys, *argv, "--stages", "2", "--precision", "f32")[0] == 0
    assert seen == [(1, CompileSettings()), (2, CompileSettings(precision=Precision.F32))]


@pytest.mark.parametrize(("given", "browse"), [(None, 1.0), (0.0, 0.0), (5.0, 5.0)])
def test_a_re_plan_browses_mdns_as_long_as_discover_seconds_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 given: float | None, browse: float) -> None:
    # every failover browsed mDNS for 1 s, and a network where multicast is unwanted had no way to say no
    import deskfleet.controller.chat as chat
    import deskfleet.controller.fleet_failover as fleet_failover

    seen: list[tuple[float, tuple[str, ...]]] = []

    def failover(store: Any, model: Path, max_failovers: int, survey_options: Any, drafting: bool,
                 stop: Any = None, own_network: Any = None) -> Any:
        seen.append((survey_options.discover_seconds, survey_options.peers))
        raise RuntimeError("stop here")

    monkeypatch.setattr(fleet_failover, "FleetFailover", failover)
    with pytest.raises(RuntimeError, match="stop here"), \
            chat.open_fleet_chain(cast(Any, None), tmp_path, 2, given, ("10.0.0.5:7431",)):
        pass
    assert seen == [(browse, ("10.0.0.5:7431",))]


def test_fleet_generate_re_plans_with_its_peers_and_browse(capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # `fleet generate --peer/--discover-seconds` were taken and ignored
    import deskfleet.controller.chat as chat

    calls: list[dict[str, Any]] = []

    def generate_on_fleet(options: Any, data_dir: Path | None, **kwargs: Any) -> dict[str, object]:
        calls.append(kwargs)
        return {"tokens": [5, 6]}

    monkeypatch.setattr(chat, "generate_on_fleet", generate_on_fleet)
    code, _ = run(capsys, "fleet", "generate", "--model", "m", "--prompt-ids", "1,2", "--peer", "10.0.0.5:7431",
                  "--discover-seconds", "0")
    assert code == 0 and calls == [{"discover_seconds": 0.0, "peers": ("10.0.0.5:7431",)}]


def test_fleet_generate_that_runs_out_of_pcs_is_a_failed_run_as_generate_fleet_says(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # `fleet generate` exited 2, a usage error's status, where `generate --fleet` exits 1 for the same failure
    import deskfleet.controller.chat as chat
    from deskfleet.controller.fleet_failover import FailoverError

    def out_of_pcs(*args: Any, **kwargs: Any) -> dict[str, object]:
        raise FailoverError("no agent can take work (test)")

    monkeypatch.setattr(chat, "generate_on_fleet", out_of_pcs)
    assert main(["fleet", "generate", "--model", "m", "--prompt-ids", "1,2", "--discover-seconds", "0"]) == 1
    assert capsys.readouterr().err == "deskfleet: error: no agent can take work (test)\n"


def test_fleet_generate_keeps_what_a_stopped_run_made_and_reports_its_replans(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # a run the chain broke under, or a Ctrl-C, printed nothing: its tokens were lost; --json had no re-plans
    import deskfleet.controller.chat as chat
    from deskfleet.controller.run import GenerationInterrupted, GenerationStopped

    replan = {"lost_agent": "a" * 52, "seconds": 1.2}
    outcomes: list[Any] = []

    def generate_on_fleet(*args: Any, **kwargs: Any) -> dict[str, object]:
        outcome = outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return cast(dict[str, object], outcome)

    monkeypatch.setattr(chat, "generate_on_fleet", generate_on_fleet)
    argv = ["fleet", "generate", "--model", "m", "--prompt-ids", "1,2"]
    outcomes.append({"tokens": [7, 8, 9], "replans": [replan], "failovers": [], "text": "x"})
    assert main([*argv, "--json"]) == 0
    assert capsys.readouterr().out == '{"tokens": [7, 8, 9], "replans": [{"lost_agent": "' + "a" * 52 + \
        '", "seconds": 1.2}], "failovers": []}\n'
    outcomes.append(GenerationStopped("the chain broke", {"tokens": [7, 8], "stopped": "the chain broke"}))
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert out == "7 8\n" and err == "deskfleet: error: the chain broke\n"
    outcomes.append(GenerationInterrupted({"tokens": [7], "stopped": "interrupted"}, ["--prompt-ids"], False))
    assert main([*argv, "--json"]) == 130
    assert capsys.readouterr().out == '{"tokens": [7], "stopped": "interrupted"}\n'


@pytest.mark.parametrize("stop", ["broken", "ctrl_c"])
def test_a_fleet_run_that_stops_reports_its_replans(monkeypatch: pytest.MonkeyPatch, stop: str) -> None:
    # the re-plans were added only to a run that finished: a stopped one, where they matter most, had none
    import contextlib
    from collections.abc import Iterator
    from types import SimpleNamespace

    import deskfleet.controller.chat as chat
    from deskfleet.controller.run import GenerateOptions, GenerationInterrupted, GenerationStopped

    replans = [{"lost_agent": "b" * 52}]
    rejoined = [{"agents": ["c" * 52]}]  # the run's start took back a PC an earlier run's re-plan left out

    @contextlib.contextmanager
    def fleet_chain(*args: Any, **kwargs: Any) -> Iterator[tuple[Any, Any]]:
        yield SimpleNamespace(num_stages=2), SimpleNamespace(replans=replans, rejoined=rejoined)

    def run_generate(*args: Any, **kwargs: Any) -> dict[str, object]:
        report: dict[str, object] = {"tokens": [4], "stopped": stop}
        if stop == "broken":
            raise GenerationStopped("the chain broke", report)
        raise GenerationInterrupted(report, ["--prompt-ids"], False)

    monkeypatch.setattr(chat, "controller_store", lambda data_dir: None)
    monkeypatch.setattr(chat, "open_fleet_chain", fleet_chain)
    monkeypatch.setattr(chat, "run_generate", run_generate)
    with pytest.raises((GenerationStopped, GenerationInterrupted)) as stopped:
        chat.generate_on_fleet(GenerateOptions(model=Path("m"), prompt_ids=[[1]]), None)
    assert stopped.value.report == {"tokens": [4], "stopped": stop, "fleet": True, "replans": replans,
                                    "rejoined": rejoined}


@pytest.mark.parametrize(("signum", "status", "said"), [(signal.SIGTERM, 143, "deskfleet: stopped by SIGTERM\n"),
                                                        (signal.SIGINT, 130, "")])
def test_fleet_generate_stopped_by_a_signal_from_elsewhere_says_which(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, signum: int, status: int,
        said: str) -> None:
    # a SIGTERM ended it with exit 143 and not a word; a Ctrl-C shows on the terminal that typed it
    import deskfleet.controller.chat as chat
    from deskfleet.controller.run import GenerationInterrupted

    def stopped(*args: Any, **kwargs: Any) -> dict[str, object]:
        raise GenerationInterrupted({"tokens": [5, 6], "stopped": "interrupted"}, ["--prompt-ids"], streamed=False,
                                    signum=signum)

    monkeypatch.setattr(chat, "generate_on_fleet", stopped)
    assert main(["fleet", "generate", "--model", "m", "--prompt-ids", "1,2", "--discover-seconds", "0"]) == status
    captured = capsys.readouterr()
    assert captured.out == "5 6\n" and captured.err == said


@pytest.mark.parametrize("command", ["ls", "plan", "deploy", "generate"])
def test_a_peer_that_is_no_address_is_refused_as_the_option_is_read(command: str,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # `fleet generate` dialled its --peer only for a re-plan: `--peer x:y` passed unsaid until a PC dropped out
    with pytest.raises(SystemExit) as exit_code:
        main(["fleet", command, "--peer", "x:y", "--model", "m", "--prompt-ids", "1"])
    assert exit_code.value.code == 2
    assert "argument --peer: address 'x:y' has no port between 1 and 65535" in capsys.readouterr().err


def test_fleet_serve_at_port_0_is_refused_naming_the_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # it said "between 0 and 65535" for 65536, then, for 0, "has no port between 1 and 65535" without --listen
    data = ["--data-dir", str(tmp_path / "ctl")]
    assert main(["fleet", "init", "--address", "10.0.0.5:7341", *data]) == 0
    capsys.readouterr()
    for port in (0, 65536):
        assert main(["fleet", "serve", "--listen", f"127.0.0.1:{port}", *data]) == 2
        assert f"--listen: address '127.0.0.1:{port}' has no port between 1 and 65535" in capsys.readouterr().err
