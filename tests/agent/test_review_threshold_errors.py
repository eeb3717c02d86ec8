"""A threshold out of range is refused naming it as the file spells it: `thresholds.<field>`."""

from __future__ import annotations

import pytest

from deskfleet.agent.paths import AgentSettings, SettingsError


@pytest.mark.parametrize(("body", "named"), [
    ('{"thresholds": {"max_temperature_c": -300}}', "thresholds.max_temperature_c must be within"),
    ('{"thresholds": {"min_battery_percent": 150}}', "thresholds.min_battery_percent must be within"),
    ('{"thresholds": {"max_cpu_load": 2}}', "thresholds.max_cpu_load must be within"),
    ('{"thresholds": {"max_igpu_busy": 2}}', "thresholds.max_igpu_busy must be within"),
    ('{"thresholds": {"min_free_memory_bytes": -1}}', "thresholds.min_free_memory_bytes must be >= 0"),
    ('{"thresholds": {"release_stages_after_s": 7200}}', "thresholds.release_stages_after_s must be within"),
])
def test_an_out_of_range_threshold_is_named_with_its_prefix(body: str, named: str) -> None:
    with pytest.raises(SettingsError) as caught:
        AgentSettings.from_json(body, source="settings file S")
    assert str(caught.value).startswith(f"settings file S: {named}")
