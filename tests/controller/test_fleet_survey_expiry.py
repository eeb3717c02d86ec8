"""`fleet ls` warns, after its table, of certificates that run out within pki.EXPIRY_WARNING_DAYS: an agent's (as
its link showed it during the survey), the controller's own and the fleet CA's, each with what to run."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import io
import json
from pathlib import Path

from deskfleet.agent.core import AgentCore
from deskfleet.agent.link import start_server, utc_now
from deskfleet.agent.paths import AgentSettings, Thresholds
from deskfleet.agent.shard_cache import ShardCache
from deskfleet.common import pki
from deskfleet.controller.cli import main
from deskfleet.controller.fleet_ca import init_fleet, load_ca
from deskfleet.controller.fleet_store import FleetStore, RosterEntry
from deskfleet.controller.fleet_survey import AgentView, expiry_warnings
from tests.agent.test_core import FakeMonitor
from tests.fleet_pki import make_member

DAY = datetime.timedelta(days=1)


def ls_with_one_agent(tmp_path: Path, agent_valid_days: int, controller_age_days: int,
                      *options: str, serving: bool = True) -> tuple[str, str, str]:
    """(stdout, stderr, agent id) of `fleet ls` on a fleet made `controller_age_days` ago whose one agent's
    certificate, made now, is valid for `agent_valid_days`."""
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now() - controller_age_days * DAY)
    files = make_member(load_ca(store), tmp_path / "agent", "agent", valid_days=agent_valid_days)
    settings = AgentSettings(thresholds=Thresholds(require_ac_power=False, min_free_memory_bytes=None))
    core = AgentCore(files, settings, ShardCache(tmp_path / "cache", 1 << 30), FakeMonitor())

    async def scenario() -> None:
        # listening on a port of its own choosing: one picked free beforehand may be taken before the bind (a CI
        # run's `fleet ls` waited 11 s on whatever took it and saw no agent)
        server = await start_server(core.serve_link, "127.0.0.1", 0, files)
        port = server.sockets[0].getsockname()[1]
        store.save_roster({core.agent_id: RosterEntry(core.agent_id, "pc-042", utc_now().isoformat(),
                                                      (f"127.0.0.1:{port}",))})
        async with server:
            with store.serving() if serving else contextlib.nullcontext():  # as `fleet serve` holds it
                assert await asyncio.to_thread(main, ["fleet", "ls", "--discover-seconds", "0", "--data-dir",
                                                      str(store.data_dir), *options]) == 0

    with contextlib.redirect_stdout(io.StringIO()) as stdout, contextlib.redirect_stderr(io.StringIO()) as stderr:
        asyncio.run(scenario())
    return stdout.getvalue(), stderr.getvalue(), core.agent_id


def test_fleet_ls_warns_of_an_agent_and_the_controller_certificate_running_out(tmp_path: Path) -> None:
    # Nothing said so: the admin learnt it on the day, when every link failed
    out, _, agent_id = ls_with_one_agent(tmp_path, 41, 825 - 30)
    table, _, after = out.partition("pc-042")
    assert agent_id[:12] in table and "available" in after
    warnings = [line for line in out.splitlines() if line.startswith("warning: ")]
    day = (utc_now() + 41 * DAY).date().isoformat()
    assert warnings[0] == (f"warning: agent {agent_id[:12]} (pc-042) certificate expires {day} (in 40 days): join it "
                           "again with a new token (`deskfleet fleet token`, then `deskfleet-agent join TOKEN` on it)")
    controller_day = (utc_now() + 30 * DAY).date().isoformat()
    assert warnings[1].startswith(f"warning: the controller's certificate ({tmp_path / 'controller'}/controller.pem) "
                                  f"expires {controller_day} (in 29 days): delete it, and the next fleet command "
                                  "issues it again")
    assert len(warnings) == 2 and out.splitlines()[-2:] == warnings  # after the table, the CA has 9 years to go


def test_fleet_ls_says_nothing_of_certificates_with_more_than_60_days_to_go(tmp_path: Path) -> None:
    out, _, _ = ls_with_one_agent(tmp_path, 62, 0)
    assert "pc-042" in out and "warning" not in out


def test_fleet_ls_says_no_serve_runs_even_where_every_pc_answered(tmp_path: Path) -> None:
    # it was said only beside a PC never heard from: an admin whose PCs all answered learnt at the next join
    out, _, _ = ls_with_one_agent(tmp_path, 62, 0, serving=False)
    assert "pc-042" in out
    assert out.splitlines()[-1] == (f"warning: no `deskfleet fleet serve` runs on {tmp_path / 'controller'}: agents "
                                    "cannot register with the controller, nor new PCs join; start it")


def test_fleet_ls_json_carries_each_agent_s_certificate_expiry_and_warns_on_stderr(tmp_path: Path) -> None:
    out, err, agent_id = ls_with_one_agent(tmp_path, 41, 0, "--json")
    [agent] = json.loads(out)
    expires = datetime.datetime.fromisoformat(agent["certificate_expires"])
    assert abs(expires - (utc_now() + 41 * DAY)) < datetime.timedelta(minutes=1) and expires.tzinfo is not None
    assert agent["agent_id"] == agent_id and agent["state"] == "available"  # the fields it had stay
    assert err.startswith(f"warning: agent {agent_id[:12]} (pc-042) certificate expires")


def test_expiry_warnings_name_the_fleet_ca_and_fleet_init_force(tmp_path: Path) -> None:
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    ca_expires = store.tls_files.ca_certificate().not_valid_after_utc
    now = ca_expires - 10 * DAY  # the controller's certificate ran out long before
    unreachable = AgentView("b" * 52, "pc-7", "-", ("roster",), None, "cannot reach")
    lines = expiry_warnings([unreachable], store.tls_files, now)
    assert lines[0].startswith(f"the controller's certificate ({store.tls_files.cert_path}) expired on ")
    assert lines[1] == (f"the fleet CA ({store.tls_files.ca_path}) expires {pki.expiry_date(ca_expires)} (in 10 days): "
                        "nothing renews it; before then make a new fleet with `deskfleet fleet init --force` and join "
                        "every PC to it again with a new token")
    assert len(lines) == 2  # an agent no link reached shows no date


def test_fleet_ls_warns_of_a_pc_whose_clock_is_minutes_off_the_controllers() -> None:
    # A PC whose clock was an hour behind refused the certificates of the PCs that joined within that hour: `fleet
    # ls` showed it available, and the first generation failed over twice and left it out for a "broken link"
    from types import SimpleNamespace

    from deskfleet.controller.fleet_survey import clock_warnings

    now = 1_800_000_000.0

    def pc(hostname: str, clock: float | None) -> AgentView:
        return AgentView(hostname[-1] * 52, hostname, "10.0.0.1:7431", ("registration",),
                         SimpleNamespace(clock_s=clock), None)  # type: ignore[arg-type]

    agents = [pc("pc-a", now - 3_700), pc("pc-b", now + 2.5 * 86_400), pc("pc-c", now - 120), pc("pc-d", None),
              pc("pc-e", now + 299)]
    assert clock_warnings(agents, now) == [
        "agent aaaaaaaaaaaa (pc-a)'s clock is 1.0 h behind this controller's: every PC judges certificates by its own "
        "clock, so links between it and PCs that joined within that time (or the fleet, where it is ahead) are "
        "refused as not valid yet; set the wrong clock right (NTP)",
        "agent bbbbbbbbbbbb (pc-b)'s clock is 2.5 days ahead of this controller's: every PC judges certificates by its "
        "own clock, so links between it and PCs that joined within that time (or the fleet, where it is ahead) are "
        "refused as not valid yet; set the wrong clock right (NTP)"]
