"""Advertiser: argument checks, TXT updates only on change, and mDNS that stays on its interface.

Multicast on loopback works in this sandbox although `lo` lacks the MULTICAST flag: zeroconf sets
IP_MULTICAST_IF to 127.0.0.1, and Linux delivers looped-back multicast to the group members on lo.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import threading
from types import SimpleNamespace

import psutil
import pytest
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from deskfleet.agent.advertise import Advertiser, interface_addresses, open_zeroconf
from deskfleet.common.agent_state import AgentState
from deskfleet.common.discovery_record import MEMORY_STEP_BYTES, SERVICE_TYPE, AgentRecord
from tests.log_records import records_of
from tests.run_ids import run_random

LOOPBACK = "127.0.0.1"


def make_record(seed: int, **overrides: object) -> AgentRecord:
    generator = run_random(seed)
    fields: dict[str, object] = dict(
        agent_id="".join(generator.choice("abcdefghijklmnopqrstuvwxyz234567") for _ in range(52)),
        fleet_id="".join(generator.choice("0123456789abcdef") for _ in range(16)), version="0.1.0",
        devices=("CPU", "GPU"), free_memory_bytes=4 * MEMORY_STEP_BYTES, state=AgentState.AVAILABLE)
    fields.update(overrides)
    return AgentRecord(**fields)  # type: ignore[arg-type]


def test_rejects_unspecified_addresses_and_bad_ports() -> None:
    record = make_record(1)
    with pytest.raises(ValueError, match="concrete addresses"):
        Advertiser(record, 7431, ["0.0.0.0"])
    with pytest.raises(ValueError, match="at least one"):
        Advertiser(record, 7431, [])
    with pytest.raises(ValueError, match="port"):
        Advertiser(record, 0, [LOOPBACK])


def test_interface_addresses() -> None:
    assert LOOPBACK in interface_addresses(include_loopback=True)
    assert LOOPBACK not in interface_addresses()


def test_interface_addresses_are_both_families_a_peer_can_dial(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before, IPv4 alone: on an IPv6-only LAN an agent announced nothing and `fleet ls` browsed nowhere.
    def entry(family: int, address: str) -> SimpleNamespace:  # what the code reads of psutil's snicaddr
        return SimpleNamespace(family=family, address=address)

    monkeypatch.setattr(psutil, "net_if_addrs", lambda: {
        "lo": [entry(socket.AF_INET, "127.0.0.1"), entry(socket.AF_INET6, "::1")],
        "eth0": [entry(socket.AF_INET6, "fd61::12"), entry(socket.AF_INET, "192.168.7.23"),
                 entry(socket.AF_INET6, "fe80::1%12"),  # link-local, with its zone as Windows gives it
                 entry(socket.AF_INET, "169.254.3.4"), entry(socket.AF_INET6, "2001:db8::5"),
                 entry(psutil.AF_LINK, "00:11:22:33:44:55")],
        "wlan0": [entry(socket.AF_INET, "10.1.0.5"), entry(socket.AF_INET6, "fd61::3")]})
    assert interface_addresses() == ["10.1.0.5", "192.168.7.23", "2001:db8::5", "fd61::3", "fd61::12"]
    assert interface_addresses(include_loopback=True) == ["10.1.0.5", "127.0.0.1", "192.168.7.23", "::1",
                                                          "2001:db8::5", "fd61::3", "fd61::12"]


def test_mdns_on_an_address_no_interface_has_is_an_os_error_that_names_it() -> None:
    # zeroconf looks up an IPv6 address's interface index and raised RuntimeError for one gone since it was read
    # (a laptop's address changed): the advertising loop, which waits out an OSError, ended.
    with pytest.raises(OSError, match="fd61::77"):
        open_zeroconf(["fd61::77"])


def test_a_socket_of_an_address_this_pc_lost_is_one_line_at_info_not_a_warning_with_its_error() -> None:
    # at each change of a PC's addresses zeroconf warned, with the error, of the lost address's socket (an
    # exploratory test): "Error with socket 18 (('10.231.0.13', 5353))): [Errno 101] Network is unreachable"
    from zeroconf._logger import QuietLogger

    with pytest.raises(OSError):
        open_zeroconf(["fd61::77"])  # sets zeroconf's log up, whether or not mDNS can start
    with records_of("zeroconf", logging.DEBUG) as records:
        lost = OSError(errno.ENETUNREACH, "Network is unreachable")
        QuietLogger.log_exception_once(lost, "Error with socket 18 (('10.231.0.13', 5353))): %s", lost)
        other = OSError(errno.EPERM, "Operation not permitted")  # anything else: as zeroconf says it
        QuietLogger.log_exception_once(other, "Error with socket 19 (('10.231.0.14', 5353))): %s", other)
    said = [(record.levelno, record.getMessage(), record.exc_info is not None) for record in records.records]
    assert said == [(logging.INFO, "Error with socket 18 (('10.231.0.13', 5353))): [Errno 101] Network is "
                                   "unreachable: this PC lost that address, or its route (mDNS sends again at its "
                                   "next announcement)", False),
                    (logging.WARNING, "Error with socket 19 (('10.231.0.14', 5353))): [Errno 1] Operation not "
                                      "permitted", True)]


def test_update_only_on_a_real_change_before_start() -> None:
    record = make_record(2)
    advertiser = Advertiser(record, 7431, [LOOPBACK])

    async def scenario() -> None:
        assert not await advertiser.update(make_record(2, free_memory_bytes=4 * MEMORY_STEP_BYTES + 5))
        assert not await advertiser.update(make_record(2, state=AgentState.SERVING))  # not started: no send
        assert advertiser.record.state is AgentState.SERVING
        with pytest.raises(ValueError, match="one agent"):
            await advertiser.update(make_record(3))
        await advertiser.close()  # never started: nothing to do

    asyncio.run(scenario())


def _other_interfaces() -> list[str]:
    return [name for name, stats in psutil.net_if_stats().items() if stats.isup and name != "lo"]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="sniffing needs root")
def test_announces_on_loopback_and_sends_nothing_elsewhere() -> None:
    record = make_record(4)
    marker = record.agent_id.encode()
    sniffers = []
    for name in _other_interfaces():
        sniffer = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
        sniffer.bind((name, 0))
        sniffer.settimeout(0.1)
        sniffers.append(sniffer)
    leaked: list[int] = []
    done = threading.Event()

    def sniff() -> None:
        while not done.is_set():
            for sniffer in sniffers:
                try:
                    if marker in sniffer.recv(65535):
                        leaked.append(1)
                except TimeoutError:
                    pass

    async def scenario() -> None:
        async with Advertiser(record, 7431, [LOOPBACK]) as advertiser:
            browser = AsyncZeroconf(interfaces=[LOOPBACK])
            try:
                info = AsyncServiceInfo(SERVICE_TYPE, record.instance_name)
                assert await info.async_request(browser.zeroconf, 3000)
                assert AgentRecord.from_txt(info.properties) == record and info.port == 7431
                assert await advertiser.update(make_record(4, state=AgentState.SERVING))
            finally:
                await browser.async_close()

    thread = threading.Thread(target=sniff)
    thread.start()
    try:
        asyncio.run(scenario())
    finally:
        done.set()
        thread.join()
        for sniffer in sniffers:
            sniffer.close()
    assert not leaked, "mDNS for a loopback-bound advertiser left on another interface"
