"""Battery and AC on Linux come from the PC's own power supplies, all of them, never a peripheral's."""

from __future__ import annotations

from pathlib import Path

import pytest

from deskfleet.agent.monitor import HostMonitor, HostProbes, read_power_supply
from deskfleet.common.agent_state import AgentState
from deskfleet.common.availability import AvailabilityPolicy, decide_availability


def supply(root: Path, name: str, **files: str) -> None:
    folder = root / "class/power_supply" / name
    folder.mkdir(parents=True, exist_ok=True)
    for key, value in files.items():
        (folder / key).write_text(value + "\n")


def host(root: Path) -> HostMonitor:
    probes = HostProbes(cpu_load=lambda: 0.1, memory=lambda: (8 << 30, 16 << 30))  # battery: the platform's
    return HostMonitor(sysfs_root=root, proc_root=root / "proc", platform="linux", probes=probes)


def test_a_desktop_with_a_wireless_mouse_is_not_on_battery(tmp_path: Path) -> None:
    supply(tmp_path, "hidpp_battery_0", type="Battery", scope="Device", capacity="30", status="Discharging")
    reading = host(tmp_path).read()
    assert (reading.battery_percent, reading.on_ac_power) == (None, None)
    assert decide_availability(reading, AvailabilityPolicy(), serving=False).state is AgentState.AVAILABLE


def test_two_batteries_count_together_by_their_charge(tmp_path: Path) -> None:
    supply(tmp_path, "AC", type="Mains", online="0")
    supply(tmp_path, "BAT0", type="Battery", energy_now="2000000", energy_full="20000000", status="Unknown")
    supply(tmp_path, "BAT1", type="Battery", energy_now="54000000", energy_full="60000000", status="Discharging")
    assert read_power_supply(tmp_path) == (pytest.approx(70.0), False)  # not BAT0's 10%


def test_an_adapter_named_adp1_is_seen(tmp_path: Path) -> None:
    supply(tmp_path, "ADP1", type="Mains", online="1")
    supply(tmp_path, "BAT0", type="Battery", charge_now="1600000", charge_full="4000000", status="Not charging")
    reading = host(tmp_path).read()
    assert (reading.battery_percent, reading.on_ac_power) == (pytest.approx(40.0), True)
    assert decide_availability(reading, AvailabilityPolicy(), serving=False).state is AgentState.AVAILABLE


def test_a_usb_c_charger_counts_as_ac(tmp_path: Path) -> None:
    supply(tmp_path, "ucsi-source-psy-USBC000:001", type="USB", online="1")
    supply(tmp_path, "ucsi-source-psy-USBC000:002", type="USB", online="0")
    supply(tmp_path, "BAT0", type="Battery", capacity="80", status="Charging")
    assert read_power_supply(tmp_path) == (80.0, True)


def test_status_decides_when_no_adapter_is_exposed(tmp_path: Path) -> None:
    supply(tmp_path, "BAT0", type="Battery", capacity="65", status="Discharging")
    assert read_power_supply(tmp_path) == (65.0, False)
    supply(tmp_path, "BAT0", status="Full")
    assert read_power_supply(tmp_path) == (65.0, True)
    supply(tmp_path, "BAT0", status="")
    assert read_power_supply(tmp_path) == (65.0, None)


def test_odd_battery_files_read_unknown_not_zero(tmp_path: Path) -> None:
    supply(tmp_path, "BAT0", type="Battery", energy_now="5000", energy_full="0", status="Discharging")
    assert read_power_supply(tmp_path) == (None, False)  # psutil: 0% (a division by zero read as empty)
    supply(tmp_path, "BAT0", capacity="47")
    assert read_power_supply(tmp_path) == (47.0, False)
    supply(tmp_path, "BAT0", energy_now="", energy_full="garbage", capacity="")
    assert read_power_supply(tmp_path) == (None, False)


def test_an_empty_bay_and_mixed_units(tmp_path: Path) -> None:
    supply(tmp_path, "BAT0", type="Battery", charge_now="1000", charge_full="4000", status="Discharging")
    supply(tmp_path, "BAT1", type="Battery", present="0", capacity="0")
    assert read_power_supply(tmp_path) == (25.0, False)
    supply(tmp_path, "BAT2", type="Battery", energy_now="7500", energy_full="10000")
    assert read_power_supply(tmp_path) == (50.0, False)  # units differ: the mean of 25% and 75%


def test_no_power_supply_class_is_no_battery(tmp_path: Path) -> None:
    assert read_power_supply(tmp_path) is None
    supply(tmp_path, "AC", type="Mains", online="1")
    assert read_power_supply(tmp_path) is None  # a desktop: no battery, as psutil says
