"""The employee's opt-out: `deskfleet-agent pause` / `resume` write it, the running agent reports `paused`,
gives up what it hosts at once (the next step names why), refuses assignments, and serves again on resume; a
damaged opt-out file counts as paused."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from deskfleet.agent import opt_out as opt_out_module
from deskfleet.agent.cli import main
from deskfleet.agent.core import AgentCore, CommandError
from deskfleet.agent.enroll import Membership
from deskfleet.agent.opt_out import OPT_OUT_FILE, OptOut, OptOutReader, read_opt_out, write_opt_out
from deskfleet.agent.paths import AgentSettings, save_settings
from deskfleet.agent.service import AgentService
from deskfleet.agent.shard_cache import ShardCache
from deskfleet.common.agent_state import AgentState
from deskfleet.common.availability import CALL_IN_MIN_INTERVAL_S, CALL_IN_SETTLE_S, GIB, MonitorReading
from deskfleet.common.wire import ErrorCode, Register, Role, StatusReport, StatusRequest
from tests.agent.test_core import _host_tiny_stage, handle
from tests.agent.test_review_lifecycle_registration import FakeLink as RegistrationLink
from tests.agent.test_stage_release import _one_step
from tests.fleet_pki import make_ca, make_member


class PluggedInDesktop:
    def read(self) -> MonitorReading:
        return MonitorReading(cpu_load=0.1, memory_free_bytes=8 * GIB, memory_total_bytes=16 * GIB,
                              battery_percent=None, on_ac_power=True, temperatures=(), igpu_busy=None)


@pytest.fixture
def desk(tmp_path: Path) -> tuple[AgentCore, Path]:
    ca = make_ca(tmp_path / "ca")
    files = make_member(ca, tmp_path / "agent", "agent")
    state = tmp_path / "state"
    state.mkdir()
    core = AgentCore(files, AgentSettings(), ShardCache(tmp_path / "cache", 1 << 30), PluggedInDesktop(),
                     opt_out_dir=state)
    return core, state


def status(core: AgentCore) -> StatusReport:
    report = handle(core, Role.CONTROLLER, StatusRequest())
    assert isinstance(report, StatusReport)
    return report


def test_no_file_is_not_paused_and_a_written_one_reads_back(tmp_path: Path) -> None:
    assert not read_opt_out(tmp_path).paused
    write_opt_out(tmp_path, True, "2026-12-01T17:00:00+00:00")
    assert read_opt_out(tmp_path) == opt_out_module.OptOut(True, "2026-12-01T17:00:00+00:00")
    write_opt_out(tmp_path, False, "2026-12-01T18:00:00+00:00")
    assert not read_opt_out(tmp_path).paused


@pytest.mark.parametrize("content", ["{not json", '["paused"]', '{"paused": "yes"}', '{"paused": true, "since": 5}'])
def test_a_damaged_opt_out_counts_as_paused_and_names_the_file(tmp_path: Path, content: str) -> None:
    (tmp_path / OPT_OUT_FILE).write_text(content)
    opt_out = read_opt_out(tmp_path)
    assert opt_out.paused and opt_out.problem is not None and OPT_OUT_FILE in opt_out.problem
    (tmp_path / OPT_OUT_FILE).unlink()
    (tmp_path / OPT_OUT_FILE).mkdir()  # not even a file
    assert read_opt_out(tmp_path).paused


def test_the_running_agent_logs_a_damaged_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    warnings: list[str] = []
    monkeypatch.setattr(opt_out_module.log, "warning", lambda text, *args: warnings.append(text % args))
    (tmp_path / OPT_OUT_FILE).write_text("{")
    reader = OptOutReader(tmp_path)
    assert reader.read().paused and reader.read().paused
    assert len(warnings) == 1 and "taken as paused" in warnings[0]


def test_a_paused_pc_gives_its_stage_up_at_once_refuses_work_and_serves_again_on_resume(
        desk: tuple[AgentCore, Path], tiny_export: Path) -> None:
    core, state = desk
    assignment = _host_tiny_stage(core, tiny_export)
    assert status(core).state is AgentState.SERVING
    write_opt_out(state, True, "now")
    assert status(core).state is AgentState.PAUSED
    assert asyncio.run(core.enforce_limits(0.0)) == (assignment.stage,)  # not after release_stages_after_s
    assert core.stages == {}
    with pytest.raises(CommandError, match=r"paused by its user") as refused:
        handle(core, Role.AGENT, replace(_one_step(), model_id=assignment.stage.model_id))
    assert refused.value.code is ErrorCode.NOT_ASSIGNED and refused.value.agent_id == core.agent_id
    with pytest.raises(CommandError, match=r"this PC is paused by its user") as busy:
        _host_tiny_stage(core, tiny_export)  # a plan made before the pause
    assert busy.value.code is ErrorCode.BUSY and core.stages == {}
    write_opt_out(state, False, "later")
    assert status(core).state is AgentState.AVAILABLE
    with pytest.raises(CommandError, match=r"hosts no stage") as resumed:  # a plan made during the pause
        handle(core, Role.AGENT, replace(_one_step(), model_id=assignment.stage.model_id))
    assert resumed.value.agent_id is None  # blames no one: the driver's re-plan may take this PC again
    assert _host_tiny_stage(core, tiny_export).stage in core.stages


def test_a_pc_removed_from_the_fleet_says_so_to_every_later_step(desk: tuple[AgentCore, Path],
                                                                  tiny_export: Path) -> None:
    # its stages given up, the reason passed at once (no limit was crossed) and the driver read "this agent hosts
    # no stage", which named no removal and blamed no one
    core, _ = desk
    assignment = _host_tiny_stage(core, tiny_export)
    asyncio.run(core.give_up_stages("this PC was removed from the fleet", for_good=True))
    for _ in range(2):
        with pytest.raises(CommandError, match=r"gave its stages up: this PC was removed from the fleet") as refused:
            handle(core, Role.AGENT, replace(_one_step(), model_id=assignment.stage.model_id))
        assert refused.value.code is ErrorCode.NOT_ASSIGNED and refused.value.agent_id == core.agent_id


def joined(data_dir: Path) -> Path:
    state = data_dir / "state"
    state.mkdir(parents=True)
    Membership("0123456789abcdef", "a" * 52, "c" * 52, ("127.0.0.1:7341",)).save(state)
    return data_dir


def test_pause_and_resume_commands_write_what_the_agent_reads(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    joined(tmp_path)
    assert main(["pause", "--data-dir", str(tmp_path)]) == 0
    assert read_opt_out(tmp_path / "state").paused and "until `deskfleet-agent resume`" in capsys.readouterr().out
    assert main(["resume", "--data-dir", str(tmp_path)]) == 0
    said = capsys.readouterr().out
    assert not read_opt_out(tmp_path / "state").paused and said.startswith("resumed: once this PC has been available")
    save_settings(tmp_path / "settings" / "agent-settings.json", AgentSettings(paused=True))
    assert main(["resume", "--data-dir", str(tmp_path)]) == 0
    assert "stays out until its admin" in capsys.readouterr().out


def test_a_pause_or_resume_that_changes_nothing_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a second `pause` said "paused" again and moved the pause's time; a `resume` of a PC never paused "resumed"
    joined(tmp_path)
    assert main(["resume", "--data-dir", str(tmp_path)]) == 0
    assert "this PC was not paused by its user: nothing changed" in capsys.readouterr().out
    assert main(["pause", "--data-dir", str(tmp_path)]) == 0
    since = read_opt_out(tmp_path / "state").since
    capsys.readouterr()
    assert main(["pause", "--data-dir", str(tmp_path)]) == 0
    assert f"this PC was already paused since {since}: nothing changed" in capsys.readouterr().out
    assert read_opt_out(tmp_path / "state") == OptOut(True, since)


def test_pausing_a_data_dir_that_never_joined_is_refused_and_makes_nothing(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    typo = tmp_path / "deskfleet-agnet"
    assert main(["pause", "--data-dir", str(typo)]) == 2
    assert "has not joined a fleet" in capsys.readouterr().err and not typo.exists()


def test_resume_stands_when_the_admins_settings_are_damaged(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    joined(tmp_path)
    (tmp_path / "settings").mkdir()
    (tmp_path / "settings" / "agent-settings.json").write_text('{"paused": "yes"}')
    assert main(["pause", "--data-dir", str(tmp_path)]) == 0
    assert main(["resume", "--data-dir", str(tmp_path)]) == 0
    assert not read_opt_out(tmp_path / "state").paused
    # an agent running keeps the settings it started with: "will not start" read as if it were down
    assert "resumed; but the agent's settings file is refused as it is now (a running agent keeps the settings it " \
           "started with; it will not start again until this is fixed): " in capsys.readouterr().out


def test_the_report_says_who_paused_the_pc(desk: tuple[AgentCore, Path], tmp_path: Path) -> None:
    # `fleet ls` showed a bare `paused`: the admin could not tell the employee's opt-out from their own settings.
    core, state = desk
    assert status(core).detail == ""
    write_opt_out(state, True, "now")
    assert status(core).detail == "paused by its user, until `deskfleet-agent resume`"
    admins = AgentCore(core.files, AgentSettings(paused=True), ShardCache(tmp_path / "cache2", 1 << 30),
                       PluggedInDesktop(), opt_out_dir=state)
    assert status(admins).detail == "paused in its settings (paused: true)"


def test_the_report_tells_a_damaged_opt_out_file_from_the_users_pause(desk: tuple[AgentCore, Path]) -> None:
    # A damaged file counts as paused, but `fleet ls` said "paused by its user": the admin went to ask the employee.
    core, state = desk
    (state / OPT_OUT_FILE).write_text('{"paused": tru')
    assert status(core).detail.startswith(f"paused as its {OPT_OUT_FILE} cannot be read")
    write_opt_out(state, True, "now")  # rewritten by `deskfleet-agent pause`: the user's pause again
    assert status(core).detail == "paused by its user, until `deskfleet-agent resume`"


@pytest.mark.parametrize("command", ["pause", "resume"])
def test_pause_and_resume_of_a_removed_pc_say_it_was_removed(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             command: str) -> None:
    # `resume` on a removed PC said "resumed: the next plan ... may use this PC again"; the fleet refuses it
    from deskfleet.agent import cli
    from deskfleet.agent.enroll import Membership
    from deskfleet.agent.standing import note_removed

    state = tmp_path / "state"
    state.mkdir()
    Membership("0123456789abcdef", "a" * 52, "c" * 52, ("127.0.0.1:7341",)).save(state)
    note_removed(state, "2026-12-05T01:00:00+00:00")
    assert cli.main([command, "--data-dir", str(tmp_path)]) == 1
    said = capsys.readouterr().out
    assert said.startswith("this PC was removed from the fleet (its controller refused it, 2026-12-05T01:00:00+00:00)")
    assert f"delete {state / 'agent-key.pem'}, then join with a new token" in said


def registered_service(core: AgentCore, link: RegistrationLink | None) -> AgentService:
    """An AgentService around `core`, registered at time 0 on `link` (None: its link is down)."""
    service = AgentService.__new__(AgentService)
    service.core = core
    service.membership = SimpleNamespace(token_sha256=None)  # type: ignore[assignment]
    service.listen, service.bound_port = "0.0.0.0:7431", 7431
    service.listen_families = frozenset({4})  # listening on IPv4 alone: it registers the address it reached from
    service._registration = link  # type: ignore[assignment]
    service._told_addresses = ()
    core.call_in.registered(0.0)
    return service


def test_a_resumed_pc_calls_in_on_its_registration_link(desk: tuple[AgentCore, Path]) -> None:
    # A PC its user paused and resumed stayed out of the chain the failover made without it until an admin
    # deployed again: the controller heard nothing of the resume (fleet_deploy.pcs_back waits for a registration).
    core, state = desk
    link = RegistrationLink()
    service = registered_service(core, link)

    async def looks() -> list[bool]:
        write_opt_out(state, True, "now")
        said = [await service.call_in_if_available_again(now=100.0),
                await service.call_in_if_available_again(now=110.0)]
        write_opt_out(state, False, "now")
        said += [await service.call_in_if_available_again(now=120.0),  # resumed: said once it lasted
                 await service.call_in_if_available_again(now=120.0 + CALL_IN_SETTLE_S),
                 await service.call_in_if_available_again(now=200.0)]  # said once
        return said

    assert asyncio.run(looks()) == [False, False, False, True, False]
    assert link.sent == [Register(core.agent_id, ("10.0.0.7:7431",), None)]
    assert not asyncio.run(service.tell_address_change())  # the call-in said its addresses: no AddressesChanged after


def test_a_pc_hosting_a_stage_does_not_call_in_when_its_own_inference_crosses_the_limits(
        desk: tuple[AgentCore, Path], tiny_export: Path) -> None:
    core, _ = desk
    link = RegistrationLink()
    service = registered_service(core, link)
    busy = replace(PluggedInDesktop().read(), cpu_load=0.99)
    core.monitor = SimpleNamespace(read=lambda: busy)  # type: ignore[assignment]
    core.settings = replace(core.settings, thresholds=replace(core.settings.thresholds, max_cpu_load=0.5))
    assert asyncio.run(core.unavailable_now())
    assert asyncio.run(core.takes_stages_now()) is False
    _host_tiny_stage(core, tiny_export)  # now its own inference is what keeps the CPU busy
    assert asyncio.run(core.takes_stages_now())

    async def looks() -> list[bool]:
        said = [await service.call_in_if_available_again(now=100.0)]
        assert (await core.status()).state is AgentState.UNAVAILABLE  # a survey sees it so: no spell of its own
        return [*said, await service.call_in_if_available_again(now=110.0),
                await service.call_in_if_available_again(now=200.0)]

    assert asyncio.run(looks()) == [False, False, False] and link.sent == []


def test_a_pc_whose_registration_link_is_down_leaves_it_to_its_next_registration(
        desk: tuple[AgentCore, Path]) -> None:
    core, state = desk
    service = registered_service(core, None)

    async def looks() -> list[bool]:
        write_opt_out(state, True, "now")
        await service.call_in_if_available_again(now=CALL_IN_MIN_INTERVAL_S)
        write_opt_out(state, False, "now")
        await service.call_in_if_available_again(now=2 * CALL_IN_MIN_INTERVAL_S)
        return [await service.call_in_if_available_again(now=2 * CALL_IN_MIN_INTERVAL_S + CALL_IN_SETTLE_S)]

    assert asyncio.run(looks()) == [False]  # the look that would call in, with no link to say it on


def test_a_pause_ended_between_two_looks_still_calls_in(desk: tuple[AgentCore, Path], tiny_export: Path) -> None:
    # paused and resumed within a second: the looks every 10 s never saw it paused, but the stage it gave up meanwhile
    # had a re-plan leave it out (the integration fleet's resume went unsaid)
    core, state = desk
    link = RegistrationLink()
    service = registered_service(core, link)
    _host_tiny_stage(core, tiny_export)

    async def stage_given_up() -> list[bool]:
        said = [await service.call_in_if_available_again(now=100.0)]
        write_opt_out(state, True, "now")
        await core.enforce_limits(0.0)
        write_opt_out(state, False, "later")
        return [*said, await service.call_in_if_available_again(now=110.0),
                await service.call_in_if_available_again(now=110.0 + CALL_IN_SETTLE_S)]

    assert asyncio.run(stage_given_up()) == [False, False, True]

    async def seen_paused() -> list[bool]:  # a survey's status saw it paused: a plan then may have left it out
        write_opt_out(state, True, "now")
        assert (await core.status()).state is AgentState.PAUSED
        write_opt_out(state, False, "later")
        return [await service.call_in_if_available_again(now=200.0),
                await service.call_in_if_available_again(now=200.0 + CALL_IN_SETTLE_S),
                await service.call_in_if_available_again(now=300.0)]

    assert asyncio.run(seen_paused()) == [False, True, False]
    assert len(link.sent) == 2


def test_a_pc_placed_again_before_it_called_in_still_calls_in(desk: tuple[AgentCore, Path], tiny_export: Path) -> None:
    # one model's re-plan placing it again says nothing to the runs of another model, nor to another run of this one
    # (a run keeps a PC it lost out of its re-plans until that PC calls in): its call-in is still owed
    core, state = desk
    link = RegistrationLink()
    service = registered_service(core, link)

    async def paused_and_resumed() -> list[bool]:
        write_opt_out(state, True, "now")
        said = [await service.call_in_if_available_again(now=100.0)]
        write_opt_out(state, False, "later")
        return [*said, await service.call_in_if_available_again(now=110.0)]

    async def placed() -> list[bool]:
        return [await service.call_in_if_available_again(now=110.0 + CALL_IN_SETTLE_S),
                await service.call_in_if_available_again(now=300.0)]

    assert asyncio.run(paused_and_resumed()) == [False, False]
    _host_tiny_stage(core, tiny_export)  # a re-plan placed it
    assert asyncio.run(placed()) == [True, False] and len(link.sent) == 1
