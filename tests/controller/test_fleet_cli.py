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
    printed = capsys.readouterr()
    token = join_tokens.decode_join_token(printed.out)
    # the way that keeps the token out of the PC's process list and shell history: it said `join TOKEN`
    assert "on the PC run: deskfleet-agent join - (then paste the token)" in printed.err
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


@pytest.mark.parametrize(("arguments", "message"), [
    (["--layers", "450000000", "--layer-bytes", "80"], "argument --layers: must be at most 10000"),  # swapped
    (["--layers", "4", "--layer-bytes", "1e9", "--device", "cpu"], "'cpu' is not an OpenVINO device name"),
    (["--layers", "4", "--layer-bytes", "1e9", "--device", "GPU,CPU"], "not an OpenVINO device name"),
])
def test_a_plan_refuses_at_once_what_would_hang_or_fail_on_the_agents(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], arguments: list[str], message: str) -> None:
    # 10^8 layers filled the memory for minutes; a mistyped device was caught by the agents after every shard
    # had been sent (deploy takes the same --device)
    with pytest.raises(SystemExit) as exit_:
        main(["fleet", "plan", *arguments, "--assume-agent", "8e9", "--data-dir", str(tmp_path / "ctl")])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["fleet", "deploy", "--model", str(tmp_path), "--device", "cpu", "--data-dir", str(tmp_path / "ctl")])
    assert "'cpu' is not an OpenVINO device name" in capsys.readouterr().err


def test_a_plan_refuses_what_it_would_ignore_or_deploy_would_refuse(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_export: Path) -> None:
    plan = ["fleet", "plan", "--assume-agent", "8e9", "--data-dir", str(tmp_path / "ctl")]
    # on-paper sizes beside an export were ignored: the plan was the export's, and said nothing
    assert main([*plan, "--model", str(tiny_export), "--context", "99999", "--layers", "3"]) == 2
    error = capsys.readouterr().err
    assert "--layers, --context describe a model on paper: leave them out with --model" in error
    # a plan of an f32 deploy with a u8 cache looked fine; the deploy refused it
    assert main([*plan, "--layers", "4", "--layer-bytes", "1e6", "--precision", "f32", "--kv-cache", "u8"]) == 2
    assert ("--precision f32 is exact and keeps the KV cache in f32, not u8: leave out --kv-cache, or give "
            "--precision device_default for a u8 cache") in capsys.readouterr().err  # fleet plan has no fast
    assert main([*plan, "--model", str(tiny_export), "--device", "AUTO:GPU,CPU"]) == 0
    assert main([*plan, "--layers", "4", "--layer-bytes", "1e6", "--context", "4096"]) == 0


def test_fleet_generate_refuses_no_new_tokens_naming_the_option(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    # it blamed the prompt: "--prompt-ids 1: max_new_tokens must be at least 1, got 0"
    with pytest.raises(SystemExit):
        main(["fleet", "generate", "--model", str(tmp_path), "--prompt-ids", "1", "--max-new-tokens", "0"])
    assert "argument --max-new-tokens/--new-tokens: must be 1 or more, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["plan", "deploy"])
def test_no_streams_is_refused_naming_the_option(command: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # it said "streams must be at least 1, got 0", naming no option
    with pytest.raises(SystemExit):
        main(["fleet", command, "--model", str(tmp_path), "--streams", "0"])
    assert "argument --streams: must be 1 or more, got 0" in capsys.readouterr().err


def test_init_refuses_a_fleet_name_the_ca_cannot_carry_before_making_anything(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fleet", "init", "--name", "x" * 65, "--address", "10.0.0.5:1", "--data-dir",
                 str(tmp_path / "ctl")]) == 2
    assert "a fleet name must be 1 to 64 characters" in capsys.readouterr().err
    assert not (tmp_path / "ctl").exists()


@pytest.mark.parametrize(("address", "says"), [("bad address", "--address: address 'bad address' is not host:port"),
                                               ("pc-7:99999", "--address: address 'pc-7:99999' has no port")])
def test_init_names_a_bad_address_as_given_before_making_anything(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                  address: str, says: str) -> None:
    # the error quoted 'bad address:7341', with the port it had added
    assert main(["fleet", "init", "--address", address, "--data-dir", str(tmp_path / "ctl")]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "ctl").exists()


def test_fleet_serve_names_a_bad_listen_address_as_given(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = ["--data-dir", str(tmp_path / "ctl")]
    assert main(["fleet", "init", "--address", "127.0.0.1:7341", *data]) == 0
    capsys.readouterr()
    assert main(["fleet", "serve", "--listen", "bad host", *data]) == 2
    assert "--listen: address 'bad host' is not host:port" in capsys.readouterr().err  # not 'bad host:7341'


def test_a_deploy_the_fleet_cannot_take_exits_1_and_a_usage_error_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_export: Path) -> None:
    # every failed deploy exited 2, a usage error's status: a script could not tell a typo from a PC that failed
    data = ["--data-dir", str(tmp_path / "ctl"), "--discover-seconds", "0"]
    assert main(["fleet", "init", "--address", "127.0.0.1:1", "--data-dir", str(tmp_path / "ctl")]) == 0
    capsys.readouterr()
    assert main(["fleet", "deploy", "--model", str(tiny_export), *data]) == 1  # no PC to take it
    assert "no agents in the fleet" in capsys.readouterr().err
    assert main(["fleet", "deploy", "--model", str(tmp_path), *data]) == 2  # not an export
    assert "manifest.json" in capsys.readouterr().err
    import shutil

    damaged = shutil.copytree(tiny_export, tmp_path / "damaged")
    layer = damaged / "layer_001.bin"
    layer.write_bytes(bytes(reversed(layer.read_bytes())))
    assert main(["fleet", "deploy", "--model", str(damaged), *data]) == 2  # the export's fault: every file hashed
    assert f"{layer} is corrupted" in capsys.readouterr().err


def test_a_deploy_stopped_by_ctrl_c_says_what_it_left(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # it exited 130 without a word: whether anything was lost, or half deployed, was left to guess
    import deskfleet.controller.fleet_deploy as fleet_deploy

    async def ctrl_c(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(fleet_deploy, "deploy", ctrl_c)
    assert main(["fleet", "init", "--address", "127.0.0.1:1", "--data-dir", str(tmp_path / "ctl")]) == 0
    capsys.readouterr()
    assert main(["fleet", "deploy", "--model", str(tiny_export), "--data-dir", str(tmp_path / "ctl"),
                 "--discover-seconds", "0"]) == 130
    assert capsys.readouterr().err == (
        "deskfleet: deploy stopped by Ctrl-C: the files the PCs received stay in their caches, and the next "
        "`deskfleet fleet deploy` sends only the rest; the model's deployment on record is the one before (it is "
        "written once every stage is ready), and the PCs were asked to release the stages this deploy gave them\n")


@pytest.mark.parametrize(("again", "note"), [
    ([], "note: deployed with other settings than the deployment before it: --policy all_by_speed -> default, "
         "--hop-ms 0 -> default, --precision f32 -> default (a deploy takes no option from the one before: give them "
         "again to keep them)\n"),
    (["--policy", "all_by_speed", "--hop-ms", "0", "--precision", "f32"], ""),
])
def test_a_deploy_with_other_settings_than_the_one_before_says_what_changed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_export: Path, monkeypatch: pytest.MonkeyPatch,
        again: list[str], note: str) -> None:
    # run again with fewer options, a deploy re-planned with the defaults (f32 became device_default) without a word
    import deskfleet.controller.fleet_deploy as fleet_deploy
    from deskfleet.common.planner import PlanPolicy
    from deskfleet.common.wire import Precision
    from deskfleet.controller.fleet_deploy import DeployReport, DeploySettings, StagePlacement, model_id_of
    from deskfleet.controller.fleet_store import FleetStore

    store = FleetStore(tmp_path / "ctl")
    report = DeployReport(model_id_of(tiny_export), (StagePlacement("a" * 52, "127.0.0.1:2", 0, 4),), {}, {})

    async def deployed(store: FleetStore, model: Path, found: object, options: object, precision: Precision,
                       device: str, *args: object, **kwargs: object) -> tuple[object, DeployReport]:
        settings = DeploySettings(options.policy, options.streams, precision, device,  # type: ignore[attr-defined]
                                  kwargs.get("kv_cache"), options.hop_cost)  # type: ignore[attr-defined, arg-type]
        fleet_deploy._save_deployment(store, model, report, settings)
        return None, report

    assert main(["fleet", "init", "--address", "127.0.0.1:1", "--data-dir", str(store.data_dir)]) == 0
    fleet_deploy._save_deployment(store, tiny_export, report, DeploySettings(PlanPolicy.ALL_BY_SPEED, 1, Precision.F32,
                                                                             hop_cost=0.0))
    monkeypatch.setattr(fleet_deploy, "deploy", deployed)
    capsys.readouterr()
    assert main(["fleet", "deploy", "--model", str(tiny_export), "--data-dir", str(store.data_dir),
                 "--discover-seconds", "0", "--json", *again]) == 0
    assert capsys.readouterr().err == note


def test_a_token_warns_of_a_long_life_and_of_no_fleet_serve(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    # `--ttl 400d` was taken without a word, and a token made while no `fleet serve` ran gave joins that failed
    from deskfleet.controller.fleet_store import FleetStore

    data = ["--data-dir", str(tmp_path / "ctl")]
    assert main(["fleet", "init", "--address", "127.0.0.1:7341", *data]) == 0
    capsys.readouterr()
    assert main(["fleet", "token", "--ttl", "400d", *data]) == 0
    err = capsys.readouterr().err
    assert "warning: this token lets whoever holds it join 1 PC(s) for 400 days: keep it as a password" in err
    assert f"warning: no `deskfleet fleet serve` runs on {tmp_path / 'ctl'}: a PC can join only while it runs" in err
    with FleetStore(tmp_path / "ctl").serving():  # as `fleet serve` holds it
        assert main(["fleet", "token", *data]) == 0
        assert "warning" not in capsys.readouterr().err
        assert main(["fleet", "token", "--uses", "101", *data]) == 0  # a token for any number of PCs: no word
        assert "warning: this token lets whoever holds it join 101 PCs: keep it as a password" in \
            capsys.readouterr().err
        assert main(["fleet", "token", "--uses", "99999999999999999999", *data]) == 2
        assert "--uses must be from 1 to 100,000 PCs, got 99999999999999999999" in capsys.readouterr().err


def test_deploy_settings_name_the_options_that_make_them() -> None:
    from deskfleet.common.planner import PlanPolicy
    from deskfleet.common.wire import Precision
    from deskfleet.controller.fleet_deploy import DeploySettings

    assert DeploySettings().command_options() == ""
    assert DeploySettings(hop_cost=0.0).options_given() == {}  # the fewest agents' plan prices no hop
    fast = DeploySettings(PlanPolicy.ALL_BY_SPEED, 2, Precision.F32, "GPU.1", "f32", hop_cost=2.5e6)
    assert fast.command_options() == (" --policy all_by_speed --streams 2 --device GPU.1 --hop-ms 2.5 --precision f32 "
                                      "--kv-cache f32")
    assert DeploySettings().changes_from(fast) == ["--policy all_by_speed -> default", "--streams 2 -> default",
                                                   "--device GPU.1 -> default", "--hop-ms 2.5 -> default",
                                                   "--precision f32 -> default", "--kv-cache f32 -> default"]


def test_a_token_for_addresses_that_are_not_this_pcs_is_warned_of(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # a controller moved to another address kept fleet.json's old one, and new tokens named it without a word
    data = ["--data-dir", str(tmp_path / "ctl")]
    assert main(["fleet", "init", "--address", "198.51.100.77:7341", *data]) == 0  # TEST-NET-2: no PC's
    capsys.readouterr()
    assert main(["fleet", "token", *data]) == 0
    assert ("warning: the token's controller address(es) (198.51.100.77:7341) are not this PC's: a PC joins only if "
            "one reaches this controller; moved, give --address HOST:PORT") in capsys.readouterr().err
    assert main(["fleet", "token", "--address", "127.0.0.1:7341", *data]) == 0
    assert "are not this PC's" not in capsys.readouterr().err
    # every loopback address is this PC's, though an interface lists only 127.0.0.1 (a fleet of one machine's
    # addresses, as the README's tests run, was warned of)
    assert main(["fleet", "token", "--address", "127.0.0.58:7341", *data]) == 0
    assert "are not this PC's" not in capsys.readouterr().err


@pytest.mark.parametrize(("addresses", "listen"), [
    (("127.0.0.1:7400",), "127.0.0.1:7400"), (("[::1]:7401", "localhost:7401"), "[::1]:7401"),
    (("10.0.0.5:7402",), "0.0.0.0:7402"), (("127.0.0.1:7403", "controller-pc:7403"), "0.0.0.0:7403"),
])
def test_fleet_serve_listens_on_loopback_alone_for_a_fleet_kept_on_this_pc(addresses: tuple[str, ...],
                                                                          listen: str) -> None:
    # after `fleet init --address 127.0.0.1:PORT` it listened on every interface: a port opened to the LAN that no
    # agent of such a fleet (all on this PC) uses
    from deskfleet.controller.fleet_cli import _default_listen

    assert _default_listen(addresses, int(addresses[0].rsplit(":", 1)[1])) == listen
