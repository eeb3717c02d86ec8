"""AgentPaths and the settings file: defaults, round trip, clear errors, atomic saves."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest

from deskfleet.agent.paths import (
    MAX_SPEED_GB_PER_S,
    AgentPaths,
    AgentSettings,
    SettingsError,
    Thresholds,
    load_settings,
    save_settings,
)
from deskfleet.common.agent_state import AgentState
from deskfleet.common.devices import device_targets
from deskfleet.common.discovery_record import AgentRecord
from deskfleet.common.wire import StatusReport


def test_data_dir_puts_everything_under_it(tmp_path: Path) -> None:
    paths = AgentPaths.resolve(tmp_path / "d")
    assert paths.settings_dir == tmp_path / "d" / "settings"
    assert paths.settings_file.parent == paths.settings_dir and paths.shard_dir.parent == paths.cache_dir
    paths.create()
    assert paths.cache_dir.is_dir() and paths.settings_dir.is_dir()
    assert stat.S_IMODE(paths.state_dir.stat().st_mode) == 0o700


@pytest.mark.parametrize("command", [["--headless"], ["join", "dfj1.x"], ["pause"], ["resume"]])
def test_a_data_dir_that_is_a_file_is_named_by_every_command(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             command: list[str]) -> None:
    # each said "[Errno 20] Not a directory" of a file inside it
    from deskfleet.agent import enroll
    from deskfleet.agent.cli import main

    data = tmp_path / "afile"
    data.write_text("")
    if command[0] == "join":
        monkeypatch.setattr(enroll, "read_join_token", lambda token: None)
    argv = ["--data-dir", str(data), *command] if command[0] == "--headless" else [command[0], *command[1:],
                                                                                  "--data-dir", str(data)]
    assert main(argv) == 2
    assert f"the agent's data dir {data} is a file, not a folder" in capsys.readouterr().err
    assert data.read_text() == ""


def test_platform_dirs_are_separate() -> None:
    paths = AgentPaths.resolve()
    assert len({paths.settings_dir, paths.state_dir, paths.cache_dir}) == 3
    assert all("deskfleet" in str(path) for path in (paths.settings_dir, paths.state_dir, paths.cache_dir))


def test_missing_file_gives_defaults_and_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "settings.json"
    assert load_settings(path) == AgentSettings()
    assert not path.exists()  # loading never writes
    settings = AgentSettings(listen_address="[::1]:9000", device="GPU", paused=True, cache_limit_bytes=123,
                             thresholds=Thresholds(require_ac_power=False, max_temperature_c=None, max_cpu_load=0.7))
    save_settings(path, settings)
    assert load_settings(path) == settings
    assert settings.policy().paused and settings.policy().max_cpu_load == 0.7


@pytest.mark.parametrize(("body", "message"), [
    ("{not json", "not valid JSON"),
    ("[]", "JSON object"),
    ('{"format_version": 99}', "format_version 99"),
    ('{"format_version": 1, "colour": "red"}', "unknown field.*colour"),
    # in JSON's words, not Python's ("must be float | None, got '80'")
    ('{"format_version": 1, "paused": "yes"}', "'paused' must be true or false, got \"yes\""),
    ('{"format_version": 1, "cache_limit_bytes": true}', "'cache_limit_bytes' must be a whole number, got true"),
    ('{"format_version": 1, "cache_limit_bytes": 1500000000.5}', "'cache_limit_bytes' must be a whole number, got "
                                                          "1500000000.5"),
    ('{"format_version": 1, "thresholds": {"max_temperature_c": "80"}}', "'max_temperature_c' must be a number, or "
                                                                         "null for none, got \"80\""),
    ('{"format_version": 1, "cache_limit_bytes": 1e300}', r"'cache_limit_bytes' must be a whole number, got 1e\+300 "
                                                          r"\(too large\)"),
    ('{"format_version": 1, "device": 7}', "'device' must be a string in quotes, got 7"),
    ('{"format_version": 1, "paused": "é"}', "'paused' must be true or false, got \"é\""),
    ('{"format_version": 1, "cache_limit_bytes": 0}', "cache_limit_bytes must be positive"),
    ('{"format_version": 1, "listen_address": "nowhere:port"}', "listen_address"),
    ('{"format_version": 1, "listen_address": " "}', "listen_address"),
    ('{"format_version": 1, "listen_address": "bad host"}', "listen_address: address 'bad host' is not host:port"),
    ('{"format_version": 1, "thresholds": {"min_battery_percent": 150}}', "min_battery_percent"),
    ('{"format_version": 1, "thresholds": {"max_temperature_c": "hot"}}', "thresholds.*max_temperature_c"),
    ('{"format_version": true}', "format_version True"),
    ('{"format_version": 1, "device": "AUTO:GPU,"}', "device"),
])
def test_bad_files_are_rejected_by_name_and_kept(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "settings.json"
    path.write_text(body)
    with pytest.raises(SettingsError, match=message) as caught:
        load_settings(path)
    assert str(path) in str(caught.value)
    assert path.read_text() == body


@pytest.mark.parametrize(("given", "taken"), [("127.0.0.1", "127.0.0.1:7431"), ("[::1]", "[::1]:7431"),
                                             ("pc-7", "pc-7:7431"), ("10.0.0.5:9000", "10.0.0.5:9000")])
def test_a_listen_address_of_a_host_alone_takes_the_agents_usual_port_as_listen_does(tmp_path: Path, given: str,
                                                                                     taken: str) -> None:
    # `--listen 127.0.0.1` was taken, the same in the settings refused as "not host:port"
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"format_version": 1, "listen_address": given}))
    assert load_settings(path).listen_address == taken


def test_a_size_written_with_an_exponent_is_a_whole_number(tmp_path: Path) -> None:
    # 5e10 bytes, as a person may write a size, is a float to JSON: it was refused as "must be int"
    path = tmp_path / "settings.json"
    path.write_text('{"format_version": 1, "cache_limit_bytes": 5e10}')
    settings = load_settings(path)
    assert settings.cache_limit_bytes == 50_000_000_000 and isinstance(settings.cache_limit_bytes, int)


def test_failed_save_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "settings.json"
    save_settings(path, AgentSettings(device="NPU"))

    def crash(source: str, target: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        save_settings(path, AgentSettings(device="GPU"))
    monkeypatch.undo()
    assert load_settings(path).device == "NPU"
    assert os.listdir(tmp_path) == ["settings.json"]  # no temp file left behind
    assert json.loads(path.read_text())["format_version"] == 1


def test_pinned_speed_must_be_positive() -> None:
    import json as _json

    from deskfleet.agent.paths import AgentSettings, SettingsError

    body = _json.loads(AgentSettings().to_json())
    assert AgentSettings.from_json(_json.dumps({**body, "speed_gb_per_s": 12.5})).speed_gb_per_s == 12.5
    with pytest.raises(SettingsError, match="speed_gb_per_s must be positive"):
        AgentSettings.from_json(_json.dumps({**body, "speed_gb_per_s": 0}))


@pytest.mark.parametrize(("body", "message"), [
    ('{"format_version": 1, "thresholds": {"max_temperature_c": NaN}}', "NaN is not a JSON number"),
    ('{"format_version": 1, "thresholds": {"max_temperature_c": -300}}', "max_temperature_c must be within"),
    ('{"format_version": 1, "thresholds": {"release_stages_after_s": -5}}', "release_stages_after_s must be within"),
    ('{"format_version": 1, "thresholds": {"max_temperature_c": 1e400}}', "'max_temperature_c' must be a finite"),
    ('{"format_version": 1, "thresholds": {"max_cpu_load": -Infinity}}', "-Infinity is not a JSON number"),
    ('{"format_version": 1, "speed_gb_per_s": Infinity}', "Infinity is not a JSON number"),
    ('{"format_version": 1, "speed_gb_per_s": NaN}', "NaN is not a JSON number"),
    ('{"format_version": 1, "speed_gb_per_s": 2e5}', "speed_gb_per_s must be positive and below 100000"),
    ('{"format_version": 1, "speed_gb_per_s": -1e400}', "'speed_gb_per_s' must be a finite"),
    ('{"format_version": 1, "cache_limit_bytes": 1' + "0" * 5000 + "}", "not valid JSON"),
    ('{"format_version": 1, "device": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
])
def test_numbers_the_agent_would_trip_over_are_refused(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "settings.json"
    path.write_text(body)
    with pytest.raises(SettingsError, match=message) as caught:
        load_settings(path)
    assert str(path) in str(caught.value)


def test_a_pinned_speed_is_one_a_status_report_carries() -> None:
    body = {"format_version": 1, "speed_gb_per_s": MAX_SPEED_GB_PER_S * 0.999}
    speed = AgentSettings.from_json(json.dumps(body)).speed_gb_per_s
    StatusReport(AgentState.AVAILABLE, 0, 0.0, None, None, None, None, (), None, weight_gb_per_s=speed)


@pytest.mark.parametrize(("device", "targets"), [
    ("CPU", ("CPU",)), ("GPU.1", ("GPU.1",)), ("NPU", ("NPU",)), ("AUTO", ("AUTO",)),
    ("AUTO:GPU,CPU", ("GPU", "CPU")), ("HETERO:GPU,CPU", ("GPU", "CPU")), ("MULTI:GPU.0,GPU.1.0", ("GPU.0", "GPU.1.0")),
    ("AUTO:-NPU", ("AUTO",)), ("AUTO:GPU,-CPU", ("GPU",)), ("MULTI:GPU(4),CPU(2),GPU", ("GPU", "CPU")),
    ("BATCH:CPU(4)", ("CPU",)), ("BATCH:GPU", ("GPU",)),  # the automatic batching device: OpenVINO compiles both
])
def test_openvino_devices_load_and_advertise_their_targets(tmp_path: Path, device: str,
                                                           targets: tuple[str, ...]) -> None:
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"format_version": 1, "device": device}))
    assert load_settings(path).device == device
    assert device_targets(device) == targets
    record = AgentRecord("a" * 52, "0123456789abcdef", "0.1.0", targets, 0, AgentState.AVAILABLE)
    assert AgentRecord.from_txt(record.to_txt()) == record


@pytest.mark.parametrize("device", [
    "", "cpu", " CPU", "CPU:GPU", "GPU,CPU", "AUTO:", "AUTO:GPU,", "AUTO:HETERO:GPU,CPU", "AUTO:MULTI",
    "AUTO.1", "HETERO:gpu", "GPU.", "GPU..1", "X" * 33, "AUTO:" + "X" * 33, "AUTO:GPU(x)", "CPU;rm",
])
def test_a_device_openvino_would_not_read_is_refused_by_name(tmp_path: Path, device: str) -> None:
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"format_version": 1, "device": device}))
    with pytest.raises(SettingsError, match=f"{path}: device: ") as caught:
        load_settings(path)
    assert repr(device) in str(caught.value)


def test_a_hand_written_file_may_leave_the_format_version_out() -> None:
    # README lists every field as optional; an admin writing {"device": "GPU"} got "format_version None"
    settings = AgentSettings.from_json('{"device": "GPU", "thresholds": {"release_stages_after_s": 60}}')
    assert settings.device == "GPU" and settings.thresholds.release_stages_after_s == 60
    assert settings.thresholds.max_temperature_c == 90.0  # the rest are the defaults


def test_a_file_saved_with_a_utf8_bom_is_read(tmp_path: Path) -> None:
    # Windows PowerShell 5.1's `Set-Content -Encoding UTF8` and older Notepad write one; json refused it
    # ("Unexpected UTF-8 BOM"), so an admin's script pushing the file left every agent unable to start
    path = tmp_path / "settings.json"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"format_version": 1, "device": "GPU"}')
    assert load_settings(path).device == "GPU"
    save_settings(path, AgentSettings(device="NPU"))
    assert not path.read_bytes().startswith(b"\xef\xbb\xbf")  # what the agent writes stays plain UTF-8


@pytest.mark.parametrize(("body", "field"), [
    ('{"device": "CPU", "device": "GPU"}', "device"),
    ('{"format_version": 1, "format_version": 1}', "format_version"),  # twice the same value is refused too
    ('{"thresholds": {"max_temperature_c": 80, "require_ac_power": false, "max_temperature_c": 95}}',
     "max_temperature_c"),
])
def test_a_field_written_twice_is_refused_by_name(tmp_path: Path, body: str, field: str) -> None:
    # json keeps the last silently; the admin who added the second may be reading the first
    path = tmp_path / "settings.json"
    path.write_text(body)
    with pytest.raises(SettingsError) as caught:
        load_settings(path)
    assert str(caught.value) == f"settings file {path} has the field {field!r} twice; keep the one you mean"


def test_a_file_saved_as_utf16_is_read_and_an_empty_one_is_named(tmp_path: Path) -> None:
    # PowerShell 5.1's `>` and Out-File write UTF-16 with a BOM: "'utf-8' codec can't decode byte 0xff"; an empty
    # file was "not valid JSON: Expecting value: line 1 column 1 (char 0)"
    path = tmp_path / "settings.json"
    for encoding in ("utf-16", "utf-16-le", "utf-16-be", "utf-32"):  # utf-16 / utf-32: with this host's BOM
        bom = {"utf-16-le": b"\xff\xfe", "utf-16-be": b"\xfe\xff"}.get(encoding, b"")
        path.write_bytes(bom + '{"format_version": 1, "device": "GPU"}'.encode(encoding))
        assert load_settings(path).device == "GPU"
    path.write_bytes('{"device": "GPU"}'.encode("utf-16-le"))  # no BOM
    with pytest.raises(SettingsError, match=r"holds NUL bytes, so it is not UTF-8 text \(UTF-16 without a byte order "
                                            r"mark\?\): save it as UTF-8$"):
        load_settings(path)
    for empty in (b"", b" \n", b"\xef\xbb\xbf"):
        path.write_bytes(empty)
        with pytest.raises(SettingsError, match=rf"^settings file {re.escape(str(path))} is empty: write a JSON "
                                                r"object in it \({} for the defaults\), or delete it$"):
            load_settings(path)
    path.write_bytes(b'{"device": "\xe9"}')  # Latin-1
    with pytest.raises(SettingsError, match=r"is not UTF-8 text \(invalid continuation byte at byte 12\): save it "
                                            "as UTF-8$"):
        load_settings(path)
