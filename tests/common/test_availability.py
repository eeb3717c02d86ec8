"""decide_availability: precedence, each limit, and unknown sensors never counting against an agent."""

from __future__ import annotations

import itertools
import random

import pytest

from deskfleet.common.agent_state import AgentState, UnavailableReason
from deskfleet.common.availability import (
    CALL_IN_MIN_INTERVAL_S,
    CALL_IN_SETTLE_S,
    GIB,
    AvailabilityPolicy,
    CallInWatch,
    MonitorReading,
    StageReleaseWatch,
    TemperatureReading,
    decide_availability,
)


def reading(**overrides: object) -> MonitorReading:
    fields: dict[str, object] = dict(cpu_load=0.1, memory_free_bytes=8 * GIB, memory_total_bytes=16 * GIB,
                                     battery_percent=None, on_ac_power=None, temperatures=(), igpu_busy=None)
    fields.update(overrides)
    return MonitorReading(**fields)  # type: ignore[arg-type]


def test_desktop_with_unknown_sensors_is_available() -> None:
    result = decide_availability(reading(), AvailabilityPolicy(), serving=False)
    assert (result.state, result.reasons, result.detail, result.reason) == (AgentState.AVAILABLE, (), "", None)


def test_serving_when_stages_are_hosted() -> None:
    assert decide_availability(reading(), AvailabilityPolicy(), serving=True).state is AgentState.SERVING


def test_unplugged_laptop_is_on_battery_when_ac_required() -> None:
    result = decide_availability(reading(battery_percent=95.0, on_ac_power=False), AvailabilityPolicy(), False)
    assert result.state is AgentState.UNAVAILABLE
    assert result.reasons == (UnavailableReason.ON_BATTERY,)
    assert result.detail == "battery 95%, unplugged (require_ac_power)"


def test_battery_threshold_when_ac_not_required() -> None:
    policy = AvailabilityPolicy(require_ac_power=False, min_battery_percent=40.0)
    assert decide_availability(reading(battery_percent=60.0, on_ac_power=False), policy, False).reasons == ()
    low = decide_availability(reading(battery_percent=30.0, on_ac_power=False), policy, False)
    assert low.reasons == (UnavailableReason.ON_BATTERY,)
    # Plugged in: a low charge is charging, not draining.
    assert decide_availability(reading(battery_percent=10.0, on_ac_power=True), policy, False).reasons == ()
    # Power source unknown but charge low: the low charge is the evidence.
    unknown = decide_availability(reading(battery_percent=10.0, on_ac_power=None), policy, False)
    assert unknown.reasons == (UnavailableReason.ON_BATTERY,)
    assert unknown.detail == "battery 10%, power source unknown (min_battery_percent 40)"


def test_too_hot_names_the_hottest_sensor() -> None:
    sensors = (TemperatureReading("acpitz/temp1", 50.0), TemperatureReading("coretemp/Package id 0", 97.4))
    result = decide_availability(reading(temperatures=sensors), AvailabilityPolicy(max_temperature_c=90.0), False)
    assert result.reasons == (UnavailableReason.TOO_HOT,)
    assert result.detail == "coretemp/Package id 0 97 °C (max_temperature_c 90)"


def test_low_memory_and_user_busy_and_all_reasons_in_fixed_order() -> None:
    policy = AvailabilityPolicy(max_cpu_load=0.5)
    hot = (TemperatureReading("cpu", 120.0),)
    result = decide_availability(
        reading(memory_free_bytes=GIB, on_ac_power=False, battery_percent=20.0, temperatures=hot, cpu_load=0.9),
        policy, serving=True)
    assert result.state is AgentState.UNAVAILABLE
    assert result.reasons == (UnavailableReason.ON_BATTERY, UnavailableReason.TOO_HOT,
                              UnavailableReason.LOW_MEMORY, UnavailableReason.USER_BUSY)
    assert result.detail.count(";") == 3
    assert "GiB free of 16.0 (min_free_memory_bytes 2.0 GiB)" in result.detail  # the setting it fell under


def test_a_busy_igpu_is_the_user_busy_when_its_limit_is_set_and_never_when_unknown() -> None:
    policy = AvailabilityPolicy(max_igpu_busy=0.5)
    busy = decide_availability(reading(igpu_busy=0.85), policy, serving=False)
    assert (busy.state, busy.reasons, busy.detail) == (AgentState.UNAVAILABLE, (UnavailableReason.USER_BUSY,),
                                                       "iGPU 85% busy (max_igpu_busy 50%)")
    assert decide_availability(reading(igpu_busy=0.3), policy, False).state is AgentState.AVAILABLE
    assert decide_availability(reading(igpu_busy=None), policy, False).state is AgentState.AVAILABLE
    assert decide_availability(reading(igpu_busy=1.0), AvailabilityPolicy(), False).state is AgentState.AVAILABLE
    both = decide_availability(reading(igpu_busy=0.9, cpu_load=0.95), AvailabilityPolicy(max_cpu_load=0.8,
                                                                                          max_igpu_busy=0.5), False)
    assert both.reasons == (UnavailableReason.USER_BUSY,)
    assert both.detail == "CPU 95% busy (max_cpu_load 80%), iGPU 90% busy (max_igpu_busy 50%)"


def test_paused_wins_and_still_lists_reasons() -> None:
    result = decide_availability(reading(memory_free_bytes=0), AvailabilityPolicy(paused=True), serving=True)
    assert result.state is AgentState.PAUSED
    assert result.reasons == (UnavailableReason.LOW_MEMORY,)


def test_disabled_thresholds_are_not_checked() -> None:
    policy = AvailabilityPolicy(require_ac_power=False, min_battery_percent=None, max_temperature_c=None,
                                min_free_memory_bytes=None)
    result = decide_availability(reading(on_ac_power=False, battery_percent=1.0, memory_free_bytes=0,
                                         temperatures=(TemperatureReading("x", 150.0),)), policy, False)
    assert result.state is AgentState.AVAILABLE


@pytest.mark.parametrize("bad", [dict(min_battery_percent=120.0), dict(max_cpu_load=0.0),
                                 dict(min_free_memory_bytes=-1), dict(min_battery_percent=float("nan")),
                                 dict(max_cpu_load=float("nan")), dict(max_temperature_c=float("nan")),
                                 dict(max_temperature_c=float("inf")), dict(max_temperature_c=-300.0),
                                 dict(max_temperature_c=1000.0), dict(release_stages_after_s=-1.0),
                                 dict(release_stages_after_s=float("nan")), dict(release_stages_after_s=1e9),
                                 dict(max_igpu_busy=0.0), dict(max_igpu_busy=1.5), dict(max_igpu_busy=float("nan"))])
def test_policy_rejects_out_of_range_limits(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        AvailabilityPolicy(**bad)  # type: ignore[arg-type]


def test_a_nan_temperature_limit_cannot_switch_the_check_off() -> None:
    hot = reading(temperatures=(TemperatureReading("cpu", 150.0),))
    assert decide_availability(hot, AvailabilityPolicy(max_temperature_c=200.0), False).state is AgentState.AVAILABLE
    assert decide_availability(hot, AvailabilityPolicy(max_temperature_c=-50.0), False).state is AgentState.UNAVAILABLE
    with pytest.raises(ValueError, match="max_temperature_c must be within"):
        AvailabilityPolicy(max_temperature_c=float("nan"))


def test_random_readings_are_deterministic_and_consistent() -> None:
    generator = random.Random(5)
    policy = AvailabilityPolicy(max_cpu_load=0.8)
    for _ in range(500):
        sample = reading(
            cpu_load=generator.random(), memory_free_bytes=generator.randrange(0, 8 * GIB),
            battery_percent=generator.choice([None, generator.uniform(0, 100)]),
            on_ac_power=generator.choice([None, True, False]),
            temperatures=tuple(TemperatureReading(f"t{i}", generator.uniform(20, 110))
                               for i in range(generator.randrange(3))))
        serving = generator.random() < 0.5
        first = decide_availability(sample, policy, serving)
        assert first == decide_availability(sample, policy, serving)
        assert (first.state is AgentState.UNAVAILABLE) == bool(first.reasons)
        assert first.state in ((AgentState.SERVING,) if serving else (AgentState.AVAILABLE,)) or first.reasons


def _watch(readings: list[tuple[float, MonitorReading]], policy: AvailabilityPolicy,
           serving: bool = True) -> list[str | None]:
    watch = StageReleaseWatch()
    return [watch.update(decide_availability(state, policy, serving), policy, serving, now) for now, state in readings]


def test_stages_are_given_up_only_after_the_pc_stayed_on_battery_or_hot_for_the_set_time() -> None:
    policy = AvailabilityPolicy(release_stages_after_s=30.0)
    plugged, unplugged = reading(on_ac_power=True), reading(on_ac_power=False, battery_percent=41.0)
    hot = reading(temperatures=(TemperatureReading("coretemp/Package id 0", 97.0),))
    assert _watch([(0, plugged), (5, unplugged), (20, unplugged), (34, unplugged), (35, unplugged)], policy) == [
        None, None, None, None, "battery 41%, unplugged (require_ac_power) for 30 s"]
    # plugged back in for a while (CLEAR_ENDS_SPELL_S): the clock starts again
    assert _watch([(0, unplugged), (20, plugged), (32, plugged), (35, unplugged), (60, unplugged),
                   (65, unplugged)], policy) == [None, None, None, None, None,
                                                 "battery 41%, unplugged (require_ac_power) for 30 s"]
    # plugged in for a moment only: the same spell goes on
    assert _watch([(0, unplugged), (20, plugged), (25, unplugged), (30, unplugged)], policy) == [
        None, None, None, "battery 41%, unplugged (require_ac_power) for 30 s"]
    assert _watch([(0, hot), (31, hot)], policy)[-1] == "coretemp/Package id 0 97 °C (max_temperature_c 90) for 31 s"
    assert _watch([(0, unplugged), (0, unplugged)], AvailabilityPolicy(release_stages_after_s=0.0))[0] is not None


def test_a_sensor_that_dips_below_the_limit_now_and_then_does_not_keep_the_stages_on_a_hot_pc() -> None:
    # hot in six checks of every seven (2 s apart): the one clear reading restarted the clock, for ever
    policy = AvailabilityPolicy(release_stages_after_s=30.0)
    hot, cool = reading(temperatures=(TemperatureReading("cpu", 97.0),)), reading()
    checks = [(float(t), cool if t % 14 == 12 else hot) for t in range(0, 60, 2)]
    released = [t for (t, _), said in zip(checks, _watch(checks, policy), strict=True) if said is not None]
    assert released and released[0] == 30.0
    # readings far apart: a clear one, then a crossed one long after it, starts a new spell
    assert _watch([(0, hot), (25, cool), (40, hot), (60, hot), (70, hot)], policy) == [
        None, None, None, None, "cpu 97 °C (max_temperature_c 90) for 30 s"]


def test_memory_cpu_load_an_idle_agent_or_no_release_time_never_give_stages_up() -> None:
    # A stage's own memory and its own inference would cross these: the planner leaves such a PC out instead
    busy = reading(memory_free_bytes=GIB, cpu_load=0.99)
    policy = AvailabilityPolicy(release_stages_after_s=1.0, max_cpu_load=0.5)
    assert decide_availability(busy, policy, True).state is AgentState.UNAVAILABLE
    assert _watch([(0, busy), (100, busy)], policy) == [None, None]
    unplugged = reading(on_ac_power=False)
    assert _watch([(0, unplugged), (100, unplugged)], policy, serving=False) == [None, None]
    assert _watch([(0, unplugged), (100, unplugged)], AvailabilityPolicy(release_stages_after_s=None)) == [None, None]


def _call_ins(looks: list[tuple[float, bool]], registered_at: float | None = None) -> list[float]:
    """The times CallInWatch calls in over (time, available) looks."""
    watch = CallInWatch()
    if registered_at is not None:
        watch.registered(registered_at)
    return [now for now, available in looks if watch.update(available, now)]


def test_an_agent_calls_in_once_it_has_been_available_a_while_after_a_spell_of_not_being() -> None:
    settle = CALL_IN_SETTLE_S
    # a pause its user ended (or a PC plugged in again): the next fleet run takes it back only if it says so
    assert _call_ins([(0, True), (10, False), (20, False), (30, True), (40, True), (30 + settle, True),
                      (40 + settle, True)]) == [30 + settle]
    # available all along, or never again: nothing to say (its registration said it)
    assert _call_ins([(0, True), (10, True), (100, True)], registered_at=0) == []
    assert _call_ins([(0, False), (10, False), (100, False)]) == []
    # the first look has no spell before it: the registration that came with it said it all
    assert _call_ins([(0, True), (100, True)]) == []
    # available again for less than CALL_IN_SETTLE_S, then not: nothing said (memory hovering about its limit)
    assert _call_ins([(0, False), (10, True), (10 + settle - 1, True), (10 + settle, False), (100, False)]) == []


def test_a_pc_that_flickers_calls_in_at_most_once_a_minute() -> None:
    gap, settle = CALL_IN_MIN_INTERVAL_S, CALL_IN_SETTLE_S
    # away for a moment every 40 s: each streak lasts long enough, but the calls are a minute apart at least
    looks = [(float(t), t % 40 != 0) for t in range(0, 400, 5)]
    said = _call_ins(looks)
    assert said and all(later - earlier >= gap for earlier, later in itertools.pairwise(said)), said
    assert said[0] == 5 + settle and len(said) >= 3, said
    # owed once settled (the registration at 0 too recent), said once a minute has passed since it
    assert _call_ins([(10, False), (20, True), (45, True), (60, True)], registered_at=0) == [60]


def test_a_spell_the_fleet_saw_between_two_looks_counts_and_a_look_it_overtook_is_no_evidence() -> None:
    settle = CALL_IN_SETTLE_S
    watch = CallInWatch()
    watch.registered(0.0)
    assert not watch.update(True, 100.0)
    watch.went_away()  # it gave its stages up (a pause of a second, unseen by the looks)
    assert not watch.update(True, 110.0) and watch.update(True, 110.0 + settle)
    # a look begun before a spell the fleet saw (the user paused as the sensors were read) reads as not available
    mark = watch.mark()
    watch.went_away()
    assert not watch.update(True, 300.0, mark)
    assert not watch.update(True, 310.0) and watch.update(True, 310.0 + settle)
