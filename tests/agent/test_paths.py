"""AgentPaths and the settings file: defaults, round trip, clear errors, atomic saves."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from deskfleet.agent.paths import AgentPaths, AgentSettings, SettingsError, Thresholds, load_settings, save_settings


def test_data_dir_puts_everything_under_it(tmp_path: Path) -> None:
    paths = AgentPaths.resolve(tmp_path / "d")
    assert paths.settings_dir == tmp_path / "d" / "settings"
    assert paths.settings_file.parent == paths.settings_dir and paths.shard_dir.parent == paths.cache_dir
    paths.create()
    assert paths.cache_dir.is_dir() and paths.settings_dir.is_dir()
    assert stat.S_IMODE(paths.state_dir.stat().st_mode) == 0o700


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
    ('{"format_version": 1, "paused": "yes"}', "'paused' must be bool"),
    ('{"format_version": 1, "cache_limit_bytes": true}', "'cache_limit_bytes' must be int"),
    ('{"format_version": 1, "cache_limit_bytes": 0}', "cache_limit_bytes must be positive"),
    ('{"format_version": 1, "listen_address": "nowhere"}', "listen_address"),
    ('{"format_version": 1, "thresholds": {"min_battery_percent": 150}}', "min_battery_percent"),
    ('{"format_version": 1, "thresholds": {"max_temperature_c": "hot"}}', "thresholds.*max_temperature_c"),
])
def test_bad_files_are_rejected_by_name_and_kept(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "settings.json"
    path.write_text(body)
    with pytest.raises(SettingsError, match=message) as caught:
        load_settings(path)
    assert str(path) in str(caught.value)
    assert path.read_text() == body


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
