"""The fleet over a real network: a controller and 3 agents as separate processes.

As root, each process gets its own network namespace (df-test-PID-*) with an address in 10.213.0.0/24 on
a veth pair into one bridge, so TLS, registration and mDNS cross a real network stack; otherwise all
run on loopback with distinct ports
(DESKFLEET_TEST_LOOPBACK=1 forces that as root). The fixture makes and always removes the namespaces and bridge.
The tests run in file order and share the fleet: join + discovery, deploy twice, generate through the
chain, the engine over the fleet (several streams, speculative, sampled) token-identical to a local
1-stage run, strangers refused, a PC switched off mid-generation re-planned around (same text) and taken back
at the next run once it called in again, a removed agent refused, a dead agent named (--max-failovers 0) or
re-planned around.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from deskfleet.controller.bench.runner_process import stop_processes
from tests.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SUBNET = "10.213.0"  # on a bridge of this run's own, which has no address on the host: runs do not meet
# This run's namespaces and links carry its pid, so two test runs on one machine (two checkouts) do not
# tear down each other's network; a run killed before its clean-up is swept by the next one (its pid is gone).
# Link names are at most 15 characters: "dft" + the pid in hex (at most 6 digits) + "v3", "p3" or "br".
RUN_TAG = f"{os.getpid():x}"
NAMESPACE_PREFIX = "df-test-"
LINK_PREFIX = "dft"
BRIDGE = f"{LINK_PREFIX}{RUN_TAG}br"
AGENTS = 3
ASYNCIO_AGENT = "agent1"  # runs on the standard asyncio loop (Fleet.start), the others on uvloop
# The agents share one host, so a measured speed would be noise: pin one for the planner.
RELAXED_SETTINGS = {"format_version": 1, "speed_gb_per_s": 10.0, "thresholds": {
    "require_ac_power": False, "min_battery_percent": None, "max_temperature_c": None,
    "min_free_memory_bytes": None, "max_cpu_load": None}}


@dataclass
class Node:
    name: str
    namespace: str | None
    host: str

    def command(self, *argv: str) -> list[str]:
        prefix = ["ip", "netns", "exec", self.namespace] if self.namespace else []
        return [*prefix, *argv]


@dataclass
class Fleet:
    work: Path
    controller: Node
    agents: list[Node]
    controller_address: str
    agent_addresses: list[str]
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    join_outputs: list[str] = field(default_factory=list)
    deployed: bool = False

    @property
    def controller_dir(self) -> Path:
        return self.work / "controller"

    def agent_dir(self, index: int) -> Path:
        return self.work / f"agent{index}"

    def run(self, node: Node, *argv: str, timeout: float = 120) -> str:
        done = subprocess.run(node.command(*argv), cwd=REPO, capture_output=True, timeout=timeout,
                              env=_environment())
        if done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr.decode()[-3000:]}")
        return done.stdout.decode()

    def deskfleet(self, *argv: str, timeout: float = 120) -> str:
        return self.run(self.controller, str(BIN / "deskfleet"), *argv, "--data-dir", str(self.controller_dir),
                        timeout=timeout)

    def start(self, key: str, node: Node, *argv: str) -> None:
        log = (self.work / f"{key}.log").open("wb")
        # one agent on Python's standard loop, as every Windows PC runs (uvloop has no Windows build): every test of
        # the module drives a chain through it
        loop = {"DESKFLEET_EVENT_LOOP": "asyncio"} if key == ASYNCIO_AGENT else {}
        self.processes[key] = subprocess.Popen(node.command(*argv), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                               env={**_environment(), **loop})

    def log(self, key: str) -> str:
        return (self.work / f"{key}.log").read_text(errors="replace")

    def stop_all(self) -> None:
        stop_processes(self.processes.values())


def _environment() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


def _use_namespaces() -> bool:
    if os.environ.get("DESKFLEET_TEST_LOOPBACK"):  # force the non-root path
        return False
    return os.name == "posix" and os.geteuid() == 0 and shutil.which("ip") is not None


def _ip(*argv: str, check: bool = True) -> None:
    subprocess.run(["ip", *argv], check=check, capture_output=True)


@pytest.fixture(scope="module")
def network() -> Iterator[tuple[Node, list[Node]]]:
    """(controller node, agent nodes): namespaces on a bridge as root, else loopback."""
    if not _use_namespaces():
        yield Node("controller", None, "127.0.0.1"), [Node(f"agent{i}", None, "127.0.0.1") for i in range(AGENTS)]
        return
    names = [f"{NAMESPACE_PREFIX}{os.getpid()}-ctl", *[f"{NAMESPACE_PREFIX}{os.getpid()}-a{i}" for i in range(AGENTS)]]
    hosts = [f"{SUBNET}.1", *[f"{SUBNET}.{10 + i}" for i in range(AGENTS)]]
    _remove_dead_runs_networks()
    _remove_test_network(names)  # a killed run's, whose pid this run has now (a container's pids repeat)
    try:
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("link", "set", BRIDGE, "type", "bridge", "mcast_snooping", "0", check=False)
        _ip("link", "set", BRIDGE, "up")
        for index, (namespace, host) in enumerate(zip(names, hosts, strict=True)):
            _ip("netns", "add", namespace)
            host_end, namespace_end = f"{LINK_PREFIX}{RUN_TAG}v{index}", f"{LINK_PREFIX}{RUN_TAG}p{index}"
            _ip("link", "add", host_end, "type", "veth", "peer", "name", namespace_end)
            _ip("link", "set", host_end, "master", BRIDGE, "up")
            _ip("link", "set", namespace_end, "netns", namespace)
            _ip("-n", namespace, "link", "set", "lo", "up")
            _ip("-n", namespace, "link", "set", namespace_end, "name", "eth0")
            _ip("-n", namespace, "addr", "add", f"{host}/24", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up", "multicast", "on")
            _ip("-n", namespace, "route", "add", "224.0.0.0/4", "dev", "eth0", check=False)
        yield (Node("controller", names[0], hosts[0]),
               [Node(f"agent{i}", names[i + 1], hosts[i + 1]) for i in range(AGENTS)])
    finally:
        _remove_test_network(names)


def _remove_test_network(names: list[str]) -> None:
    for namespace in names:
        _ip("netns", "del", namespace, check=False)  # takes its veth end, and so the pair, with it
    for index in range(len(names)):
        _ip("link", "del", f"{LINK_PREFIX}{RUN_TAG}v{index}", check=False)
    _ip("link", "del", BRIDGE, check=False)


def _remove_dead_runs_networks() -> None:
    """The namespaces and links of earlier runs killed before their clean-up (their pid no longer runs);
    a live run's are left alone. The names from before they carried a pid (df-test-ctl, df-test-br) go
    whatever runs, so a live run of an older checkout is torn down; and runs in separate pid namespaces
    that share one network namespace cannot tell each other's pids apart."""
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for namespace in namespaces:
        run = re.fullmatch(rf"{NAMESPACE_PREFIX}(?:(\d+)-)?(?:ctl|a\d+)", namespace)
        if run and (run.group(1) is None or not _running(int(run.group(1)))):
            _ip("netns", "del", namespace, check=False)
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    for name in re.findall(rf"^\d+: ({LINK_PREFIX}[0-9a-f]+(?:br|[vp]\d+))[@:]", links, flags=re.MULTILINE):
        pid = re.fullmatch(rf"{LINK_PREFIX}([0-9a-f]+)(?:br|[vp]\d+)", name)
        if pid and not _running(int(pid.group(1), 16)):
            _ip("link", "del", name, check=False)
    for name in ("df-test-br", *[f"df-test-v{index}" for index in range(AGENTS + 1)]):  # before names carried a pid
        _ip("link", "del", name, check=False)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True  # PermissionError too: another user's process


@pytest.fixture(scope="module")
def controller_only(network: tuple[Node, list[Node]], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """The fleet made and its controller serving, no agent joined yet."""
    controller, agents = network
    namespaced = controller.namespace is not None
    work = tmp_path_factory.mktemp("fleet")
    port = 7341 if namespaced else free_port()
    agent_addresses = [f"{node.host}:{7431 if namespaced else free_port()}" for node in agents]
    fleet = Fleet(work, controller, agents, f"{controller.host}:{port}", agent_addresses)
    try:
        fleet.deskfleet("fleet", "init", "--address", fleet.controller_address)
        fleet.start("controller", controller, str(BIN / "deskfleet"), "-v", "fleet", "serve", "--data-dir",
                    str(fleet.controller_dir), "--listen", fleet.controller_address)
        yield fleet
    finally:
        fleet.stop_all()


def _wait_for(what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def _ls(fleet: Fleet, discover_seconds: float = 0.0) -> list[dict[str, object]]:
    return json.loads(fleet.deskfleet("fleet", "ls", "--json", "--discover-seconds", str(discover_seconds)))


@pytest.fixture(scope="module")
def joined_fleet(controller_only: Fleet) -> Fleet:
    """The fleet with its agents joined, started and answering (what the first test checks)."""
    fleet = controller_only
    _wait_for("the controller to listen", lambda: "controller listening" in fleet.log("controller"))
    token = fleet.deskfleet("fleet", "token", "--uses", str(AGENTS), "--ttl", "10m").strip()
    for index, node in enumerate(fleet.agents):
        data_dir = fleet.agent_dir(index)
        fleet.join_outputs.append(fleet.run(node, str(BIN / "deskfleet-agent"), "join", token, "--data-dir",
                                            str(data_dir), "--hostname", f"desk-{index}"))
        (data_dir / "settings").mkdir(exist_ok=True)
        (data_dir / "settings" / "agent-settings.json").write_text(json.dumps(RELAXED_SETTINGS))
        fleet.start(node.name, node, str(BIN / "deskfleet-agent"), "--headless", "--data-dir", str(data_dir),
                    "--listen", fleet.agent_addresses[index])

    def all_reachable() -> bool:
        return sum(agent["state"] == "available" for agent in _ls(fleet)) == AGENTS

    _wait_for("3 registered agents to answer", all_reachable, timeout=60)
    return fleet


DEPLOY_ARGS = ("fleet", "deploy", "--policy", "all_by_speed", "--hop-ms", "0", "--precision", "f32", "--json",
               "--discover-seconds", "0")  # hops free: the tiny model's token computes in less than a hop


@pytest.fixture(scope="module")
def fleet(joined_fleet: Fleet, tiny_export: Path) -> Fleet:
    """The fleet with the tiny model deployed over all 3 agents: the deploy test's, or its own where that test did
    not run first (a test picked with -k)."""
    if not joined_fleet.deployed:
        joined_fleet.deskfleet(*DEPLOY_ARGS, "--model", str(tiny_export))
        joined_fleet.deployed = True
    return joined_fleet


# Tests, in order. Those up to the stranger test need only the deployment (`fleet`), so each runs alone too
# (-k); those after take up the fleet as the ones before them left it (a PC dropped out, removed, stopped).

def test_agents_join_and_are_discovered(joined_fleet: Fleet) -> None:
    fleet = joined_fleet
    assert len(fleet.join_outputs) == AGENTS and all("joined fleet" in out for out in fleet.join_outputs)
    for index in range(AGENTS):
        assert (fleet.agent_dir(index) / "state" / "agent-key.pem").stat().st_mode & 0o077 == 0
    assert (fleet.controller_dir / "ca-key.pem").stat().st_mode & 0o077 == 0
    if fleet.controller.namespace is not None:  # a real bridge carries multicast: mDNS finds them too
        agents = _ls(fleet, discover_seconds=4.0)
        assert sum("mdns" in agent["sources"] for agent in agents) == AGENTS, agents
    assert sorted(agent["address"] for agent in _ls(fleet)) == sorted(fleet.agent_addresses)


def test_deploy_pushes_then_a_second_deploy_sends_nothing(joined_fleet: Fleet, tiny_export: Path) -> None:
    fleet = joined_fleet
    args = (*DEPLOY_ARGS, "--model", str(tiny_export))
    first = json.loads(fleet.deskfleet(*args))
    fleet.deployed = True
    assert len(first["stages"]) == AGENTS
    assert all(sent > 0 for sent in first["bytes_sent"].values())
    assert first["stages"][0][2] == 0 and first["stages"][-1][3] == 4
    second = json.loads(fleet.deskfleet(*args))
    assert second["stages"] == first["stages"]
    assert set(second["bytes_sent"].values()) == {0} and set(second["files_sent"].values()) == {0}
    serving = [agent for agent in _ls(fleet) if agent["stages"]]
    assert len(serving) == AGENTS


def test_chain_generates_the_local_tokens(fleet: Fleet, tiny_export: Path) -> None:
    prompt = "1,17,42,99,5"
    remote = json.loads(fleet.deskfleet("fleet", "generate", "--model", str(tiny_export), "--prompt-ids", prompt,
                                        "--max-new-tokens", "8", "--ignore-eos", "--json"))["tokens"]
    local = json.loads(subprocess.run(
        [str(BIN / "deskfleet"), "generate", "--model", str(tiny_export), "--prompt-ids", prompt,
         "--max-new-tokens", "8", "--ignore-eos", "--precision", "f32", "--json"],
        capture_output=True, check=True, cwd=REPO, env=_environment()).stdout)["tokens"]
    assert remote == local


def test_one_agent_of_the_chain_runs_on_the_standard_asyncio_loop(fleet: Fleet) -> None:
    # CI's fleet ran uvloop alone, and Windows PCs (no uvloop build) run asyncio's loop: ASYNCIO_AGENT does, and hosts
    # a stage of every chain this module drives (each agent serves one: test_deploy_pushes_then_a_second_deploy_...)
    def uvloop_mapped(key: str) -> bool:
        return "uvloop" in Path(f"/proc/{fleet.processes[key].pid}/maps").read_text()

    assert not uvloop_mapped(ASYNCIO_AGENT) and uvloop_mapped("agent0")


def test_a_long_prompts_hidden_states_cross_the_chain(fleet: Fleet, tiny_export: Path) -> None:
    # 400 tokens x 64 wide in f32: each stage's step to the next is a 100 KB frame, past what an agent reads of a
    # PC that is not its stage's previous hop (link.SMALL_FRAME_BYTES)
    prompt = ",".join(str(3 + (index * 7) % 500) for index in range(400))
    argv = ("--model", str(tiny_export), "--prompt-ids", prompt, "--max-new-tokens", "4", "--ignore-eos", "--json")
    remote = json.loads(fleet.deskfleet("fleet", "generate", *argv))["tokens"]
    local = json.loads(subprocess.run([str(BIN / "deskfleet"), "generate", *argv, "--precision", "f32"],
                                      capture_output=True, check=True, cwd=REPO, env=_environment()).stdout)["tokens"]
    assert remote == local and len(remote) == 4


PROMPTS = ("1,17,42,99,5", "7,3,250", "200,201,202,203,204,205,206,207,208")
_LOCAL: dict[tuple[str, ...], list[list[int]]] = {}


def _streams(report: dict[str, object]) -> list[list[int]]:
    streams = report["streams"]
    assert isinstance(streams, list)
    return [stream["tokens"] for stream in streams]


def _generate_argv(model: Path, *options: str, on_fleet: bool = False) -> list[str]:
    # The fleet was deployed in f32: there --precision is only the draft's, on this controller (and refused
    # without --draft, which it would not affect)
    precision = ("--precision", "f32") if not on_fleet or "--draft" in options else ()
    return ["generate", "--model", str(model), *[a for p in PROMPTS for a in ("--prompt-ids", p)],
            "--max-new-tokens", "12", "--ignore-eos", "--json", *precision, *options]


def _engine_run(fleet: Fleet, model: Path, *options: str, on_fleet: bool) -> list[list[int]]:
    argv = _generate_argv(model, *options, on_fleet=on_fleet)
    if on_fleet:
        return _streams(json.loads(fleet.deskfleet(*argv, "--fleet")))
    if options not in _LOCAL:
        _LOCAL[options] = _streams(json.loads(fleet.run(fleet.controller, str(BIN / "deskfleet"), *argv)))
    return _LOCAL[options]


@pytest.fixture(scope="module")
def tiny_draft(checkpoint_factory: Callable[..., Path], export_factory: Callable[[Path, str], Path]) -> Path:
    """A 1-layer random draft sharing the tiny model's vocabulary (it disagrees often: rollbacks)."""
    return export_factory(checkpoint_factory("tiny-draft", num_hidden_layers=1), "f32")


def test_engine_streams_on_the_fleet_equal_local(fleet: Fleet, tiny_export: Path) -> None:
    remote = _engine_run(fleet, tiny_export, on_fleet=True)
    assert remote == _engine_run(fleet, tiny_export, on_fleet=False)
    assert len(remote) == len(PROMPTS) and all(len(tokens) == 12 for tokens in remote)


def test_the_api_server_on_the_fleet_answers_requests_at_once_as_local_runs(fleet: Fleet, tiny_export: Path) -> None:
    # `deskfleet serve --fleet`: the prompts sent at once run as streams of one engine over the deployed chain
    out = json.loads(fleet.run(fleet.controller, sys.executable, "-m", "tests.integration.fleet_api",
                               str(fleet.controller_dir), str(tiny_export), *PROMPTS, timeout=300))
    argv = ["generate", "--model", str(tiny_export), *[a for p in PROMPTS for a in ("--prompt-ids", p)],
            "--max-new-tokens", "12", "--precision", "f32", "--json"]
    local = json.loads(fleet.run(fleet.controller, str(BIN / "deskfleet"), *argv))
    assert out["texts"] == [stream["text"] for stream in local["streams"]] and out["exit"] == 0
    # log-probabilities cross the chain as numbers: the fleet's equal a local f32 server's
    on_fleet, alone = out["logprobs"]["fleet"], out["logprobs"]["local"]
    assert len(on_fleet["tokens"]) == 12 and on_fleet["tokens"] == alone["tokens"]
    assert on_fleet["token_logprobs"] == pytest.approx(alone["token_logprobs"], abs=1e-4)
    for fleet_top, local_top in zip(on_fleet["top_logprobs"], alone["top_logprobs"], strict=True):
        assert fleet_top.keys() == local_top.keys()
        assert list(fleet_top.values()) == pytest.approx(list(local_top.values()), abs=1e-4)
    # and a prompt scored on the chain's last stage (an echo of max_tokens 0): the local server's figures
    on_fleet, alone = out["scores"]["fleet"], out["scores"]["local"]
    assert len(on_fleet["tokens"]) == len(PROMPTS[0].split(",")) and on_fleet["tokens"] == alone["tokens"]
    assert on_fleet["token_logprobs"][0] is None and alone["token_logprobs"][0] is None
    assert on_fleet["token_logprobs"][1:] == pytest.approx(alone["token_logprobs"][1:], abs=1e-4)
    # the prefix cache over the chain: a prompt sent again is fed its last token alone, its text unchanged
    (first, _), (again, again_cached) = out["repeated"]
    assert first == again == local["streams"][1]["text"]
    assert again_cached == len(PROMPTS[1].split(",")) - 1
    # penalties and a logit bias applied on the chain's last stage: the local server's text, not the plain one
    assert out["penalized"]["fleet"] == out["penalized"]["local"] != local["streams"][2]["text"]


def test_speculative_on_the_fleet_equals_plain_local(fleet: Fleet, tiny_export: Path, tiny_draft: Path) -> None:
    remote = _engine_run(fleet, tiny_export, "--draft", str(tiny_draft), "--k", "3", on_fleet=True)
    assert remote == _engine_run(fleet, tiny_export, on_fleet=False)  # greedy drafting changes no token
    # A fixed K and one stream per micro-batch: sampled drafting draws per round, so its tokens depend on
    # K (adaptive K follows timing) and, in the engine today, on which streams share a micro-batch (whose
    # grouping follows the order results arrive in).
    sampled = ("--draft", str(tiny_export), "--k", "3", "--max-rows", "1", "--micro-batches", "3",
               "--temperature", "0.8", "--top-p", "0.9", "--seed", "5")
    remote_sampled = _engine_run(fleet, tiny_export, *sampled, on_fleet=True)
    local_sampled = _engine_run(fleet, tiny_export, *sampled, on_fleet=False)
    assert remote_sampled == local_sampled, f"{remote_sampled}\n{local_sampled}"


def test_prompt_lookup_on_the_fleet_equals_plain_local(fleet: Fleet, tiny_export: Path) -> None:
    report = json.loads(fleet.deskfleet(*_generate_argv(tiny_export, "--prompt-lookup", "--k", "3", on_fleet=True),
                                        "--fleet"))
    assert _streams(report) == _engine_run(fleet, tiny_export, on_fleet=False)
    histogram = report["accepted_histogram"]
    assert isinstance(histogram, dict) and sum(histogram.values()) > 0  # lookup proposed, rounds were verified


def test_a_prompt_fed_in_chunks_over_the_fleet_gives_the_local_whole_prompt_tokens(fleet: Fleet,
                                                                                  tiny_export: Path) -> None:
    """One row at a time: the 60-token prompt starts while another stream runs, so the fleet's stages get it
    8 tokens a call between that stream's steps; locally it goes in one call."""
    long_prompt = ",".join(str(1 + (index * 37) % 250) for index in range(60))
    argv = ["generate", "--model", str(tiny_export), "--prompt-ids", PROMPTS[0], "--prompt-ids", PROMPTS[1],
            "--prompt-ids", long_prompt, "--max-new-tokens", "12", "--ignore-eos", "--json", "--max-rows", "1",
            "--micro-batches", "1"]
    remote = _streams(json.loads(fleet.deskfleet(*argv, "--prefill-chunk", "8", "--fleet")))
    local = _streams(json.loads(fleet.run(fleet.controller, str(BIN / "deskfleet"), *argv, "--precision", "f32",
                                          "--prefill-chunk", "0")))
    assert remote == local and all(len(tokens) == 12 for tokens in remote)


def test_turns_that_resume_the_kept_kv_state_over_the_fleet_give_the_local_whole_prompt_tokens(
        fleet: Fleet, tiny_export: Path) -> None:
    """A chat's turns over the fleet: each resumes the micro-batch the last left on the agents and feeds only what
    follows the prefix they share (the second its last reply token and 3 new ones, the third what follows its
    first 6 tokens); locally each prompt goes whole."""
    out = json.loads(fleet.run(fleet.controller, sys.executable, "-m", "tests.integration.fleet_turns",
                               str(fleet.controller_dir), str(tiny_export)))
    assert out["fleet"] == out["local"] and all(len(reply) == 10 for reply in out["fleet"])
    assert out["fed"] == [out["prompt_lengths"][0], 1 + 3, out["prompt_lengths"][2] - 6]


def test_two_drivers_on_one_deployment_each_get_their_own_results(fleet: Fleet, tiny_export: Path) -> None:
    out = json.loads(fleet.run(fleet.controller, sys.executable, "-m", "tests.integration.fleet_two_drivers",
                               str(fleet.controller_dir), str(tiny_export)))
    assert out["runs"] == [out["local"]] * 3 and len(out["local"]) == 10


def test_strangers_are_refused_and_reach_no_stage(fleet: Fleet, tiny_export: Path) -> None:
    target = fleet.agent_addresses[0]
    out = fleet.run(fleet.controller, sys.executable, "-m", "tests.integration.fleet_probe", "strangers", target,
                    str(fleet.work / "intruder"))
    results = json.loads(out)
    assert all(verdict.startswith("refused") for verdict in results.values()), results
    for agent in _ls(fleet):
        assert agent["state"] == "serving"
    status = json.loads(fleet.deskfleet("fleet", "ls", "--json", "--discover-seconds", "0"))
    assert all(agent["problem"] is None for agent in status)
    # the poisoned Forward each stranger sent would have set the stage's last error had it arrived
    assert "micro-batch 999" not in fleet.log("agent0")
    # and the agent says it refused them, and from where (the event loop's TLS server dropped them without a word);
    # the stranger of another CA distrusts the agent's certificate first and hangs up: no refusal of the agent's
    assert re.search(r"refused a connection from [0-9.]+:\d+: plain HTTP, not TLS", fleet.log("agent0"))
    assert re.search(r"refused a connection from [0-9.]+:\d+: a TLS client without a certificate",
                     fleet.log("agent0"))
    test_chain_generates_the_local_tokens(fleet, tiny_export)


def test_each_agent_publishes_for_its_tray_what_it_serves(fleet: Fleet) -> None:
    # the tray in the employee's session reads what the agent process (a service) writes in its state folder
    from deskfleet.agent.paths import AgentPaths
    from deskfleet.agent.status_file import publisher_running, read_status_file
    from deskfleet.agent.tray import look
    from deskfleet.agent.tray_view import tray_view

    deployed = {str(stage["agent_id"]) for stage in _deployed_stages(fleet)}
    for index in range(AGENTS):
        state = fleet.agent_dir(index) / "state"
        agent_id = json.loads((state / "membership.json").read_text())["agent_id"]

        def published_serving(state: Path = state, agent_id: str = agent_id) -> bool:
            published = read_status_file(state)
            return published is not None and published.controller_connected and \
                (published.status.state.value == "serving") == (agent_id in deployed)

        _wait_for(f"agent {index} to publish its status", published_serving, timeout=30)
        published = read_status_file(state)
        assert published is not None and published.agent_id == agent_id and \
            publisher_running(published, time.time())
        view = tray_view(look(AgentPaths.resolve(fleet.agent_dir(index))))
        assert view.headline.startswith("serving the fleet: layers ") == (agent_id in deployed), view


def _agent_index(fleet: Fleet, agent_id: str) -> int:
    return next(i for i in range(AGENTS) if json.loads(
        (fleet.agent_dir(i) / "state" / "membership.json").read_text())["agent_id"] == agent_id)


def _called_in_since(fleet: Fleet, agent_id: str, since: str) -> bool:
    """Whether agents.json says the agent registered, or called in, after `since` (fleet serve writes in batches)."""
    registered = json.loads((fleet.controller_dir / "agents.json").read_text())["body"][agent_id]["registered_at"]
    return registered is not None and datetime.fromisoformat(registered) > datetime.fromisoformat(since)


def _deployed_stages(fleet: Fleet) -> list[dict[str, object]]:
    deployments = json.loads((fleet.controller_dir / "deployments.json").read_text())["body"]
    stages = next(iter(deployments.values()))["stages"]
    assert isinstance(stages, list)
    return stages


class _ApiSession:
    """`serve --fleet` driven line by line (tests.integration.fleet_api_session), started and serving."""

    def __init__(self, fleet: Fleet, model: Path) -> None:
        self.process = subprocess.Popen(
            fleet.controller.command(sys.executable, "-m", "tests.integration.fleet_api_session",
                                     str(fleet.controller_dir), str(model)),
            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_environment(), text=True)
        assert self.process.stdout is not None and self.process.stdout.readline() == "serving\n"

    def complete(self, prompt: str) -> str:
        """A greedy completion of 12 tokens of `prompt` (comma-separated token ids)."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(prompt + "\n")
        self.process.stdin.flush()
        return str(json.loads(self.process.stdout.readline()))

    def end(self) -> dict[str, Any]:
        """Stop the server: its exit status and what it wrote on stderr ({"exit", "stderr"})."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.close()
        end = json.loads(self.process.stdout.readline())
        assert self.process.wait(timeout=60) == 0
        return dict(end)


@contextlib.contextmanager
def _api_session(fleet: Fleet, model: Path) -> Iterator[_ApiSession]:
    session = _ApiSession(fleet, model)
    try:
        yield session
    finally:
        if session.process.poll() is None:
            session.process.kill()
            session.process.wait()


def _local_texts(fleet: Fleet, model: Path, prompts: Sequence[str]) -> list[str]:
    """What a local f32 run gives each prompt in 12 tokens: what the fleet's must give."""
    argv = ["generate", "--model", str(model), *[a for p in prompts for a in ("--prompt-ids", p)],
            "--max-new-tokens", "12", "--precision", "f32", "--json"]
    return [stream["text"] for stream in json.loads(fleet.run(fleet.controller, str(BIN / "deskfleet"),
                                                               *argv))["streams"]]


def _pause_and_resume(fleet: Fleet, agent_id: str) -> None:
    """Its user pauses the PC and resumes it once it gave its stage up; returns once it called in again."""
    index = _agent_index(fleet, agent_id)
    name = fleet.agents[index].name
    agent_cli = [str(BIN / "deskfleet-agent"), "--data-dir", str(fleet.agent_dir(index))]
    given_up = fleet.log(name).count("gave up 1 stage(s)")
    since = datetime.now().astimezone().isoformat()
    fleet.run(fleet.agents[index], *agent_cli, "pause")
    _wait_for("the paused PC to give its stage up", lambda: fleet.log(name).count("gave up 1 stage(s)") > given_up,
              timeout=30)
    fleet.run(fleet.agents[index], *agent_cli, "resume")
    _wait_for("the resumed agent to call in", lambda: _called_in_since(fleet, agent_id, since), timeout=120)


def _start_agent(fleet: Fleet, index: int) -> None:
    node = fleet.agents[index]
    fleet.start(node.name, node, str(BIN / "deskfleet-agent"), "--headless", "--data-dir", str(fleet.agent_dir(index)),
                "--listen", fleet.agent_addresses[index])


def test_a_pc_that_drops_out_mid_generation_is_replanned_around(fleet: Fleet, tiny_export: Path) -> None:
    argv = ["generate", "--model", str(tiny_export), "--prompt-ids", PROMPTS[0], "--max-new-tokens", "500",
            "--ignore-eos"]
    local = fleet.run(fleet.controller, str(BIN / "deskfleet"), *argv, "--precision", "f32")
    victim = str(_deployed_stages(fleet)[-1]["agent_id"])
    index = _agent_index(fleet, victim)
    run = subprocess.Popen(fleet.controller.command(str(BIN / "deskfleet"), *argv, "--fleet", "--data-dir",
                                                    str(fleet.controller_dir)),
                           cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_environment())
    assert run.stdout is not None
    first = run.stdout.read(1)  # text streams as it is decoded: generation is under way
    fleet.processes[fleet.agents[index].name].kill()  # the PC is switched off mid-reply
    fleet.processes[fleet.agents[index].name].wait(timeout=10)
    rest, errors = run.communicate(timeout=300)
    stderr = errors.decode()
    assert run.returncode == 0, stderr
    assert first + rest == local.encode()  # not a token lost, repeated or changed
    assert victim[:12] in stderr and re.search(r"re-planned in [0-9.]+ s over 2 agent\(s\)", stderr), stderr
    # named as the admin knows the PC: by its own link's close, or in the verdict on the blame of the stage before it
    assert f"agent {victim[:12]} on desk-{index}" in stderr, stderr
    stages = _deployed_stages(fleet)
    assert len(stages) == 2 and victim not in {stage["agent_id"] for stage in stages}


def test_a_pc_back_after_a_re_plan_left_it_out_is_taken_back_at_the_next_run(fleet: Fleet,
                                                                            tiny_export: Path) -> None:
    # The PC switched off above is started again and calls in; its model ran on 2 PCs until an admin deployed again.
    record = next(iter(json.loads((fleet.controller_dir / "deployments.json").read_text())["body"].values()))
    placed = {stage["agent_id"] for stage in record["stages"]}
    (back,) = set(record["deployed_agents"]) - placed
    since = record["replanned_at"]
    argv = ["generate", "--model", str(tiny_export), "--prompt-ids", PROMPTS[1], "--max-new-tokens", "12",
            "--ignore-eos", "--json"]
    local = json.loads(fleet.run(fleet.controller, str(BIN / "deskfleet"), *argv, "--precision", "f32"))
    # A run in flight when the PC comes back keeps its chain, and one that starts beside it leaves the PC for later:
    # a re-plan then cost the run in flight its stages, and failovers.
    holder = subprocess.Popen(fleet.controller.command(sys.executable, "-m", "tests.integration.fleet_holder",
                                                       str(fleet.controller_dir), str(tiny_export)),
                              cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_environment())
    assert holder.stdin is not None and holder.stdout is not None
    assert holder.stdout.readline() == b"open 2\n"
    _start_agent(fleet, _agent_index(fleet, back))  # switched on again: it calls in on its own

    _wait_for("the restarted agent's registration to be recorded", lambda: _called_in_since(fleet, back, since),
              timeout=60)
    deployed = _deployed_stages(fleet)
    beside = json.loads(fleet.deskfleet(*argv, "--fleet"))
    assert beside["tokens"] == local["tokens"] and beside["stages"] == AGENTS - 1
    assert "1 other run(s) drive the model" in beside["rejoined"][0]["problem"], beside["rejoined"]
    assert _deployed_stages(fleet) == deployed  # the run in flight's chain is as it was
    holder.stdin.close()
    assert holder.wait(timeout=60) == 0
    # the next run that starts alone takes it back
    done = subprocess.run(fleet.controller.command(str(BIN / "deskfleet"), *argv, "--fleet", "--data-dir",
                                                   str(fleet.controller_dir)),
                          cwd=REPO, capture_output=True, timeout=120, env=_environment())
    stderr = done.stderr.decode()
    assert done.returncode == 0, stderr
    report = json.loads(done.stdout)
    assert report["tokens"] == local["tokens"] and report["replans"] == []
    assert [entry["agents"] for entry in report["rejoined"]] == [[back]], report["rejoined"]
    assert report["stages"] == AGENTS and len(_deployed_stages(fleet)) == AGENTS
    assert re.search(rf"agent {back[:12]} on desk-\d called in since the re-plan at .* UTC that left it out: "
                     rf"re-planned in [0-9.]+ s over {AGENTS} agent\(s\)", stderr), stderr
    again = json.loads(fleet.deskfleet(*argv, "--fleet"))
    assert again["rejoined"] == [] and again["tokens"] == local["tokens"]  # taken back once: the next run just runs

    def all_answer() -> bool:
        return sum(agent["state"] in ("available", "serving") for agent in _ls(fleet)) == AGENTS

    _wait_for("every agent to answer", all_answer, timeout=60)


def test_a_pc_its_user_pauses_is_re_planned_around_and_the_server_takes_it_back_once_resumed(
        fleet: Fleet, tiny_export: Path) -> None:
    # The employee's opt-out, paused and resumed: the agent said nothing of the resume, so its PC stayed out of the
    # chain the re-plan made without it until an admin deployed again; and `serve` took PCs back only at its start.
    local = _local_texts(fleet, tiny_export, PROMPTS[:2])
    assert len(_deployed_stages(fleet)) == AGENTS
    victim = str(_deployed_stages(fleet)[-1]["agent_id"])
    index = _agent_index(fleet, victim)
    agent_cli = [str(BIN / "deskfleet-agent"), "--data-dir", str(fleet.agent_dir(index))]
    with _api_session(fleet, tiny_export) as session:
        fleet.run(fleet.agents[index], *agent_cli, "pause")
        _wait_for("the paused PC to give its stage up",
                  lambda: "paused by its user" in fleet.log(fleet.agents[index].name), timeout=30)
        assert session.complete(PROMPTS[0]) == local[0]  # re-planned around the paused PC
        stages = _deployed_stages(fleet)
        assert len(stages) == AGENTS - 1 and victim not in {stage["agent_id"] for stage in stages}
        since = next(iter(json.loads((fleet.controller_dir / "deployments.json").read_text())["body"].values()))[
            "replanned_at"]
        fleet.run(fleet.agents[index], *agent_cli, "resume")
        _wait_for("the resumed agent to call in", lambda: _called_in_since(fleet, victim, since), timeout=120)
        _wait_for("the idle server to take the PC back", lambda: len(_deployed_stages(fleet)) == AGENTS, timeout=60)
        assert session.complete(PROMPTS[1]) == local[1]
        end = session.end()
    assert end["exit"] == 0, end["stderr"]
    assert re.search(rf"agent {victim[:12]} on desk-\d called in since the re-plan at .* UTC that left it out: "
                     rf"re-planned in [0-9.]+ s over {AGENTS} agent\(s\)", end["stderr"]), end["stderr"]
    assert f"agent {victim[:12]} is available again" in fleet.log("controller")


def test_a_pc_back_under_a_busy_server_is_taken_back_without_waiting_for_an_idle_moment(
        fleet: Fleet, tiny_export: Path) -> None:
    # `serve --fleet` took a PC back only at a moment no request ran: a server kept busy all day ran short of the PC
    # its user paused and resumed for as long as it stayed busy. With --take-back-wait 0 it moves the streams running
    # onto a chain that takes the PC back as soon as its look finds it; every reply is still the local one.
    lengths = (150, 137, 123)  # the clients' requests never all end together: streams run all along
    local = {}
    for length in lengths:
        argv = ["generate", "--model", str(tiny_export), "--prompt-ids", PROMPTS[0], "--max-new-tokens", str(length),
                "--ignore-eos", "--precision", "f32", "--json"]
        local[str(length)] = [json.loads(fleet.run(fleet.controller, str(BIN / "deskfleet"), *argv))["text"]]
    assert len(_deployed_stages(fleet)) == AGENTS
    victim = str(_deployed_stages(fleet)[-1]["agent_id"])
    index = _agent_index(fleet, victim)
    agent_cli = [str(BIN / "deskfleet-agent"), "--data-dir", str(fleet.agent_dir(index))]
    session = subprocess.Popen(
        fleet.controller.command(sys.executable, "-m", "tests.integration.fleet_busy_session",
                                 str(fleet.controller_dir), str(tiny_export), PROMPTS[0], *map(str, lengths)),
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_environment(), text=True)
    waited: AssertionError | None = None
    try:
        assert session.stdin is not None and session.stdout is not None
        assert session.stdout.readline() == "serving\n"
        try:
            fleet.run(fleet.agents[index], *agent_cli, "pause")  # mid-reply: the streams go on over the PCs left
            _wait_for("the busy server to re-plan around the paused PC",
                      lambda: len(_deployed_stages(fleet)) == AGENTS - 1, timeout=60)
            since = next(iter(json.loads((fleet.controller_dir / "deployments.json").read_text())["body"].values()))[
                "replanned_at"]
            fleet.run(fleet.agents[index], *agent_cli, "resume")
            _wait_for("the resumed agent to call in", lambda: _called_in_since(fleet, victim, since), timeout=120)
            _wait_for("the busy server to take the PC back", lambda: len(_deployed_stages(fleet)) == AGENTS,
                      timeout=60)
        except AssertionError as error:  # the server's report says why
            waited = error
        session.stdin.close()
        end = json.loads(session.stdout.readline())
        assert session.wait(timeout=60) == 0
    finally:
        if session.poll() is None:
            session.kill()
            session.wait()
    assert waited is None, f"{waited}: {end}"
    assert end["exit"] == 0 and end["failures"] == [], end
    assert end["texts"] == local, end["texts"]  # every reply, moved or not, is the local one
    health = end["health"]
    assert health["chains_switched"] == 1 and health["chains_reopened"] == 0, health  # taken back while busy
    assert health["stages"] == AGENTS and health["runs_failed"] == 0
    assert re.search(rf"agent {victim[:12]} on desk-\d called in since the re-plan at .* UTC that left it out: "
                     rf"re-planned in [0-9.]+ s over {AGENTS} agent\(s\)", end["stderr"]), end["stderr"]


def test_a_pc_paused_and_resumed_while_no_run_drives_its_model_hosts_its_stage_again_at_the_next_run(
        fleet: Fleet, tiny_export: Path) -> None:
    # Paused over lunch while nobody ran the model, then resumed: the PC gave its stage up and called in, and the
    # next run's first step found the stage gone and spent a failover on it (with --max-failovers 0 the run failed).
    stages = _deployed_stages(fleet)
    assert len(stages) == AGENTS
    victim = str(stages[0]["agent_id"])
    index = _agent_index(fleet, victim)
    argv = ["generate", "--model", str(tiny_export), "--prompt-ids", PROMPTS[2], "--max-new-tokens", "12",
            "--ignore-eos", "--json"]
    local = json.loads(fleet.run(fleet.controller, str(BIN / "deskfleet"), *argv, "--precision", "f32"))
    _pause_and_resume(fleet, victim)
    done = subprocess.run(fleet.controller.command(str(BIN / "deskfleet"), *argv, "--fleet", "--max-failovers", "0",
                                                   "--data-dir", str(fleet.controller_dir)),
                          cwd=REPO, capture_output=True, timeout=120, env=_environment())
    stderr = done.stderr.decode()
    assert done.returncode == 0, stderr
    report = json.loads(done.stdout)
    assert report["tokens"] == local["tokens"] and report["replans"] == []
    assert [entry["agents"] for entry in report["rejoined"]] == [[victim]], report["rejoined"]
    assert report["stages"] == AGENTS and victim in {stage["agent_id"] for stage in _deployed_stages(fleet)}
    assert re.search(rf"agent {victim[:12]} on desk-{index} no longer hosts its stage \(it called in since the stage "
                     rf"was assigned at .* UTC\): re-planned in [0-9.]+ s over {AGENTS} agent\(s\)",
                     stderr), stderr
    again = json.loads(fleet.deskfleet(*argv, "--fleet", "--max-failovers", "0"))
    assert again["rejoined"] == [] and again["replans"] == [] and again["tokens"] == local["tokens"]


def test_an_admins_deploy_under_a_running_server_is_what_the_server_goes_on_on(fleet: Fleet,
                                                                            tiny_export: Path) -> None:
    # An admin's `fleet deploy` while `serve --fleet` holds the chain: the deploy moves and releases stages under it.
    # The server goes on on the admin's deployment at its next request (not its own re-plan). Before, a deploy that
    # added PCs made one the last stage, which dropped the results of a driver it had never heard of: the request
    # timed out.
    local = _local_texts(fleet, tiny_export, PROMPTS)
    deploy = ["fleet", "deploy", "--model", str(tiny_export), "--precision", "f32", "--json", "--discover-seconds", "0"]
    assert len(json.loads(fleet.deskfleet(*deploy, "--policy", "fewest_agents"))["stages"]) == 1

    def record() -> dict[str, object]:
        return next(iter(json.loads((fleet.controller_dir / "deployments.json").read_text())["body"].values()))

    try:
        with _api_session(fleet, tiny_export) as session:
            assert session.complete(PROMPTS[0]) == local[0]
            # the admin adds PCs under the server: the new stages' last PC never heard of the server's chain
            three = json.loads(fleet.deskfleet(*deploy, "--policy", "all_by_speed", "--hop-ms", "0"))
            assert len(three["stages"]) == AGENTS
            assert session.complete(PROMPTS[1]) == local[1]
            assert "replanned_at" not in record() and len(_deployed_stages(fleet)) == AGENTS  # the admin's, as it was
            one = json.loads(fleet.deskfleet(*deploy, "--policy", "fewest_agents"))  # and takes them away again
            assert session.complete(PROMPTS[2]) == local[2]
            assert "replanned_at" not in record() and _deployed_stages(fleet) == [
                dict(zip(("agent_id", "address", "layer_start", "layer_end"), stage, strict=True))
                for stage in one["stages"]]
            end = session.end()
    finally:
        fleet.deskfleet(*deploy, "--policy", "all_by_speed", "--hop-ms", "0")  # the 3 stages the tests after need
    assert end["exit"] == 0, end["stderr"]
    # each deploy was seen at the next request, which went on on it at once (it had waited out a 120 s step timeout)
    assert end["stderr"].count("the deployment on record was replaced under the chain") == 2, end["stderr"]
    assert end["stderr"].count("on the deployment saved meanwhile") == 2, end["stderr"]


def test_a_pc_paused_and_resumed_under_an_idle_server_has_its_stage_back_before_the_next_request(
        fleet: Fleet, tiny_export: Path) -> None:
    # The server holds its chain, idle, while a PC of it is paused and resumed: before, the next request's first
    # step found the stage gone and spent a failover on it while the request waited. The idle server's look asks
    # the PC that called in, and its reopening re-plans for it first.
    stages = _deployed_stages(fleet)
    assert len(stages) == AGENTS
    roster = json.loads((fleet.controller_dir / "agents.json").read_text())["body"]
    # the PC whose last call-in is oldest: an agent calls in at most once a minute
    victim = str(min((stage["agent_id"] for stage in stages), key=lambda agent: roster[agent]["registered_at"] or ""))
    local = _local_texts(fleet, tiny_export, PROMPTS[:2])

    def assigned_at() -> object:
        return next(iter(json.loads((fleet.controller_dir / "deployments.json").read_text())["body"].values())).get(
            "assigned_at")

    with _api_session(fleet, tiny_export) as session:
        assert session.complete(PROMPTS[0]) == local[0]
        assigned = assigned_at()
        _pause_and_resume(fleet, victim)
        _wait_for("the idle server to re-plan for the PC's stage", lambda: assigned_at() != assigned, timeout=60)
        assert session.complete(PROMPTS[1]) == local[1]
        end = session.end()
    assert end["exit"] == 0, end["stderr"]
    assert re.search(rf"agent {victim[:12]} on desk-{_agent_index(fleet, victim)} no longer hosts its stage \(it "
                     rf"called in since the stage was assigned at .* UTC\): re-planned in [0-9.]+ s over {AGENTS} "
                     rf"agent\(s\)", end["stderr"]), end["stderr"]
    assert "the chain broke" not in end["stderr"], end["stderr"]  # no request spent a failover on it
    assert victim in {stage["agent_id"] for stage in _deployed_stages(fleet)}


def test_a_server_stopped_while_a_step_waits_for_a_stalled_pc_exits_at_once(fleet: Fleet, tiny_export: Path) -> None:
    # SIGTERM while a PC of the chain was stalled (SIGSTOP: a frozen laptop): the engine's thread waited for the step
    # (until the link's pings gave up, 17 s), then re-planned around the PC (a survey, a deploy), while the server's
    # close waited 30 s for it, twice; it now gives the step and any re-plan up as it stops
    assert len(_deployed_stages(fleet)) == AGENTS
    victim = str(_deployed_stages(fleet)[-1]["agent_id"])
    agent = fleet.processes[fleet.agents[_agent_index(fleet, victim)].name]
    session = subprocess.Popen(
        fleet.controller.command(sys.executable, "-m", "tests.integration.fleet_stop_stalled",
                                 str(fleet.controller_dir), str(tiny_export), PROMPTS[0], "490"),
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_environment(), text=True)
    assert session.stdin is not None and session.stdout is not None
    try:
        assert session.stdout.readline() == "streaming\n"
        agent.send_signal(signal.SIGSTOP)
        session.stdin.write("stalled\n")
        session.stdin.flush()
        end = json.loads(session.stdout.readline())
    finally:
        agent.send_signal(signal.SIGCONT)
        if session.poll() is None:
            session.kill()
        session.wait()
    assert end["exit"] == 0 and end["stream"] == "error", end  # stopped mid-stream, its client told
    assert end["seconds"] < 10, end
    assert "Traceback" not in end["stderr"] and "a run failed" not in end["stderr"], end["stderr"]

    def all_answer() -> bool:
        return sum(agent["state"] in ("available", "serving") for agent in _ls(fleet)) == AGENTS

    _wait_for("every agent to answer", all_answer, timeout=60)


def test_removed_agent_is_dropped_and_refused(fleet: Fleet) -> None:
    membership = json.loads((fleet.agent_dir(2) / "state" / "membership.json").read_text())
    fleet.deskfleet("fleet", "remove", membership["agent_id"][:10])
    _wait_for("the controller to drop the removed agent",
              lambda: "was removed from the fleet: dropping its link" in fleet.log("controller"), timeout=10)
    out = fleet.run(fleet.agents[2], sys.executable, "-m", "tests.integration.fleet_probe", "revoked",
                    fleet.controller_address, membership["controller_id"], str(fleet.agent_dir(2) / "state"))
    assert json.loads(out)["revoked_agent"].startswith("refused"), out
    assert "403" in json.loads(out)["revoked_agent"]
    listed = {agent["agent_id"] for agent in _ls(fleet)}
    assert membership["agent_id"] not in listed and len(listed) == AGENTS - 1


def test_a_dead_agent_is_named_or_replanned_around(fleet: Fleet, tiny_export: Path) -> None:
    first = str(_deployed_stages(fleet)[0]["agent_id"])
    index = _agent_index(fleet, first)
    fleet.processes[fleet.agents[index].name].terminate()
    fleet.processes[fleet.agents[index].name].wait(timeout=10)
    argv = [str(BIN / "deskfleet"), "generate", "--fleet", "--model", str(tiny_export), "--prompt-ids", PROMPTS[0],
            "--max-new-tokens", "8", "--ignore-eos", "--json", "--data-dir", str(fleet.controller_dir)]
    done = subprocess.run(fleet.controller.command(*argv, "--max-failovers", "0"),
                          cwd=REPO, capture_output=True, timeout=120, env=_environment())
    assert done.returncode == 1  # a failed run, not a usage error (2)
    assert first[:12] in done.stderr.decode(), done.stderr.decode()
    # By default the chain is re-planned over the agents left: neither removed (agent 2) nor dead.
    removed = json.loads((fleet.agent_dir(2) / "state" / "membership.json").read_text())["agent_id"]
    left = AGENTS - len({removed, first})
    report = json.loads(fleet.run(fleet.controller, *argv))
    local = json.loads(fleet.run(fleet.controller, str(BIN / "deskfleet"), "generate", "--model", str(tiny_export),
                                 "--prompt-ids", PROMPTS[0], "--max-new-tokens", "8", "--ignore-eos", "--json",
                                 "--precision", "f32"))
    assert report["tokens"] == local["tokens"]
    assert [replan["lost_agent"] for replan in report["replans"]] == [first]
    stages = report["replans"][0]["stages"]
    assert len(stages) == left and not {removed, first} & {stage[0] for stage in stages}, stages
    assert report["stages"] == left  # the chain the run finished on, not the one it started on


def test_agents_find_the_controller_at_its_new_address(fleet: Fleet) -> None:
    # The controller's PC gets a new address (a DHCP lease, or its data dir moved to another PC): the agents
    # registered at the address in their join token until each joined again. They find `fleet serve`'s mDNS
    # announcement now, and save the new address.
    if fleet.controller.namespace is None:
        pytest.skip("moving the controller to another address needs the network namespaces (root)")
    states = [json.loads((fleet.agent_dir(i) / "state" / "membership.json").read_text()) for i in range(AGENTS)]
    live = [i for i in range(AGENTS) if fleet.processes[fleet.agents[i].name].poll() is None]
    removed = json.loads((fleet.controller_dir / "revoked.json").read_text())["body"]
    serving = [i for i in live if states[i]["agent_id"] not in removed]
    assert serving, "no agent left serving to find the controller"
    old_host, new_host = fleet.controller.host, f"{SUBNET}.2"
    controller = fleet.processes.pop("controller")
    controller.terminate()
    controller.wait(timeout=10)
    _ip("-n", fleet.controller.namespace, "addr", "del", f"{old_host}/24", "dev", "eth0")
    _ip("-n", fleet.controller.namespace, "addr", "add", f"{new_host}/24", "dev", "eth0")
    new_address = f"{new_host}:{fleet.controller_address.rsplit(':', 1)[1]}"
    fleet.start("controller-moved", fleet.controller, str(BIN / "deskfleet"), "-v", "fleet", "serve",
                "--data-dir", str(fleet.controller_dir), "--listen", new_address)

    def found_again() -> bool:
        return all(json.loads((fleet.agent_dir(i) / "state" / "membership.json").read_text())
                   ["controller_addresses"][0] == new_address for i in serving)

    _wait_for("the agents to find the moved controller", found_again, timeout=90)
    for i in serving:
        assert f"its mDNS announcement gives {new_address}" in fleet.log(fleet.agents[i].name)
        saved = json.loads((fleet.agent_dir(i) / "state" / "membership.json").read_text())["controller_addresses"]
        assert saved == [new_address, fleet.controller_address]
    for i in set(live) - set(serving):  # a removed agent is refused (403) by the controller: it does not look
        assert json.loads((fleet.agent_dir(i) / "state" / "membership.json").read_text()) == states[i]
