"""Deploy and drive a chain in one process: two agent cores on loopback, the controller's survey,
deploy (twice: the second sends nothing), and greedy tokens through the network equal to the local run."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest

from deskfleet.agent.core import AgentCore
from deskfleet.agent.link import TlsFiles, start_server, utc_now
from deskfleet.agent.paths import AgentSettings, Thresholds
from deskfleet.agent.shard_cache import ShardCache
from deskfleet.common.model_spec import ManifestError, load_manifest
from deskfleet.common.planner import PlanOptions, PlanPolicy
from deskfleet.common.wire import Precision
from deskfleet.controller.engine import Engine, StreamRequest
from deskfleet.controller.fleet_ca import init_fleet, load_ca
from deskfleet.controller.fleet_deploy import (
    DeployError,
    DeploySettings,
    StagePlacement,
    deploy,
    load_deploy_settings,
    load_deployment,
    model_id_of,
    undeployed_stages,
    verify_export,
)
from deskfleet.controller.fleet_failover import FleetFailover
from deskfleet.controller.fleet_pipeline import ChainError, FleetPipeline
from deskfleet.controller.fleet_store import FleetStore
from deskfleet.controller.fleet_survey import SurveyOptions, survey
from tests.agent.test_core import FakeMonitor
from tests.fleet_pki import make_member
from tests.ports import free_port

pytestmark = pytest.mark.slow




def drive(store: FleetStore, model: Path) -> list[int]:
    with FleetPipeline.from_store(store, model) as chain:
        engine = Engine(chain, load_manifest(model).spec)
        engine.add(StreamRequest([1, 7, 9, 3], max_new_tokens=6, ignore_eos=True))
        return engine.run()[0].tokens


def test_deploy_twice_and_generate(tmp_path: Path, tiny_export: Path) -> None:
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    ca = load_ca(store)
    settings = AgentSettings(thresholds=Thresholds(require_ac_power=False, min_free_memory_bytes=None))
    ports = [free_port(), free_port()]

    async def scenario() -> tuple[list[int], dict[str, int]]:
        servers = []
        for index, port in enumerate(ports):
            files = make_member(ca, tmp_path / f"agent{index}", "agent")
            core = AgentCore(files, settings, ShardCache(tmp_path / f"cache{index}", 1 << 30), FakeMonitor(),
                             device_probe=lambda: ("CPU",))
            servers.append(await start_server(core.serve_link, "127.0.0.1", port, files))
        options = SurveyOptions(peers=tuple(f"127.0.0.1:{port}" for port in ports), discover_seconds=0)
        # free hops: the tiny model's whole token computes in less than a hop, so with hops priced one PC takes it
        policy = PlanOptions(policy=PlanPolicy.ALL_BY_SPEED, hop_cost=0.0)
        for _ in range(2):
            found = await survey(store, options)
            assert len(found.reachable()) == 2
            try:
                _, report = await deploy(store, tiny_export, found, policy, Precision.F32, kv_cache="f32")
            finally:
                await found.close()
        with pytest.raises(ManifestError, match=r"no manifest\.json"):
            await deploy(store, tmp_path, found, policy)
        with pytest.raises(DeployError, match="f32 is exact"):
            await deploy(store, tiny_export, found, policy, Precision.F32, kv_cache="u8")
        # a device no PC has: refused by the plan, naming each PC and what it has, before a byte is sent
        with pytest.raises(DeployError, match=r"cannot deploy .*: none of the 2 agent\(s\) that answered can take "
                                              r"work \(2 no device\).*left out: "
                                              r"\w+ no GPU: OpenVINO finds CPU on it; \w+ no GPU: OpenVINO finds CPU"):
            found = await survey(store, options)
            try:
                await deploy(store, tiny_export, found, policy, Precision.F32, "GPU", kv_cache="f32")
            finally:
                await found.close()
        assert load_deploy_settings(store, tiny_export) == DeploySettings(PlanPolicy.ALL_BY_SPEED, 1, Precision.F32,
                                                                          "CPU", "f32", hop_cost=0.0)
        # The first stage's agent broke the chain: the failover re-plans over the other one, found through
        # the deployment's addresses alone (nothing registered, no mDNS, no peers given), and saves the plan.
        left_out = report.stages[0].agent_id
        failover = FleetFailover(store, tiny_export, 1, SurveyOptions(discover_seconds=0))
        chain = await asyncio.to_thread(failover, ChainError("the link closed", left_out))
        try:
            assert {stage.agent_id for stage in chain.stages} == {report.stages[1].agent_id}
            assert load_deployment(store, tiny_export) == chain.stages
            assert failover.replans[0]["lost_agent"] == left_out
        finally:
            await asyncio.to_thread(failover.close)
        # The driver runs its own event loop thread, as `deskfleet generate --fleet` does.
        tokens = await asyncio.to_thread(drive, store, tiny_export)
        for server in servers:
            server.close()
            await server.wait_closed()
        return tokens, report.bytes_sent

    tokens, second_sent = asyncio.run(scenario())
    assert set(second_sent.values()) == {0}
    local = subprocess.run([str(Path(sys.executable).parent / "deskfleet"), "generate", "--model", str(tiny_export),
                            "--prompt-ids", "1,7,9,3", "--max-new-tokens", "6", "--ignore-eos", "--precision", "f32",
                            "--json"], capture_output=True, check=True)
    assert tokens == json.loads(local.stdout)["tokens"]


def test_candidates_take_the_measured_speed_and_unmeasured_agents_count_as_the_slowest() -> None:
    from deskfleet.common.agent_state import AgentState
    from deskfleet.common.wire import StatusReport
    from deskfleet.controller.fleet_deploy import candidates_of

    def view(agent_id: str, speed: float | None) -> object:
        report = StatusReport(AgentState.AVAILABLE, 8 << 30, 0.1, None, None, None, None, (), None, speed)
        return type("View", (), {"agent_id": agent_id, "hostname": "?", "report": report})()

    candidates = candidates_of([view("a" * 52, 30.0), view("b" * 52, 10.0), view("c" * 52, None)])  # type: ignore[list-item]
    assert [candidate.speed for candidate in candidates] == [30.0, 10.0, 10.0]


def test_on_a_cpu_the_head_is_priced_by_parameters(tiny_export: Path) -> None:
    from deskfleet.controller.fleet_deploy import footprint_of

    manifest = load_manifest(tiny_export)
    spec = manifest.spec
    cpu = footprint_of(manifest, "CPU")
    per_parameter = sum(manifest.layer_bytes) / (spec.num_layers * spec.layer_parameters)
    assert cpu.head_work == pytest.approx(spec.head_parameters * per_parameter)
    assert cpu.head_bytes == manifest.head_bytes and cpu.layer_bytes == manifest.layer_bytes
    assert footprint_of(manifest, "cpu.0").head_work == cpu.head_work
    for device in ("GPU", "GPU.1", "NPU", "AUTO"):  # bound by reading memory: bytes
        assert footprint_of(manifest, device).head_work is None


def test_layer_parameters_match_the_checkpoint(checkpoint_factory: Callable[..., Path]) -> None:
    from safetensors.numpy import load_file

    from deskfleet.controller.export.hf_config import read_checkpoint_config

    checkpoint = checkpoint_factory("params-gqa", num_attention_heads=4, num_key_value_heads=2)
    tensors = load_file(str(checkpoint / "model.safetensors"))
    prefix = "model.layers.0."
    counted = sum(array.size for name, array in tensors.items()
                  if name.startswith(prefix) and name.endswith("proj.weight"))
    spec = read_checkpoint_config(checkpoint).spec
    assert spec.layer_parameters == counted
    assert spec.head_parameters == tensors["model.embed_tokens.weight"].size


def test_an_agent_hosting_two_models_runs_each_step_on_its_models_stage(
        tmp_path: Path, tiny_export: Path, checkpoint_factory: Callable[..., Path],
        export_factory: Callable[[Path, str], Path]) -> None:
    # A second model deployed onto the same PC used to break both: a Forward named no model, so the agent
    # found two stages that could take it. Every step now names its model.
    other = export_factory(checkpoint_factory("other-model", num_hidden_layers=4), "f32")
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    settings = AgentSettings(thresholds=Thresholds(require_ac_power=False, min_free_memory_bytes=None))
    port = free_port()

    async def scenario() -> dict[Path, list[int]]:
        files = make_member(load_ca(store), tmp_path / "agent", "agent")
        core = AgentCore(files, settings, ShardCache(tmp_path / "cache", 1 << 30), FakeMonitor())
        server = await start_server(core.serve_link, "127.0.0.1", port, files)
        found = await survey(store, SurveyOptions(peers=(f"127.0.0.1:{port}",), discover_seconds=0))
        try:
            for model in (tiny_export, other):
                await deploy(store, model, found, PlanOptions(), Precision.F32, kv_cache="f32")
        finally:
            await found.close()
        assert len(core.stages) == 2
        tokens = {model: await asyncio.to_thread(drive, store, model) for model in (tiny_export, other)}
        server.close()
        await server.wait_closed()
        return tokens

    tokens = asyncio.run(scenario())
    for model in (tiny_export, other):
        local = subprocess.run([str(Path(sys.executable).parent / "deskfleet"), "generate", "--model", str(model),
                                "--prompt-ids", "1,7,9,3", "--max-new-tokens", "6", "--ignore-eos", "--precision",
                                "f32", "--json"], capture_output=True, check=True)
        assert tokens[model] == json.loads(local.stdout)["tokens"]
    assert tokens[tiny_export] != tokens[other]


def chain_tokens(store: FleetStore, model: Path, placements: tuple[StagePlacement, ...]) -> list[int]:
    """local_tokens' prompt generated over the chain of `placements` (deployed from `store`'s data dir)."""
    with FleetPipeline(placements, store.tls_files, model_id=model_id_of(model)) as chain:
        engine = Engine(chain, load_manifest(model).spec)
        engine.add(StreamRequest([1, 7, 9, 3], max_new_tokens=6, ignore_eos=True))
        return engine.run()[0].tokens


def local_tokens(model: Path) -> list[int]:
    local = subprocess.run([str(Path(sys.executable).parent / "deskfleet"), "generate", "--model", str(model),
                            "--prompt-ids", "1,7,9,3", "--max-new-tokens", "6", "--ignore-eos", "--precision", "f32",
                            "--json"], capture_output=True, check=True)
    return list(json.loads(local.stdout)["tokens"])


def _one_pc_fleet(tmp_path: Path) -> tuple[FleetStore, TlsFiles]:
    """A controller data dir with a fleet, and one member's credentials."""
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    return store, make_member(load_ca(store), tmp_path / "agent", "agent")


async def _deploy_to_a_fresh_agent(store: FleetStore, files: TlsFiles, cache: Path, model: Path
                                   ) -> tuple[int, list[int]]:
    """Start an agent on `cache` (a restarted agent: its cache, nothing hosted), deploy `model` to it and drive the
    chain; (bytes sent, the tokens)."""
    settings = AgentSettings(thresholds=Thresholds(require_ac_power=False, min_free_memory_bytes=None))
    port = free_port()
    core = AgentCore(files, settings, ShardCache(cache, 1 << 30), FakeMonitor())
    server = await start_server(core.serve_link, "127.0.0.1", port, files)
    found = await survey(store, SurveyOptions(peers=(f"127.0.0.1:{port}",), discover_seconds=0))
    try:
        _, report = await deploy(store, model, found, PlanOptions(), Precision.F32, kv_cache="f32")
        tokens = await asyncio.to_thread(drive, store, model)
    finally:
        await found.close()
        server.close()
        await server.wait_closed()
    return sum(report.bytes_sent.values()), tokens


def test_a_shard_corrupted_in_an_agents_cache_is_sent_again_by_the_next_deploy(
        tmp_path: Path, tiny_export: Path) -> None:
    # The cache verified a shard once, then the disk changed it: the stage build refused it on every deploy and
    # nothing was resent (the cache only checks that a blob exists). The agent now drops what fails the check
    # and the deploy sends it again.
    store, files = _one_pc_fleet(tmp_path)
    layer = load_manifest(tiny_export).files["layer_001.bin"]
    reference = local_tokens(tiny_export)

    async def deploy_on_a_fresh_agent() -> tuple[int, list[int]]:
        return await _deploy_to_a_fresh_agent(store, files, tmp_path / "cache", tiny_export)

    def damage(sha256: str) -> None:
        blob = tmp_path / "cache" / "blobs" / sha256
        blob.chmod(0o644)
        damaged = bytearray(blob.read_bytes())
        damaged[::4096] = bytes(byte ^ 0x40 for byte in damaged[::4096])  # the same size, other bytes
        blob.write_bytes(bytes(damaged))

    first_sent, first_tokens = asyncio.run(deploy_on_a_fresh_agent())
    damage(layer.sha256)
    resent, tokens = asyncio.run(deploy_on_a_fresh_agent())
    assert first_tokens == tokens == reference
    assert first_sent > resent >= layer.size  # the damaged layer went again, not the whole model
    manifest_bytes = (tiny_export / "manifest.json").read_bytes()
    damage(hashlib.sha256(manifest_bytes).hexdigest())  # the manifest is a shard too (the build does not check it)
    resent, tokens = asyncio.run(deploy_on_a_fresh_agent())
    assert tokens == reference and resent == len(manifest_bytes)


def test_a_shard_damaged_while_it_was_received_is_sent_again_by_the_same_deploy(
        tmp_path: Path, tiny_export: Path) -> None:
    # What a PC had received of a shard (a deploy stopped midway) was damaged on its disk; the next deploy resumed it,
    # the whole did not hash to its sha256, and the deploy failed ("arrived corrupted"): only the one after went through
    store, files = _one_pc_fleet(tmp_path)
    layer = load_manifest(tiny_export).files["layer_001.bin"]
    partial = tmp_path / "cache" / "partial"
    partial.mkdir(parents=True)
    received = (tiny_export / "layer_001.bin").read_bytes()[:layer.size // 2]
    (partial / f"{layer.sha256}-{layer.size}.part").write_bytes(bytes(byte ^ 0x40 for byte in received))

    whole, _ = asyncio.run(_deploy_to_a_fresh_agent(store, files, tmp_path / "clean-cache", tiny_export))
    sent, tokens = asyncio.run(_deploy_to_a_fresh_agent(store, files, tmp_path / "cache", tiny_export))
    assert sent == whole - len(received) + layer.size  # the rest of it, then all of it again
    assert not list(partial.iterdir()) and tokens == local_tokens(tiny_export)


def test_fleet_plan_uses_the_live_agents_and_says_why_each_other_one_was_left_out(
        tmp_path: Path, tiny_export: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # `fleet plan --model` closed the survey's links before planning and so saw no agent at all; an agent
    # unavailable by its owner's limits was "reason not reported", and a peer that did not answer was not listed.
    from deskfleet.controller.cli import main

    data = tmp_path / "controller"
    store = FleetStore(data)
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    usable = AgentSettings(thresholds=Thresholds(require_ac_power=False, min_free_memory_bytes=None))
    starved = AgentSettings(thresholds=Thresholds(require_ac_power=False, min_free_memory_bytes=64 << 30))
    ports = [free_port(), free_port()]
    dead = f"127.0.0.1:{free_port()}"

    async def scenario() -> int:
        servers = []
        for index, (port, settings) in enumerate(zip(ports, (usable, starved), strict=True)):
            files = make_member(load_ca(store), tmp_path / f"agent{index}", "agent")
            core = AgentCore(files, settings, ShardCache(tmp_path / f"cache{index}", 1 << 30), FakeMonitor(),
                             device_probe=lambda: ("CPU",))
            servers.append(await start_server(core.serve_link, "127.0.0.1", port, files))
        peers = [option for address in (*(f"127.0.0.1:{port}" for port in ports), dead)
                 for option in ("--peer", address)]
        code = await asyncio.to_thread(main, ["fleet", "plan", "--model", str(tiny_export), *peers,
                                              "--discover-seconds", "0", "--data-dir", str(data)])
        listed = await asyncio.to_thread(main, ["fleet", "ls", *peers, "--discover-seconds", "0", "--data-dir",
                                                str(data)])
        assert listed == 0
        for server in servers:
            server.close()
            await server.wait_closed()
        return code

    assert asyncio.run(scenario()) == 0
    out = capsys.readouterr().out
    assert "1 stage(s):" in out
    assert "unavailable: low memory (8.0 GiB free of 16.0 (min_free_memory_bytes 64.0 GiB))" in out
    # `fleet ls` says why too: the numbers and the setting they cross
    assert any(line.split()[3:4] == ["unavailable"] and line.endswith("(8.0 GiB free of 16.0 (min_free_memory_bytes "
                                                                      "64.0 GiB))") for line in out.splitlines())
    assert f"unreachable at {dead}: cannot reach" in out


def test_a_damaged_file_in_the_export_is_named(tmp_path: Path, tiny_export: Path) -> None:
    # The agent discards a shard whose bytes are not its hash; the deploy used to pass on "shard 8e0f… arrived
    # corrupted, send it again", which a re-run repeated: the export itself is damaged, and now it says which file.
    import shutil

    damaged = tmp_path / "export"
    shutil.copytree(tiny_export, damaged)
    layer = damaged / "layer_002.bin"
    layer.write_bytes(bytes(reversed(layer.read_bytes())))  # the same size, other bytes
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    settings = AgentSettings(thresholds=Thresholds(require_ac_power=False, min_free_memory_bytes=None))

    async def scenario() -> None:
        port = free_port()
        files = make_member(load_ca(store), tmp_path / "agent", "agent")
        core = AgentCore(files, settings, ShardCache(tmp_path / "cache", 1 << 30), FakeMonitor())
        server = await start_server(core.serve_link, "127.0.0.1", port, files)
        found = await survey(store, SurveyOptions(peers=(f"127.0.0.1:{port}",), discover_seconds=0))
        try:
            with pytest.raises(DeployError, match=r"layer_002\.bin is damaged: .* export the model again"):
                await deploy(store, damaged, found, PlanOptions(), Precision.F32, kv_cache="f32")
            # a tampered folder linking a file from elsewhere in: named, and not one of its bytes sent
            layer.write_bytes((tiny_export / "layer_002.bin").read_bytes())
            outside = tmp_path / "secret.bin"
            outside.write_bytes((damaged / "layer_003.bin").read_bytes())
            (damaged / "layer_003.bin").unlink()
            (damaged / "layer_003.bin").symlink_to(outside)
            with pytest.raises(DeployError, match=r"layer_003\.bin is a symbolic link"):
                await deploy(store, damaged, found, PlanOptions(), Precision.F32, kv_cache="f32")
            assert not any((tmp_path / "cache" / "blobs").glob(hashlib.sha256(outside.read_bytes()).hexdigest()))
            # damaged after the PC got every file: the admin's deploy (verify_export first) hashes them all and names
            # it, where it sent nothing and said "deployed", and the first re-plan that sent the file failed mid-run
            (damaged / "layer_003.bin").unlink()
            (damaged / "layer_003.bin").write_bytes(outside.read_bytes())
            verify_export(damaged)
            await deploy(store, damaged, found, PlanOptions(), Precision.F32, kv_cache="f32")
            layer.write_bytes(bytes(reversed(layer.read_bytes())))
            told: list[tuple[int, int]] = []
            with pytest.raises(DeployError, match=r"layer_002\.bin is corrupted: .* export the model again"):
                verify_export(damaged, lambda files, size: told.append((files, size)))
            assert told and told[0][1] == sum(path.stat().st_size for path in damaged.iterdir()
                                              if path.name != "manifest.json")
            _, report = await deploy(store, damaged, found, PlanOptions(), Precision.F32, kv_cache="f32")
            assert sum(report.bytes_sent.values()) == 0  # a re-plan hashes only what it sends: the PC holds it all
        finally:
            await found.close()
            server.close()
            await server.wait_closed()

    asyncio.run(scenario())


def test_the_bytes_sent_are_read_through_the_handle_that_was_checked(tmp_path: Path) -> None:
    # Checked, then opened again to send, a file swapped for a link in between was sent (the secret's bytes).
    from deskfleet.common.wire import ManifestEntry
    from deskfleet.controller.fleet_deploy import _open_export_file

    folder = tmp_path / "model"
    folder.mkdir()
    data = b"genuine weights\n"
    (folder / "layer_000.bin").write_bytes(data)
    entry = ManifestEntry("layer_000.bin", hashlib.sha256(data).hexdigest(), len(data))
    secret = tmp_path / "secret"
    secret.write_bytes(b"TOP-SECRET-KEY!\n")  # the same size
    with _open_export_file(folder, entry) as stream:
        (folder / "layer_000.bin").unlink()
        (folder / "layer_000.bin").symlink_to(secret)
        assert stream.read() == data
    with pytest.raises(DeployError, match=r"layer_000\.bin is a symbolic link"):
        _open_export_file(folder, entry)


def test_a_re_export_deployed_again_releases_the_old_exports_stages(tmp_path: Path, tiny_export: Path) -> None:
    # A re-export (a new id) deployed again left the old export's stages hosted on every PC, listed as serving,
    # with deployments.json naming both ids for one folder: nothing could drive the old one or release it.
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    ca = load_ca(store)
    settings = AgentSettings(thresholds=Thresholds(require_ac_power=False, min_free_memory_bytes=None))
    model, elsewhere = tmp_path / "model", tmp_path / "elsewhere" / "model"
    shutil.copytree(tiny_export, model)
    shutil.copytree(tiny_export, elsewhere)  # the same model's name, another export: another folder's deployment
    (elsewhere / "manifest.json").write_text((elsewhere / "manifest.json").read_text() + "\n\n")
    ports = [free_port(), free_port()]
    policy = PlanOptions(policy=PlanPolicy.ALL_BY_SPEED, hop_cost=0.0)

    async def scenario() -> None:
        cores, servers = [], []
        for index, port in enumerate(ports):
            files = make_member(ca, tmp_path / f"agent{index}", "agent")
            cores.append(AgentCore(files, settings, ShardCache(tmp_path / f"cache{index}", 1 << 30), FakeMonitor(),
                                   device_probe=lambda: ("CPU",)))
            servers.append(await start_server(cores[-1].serve_link, "127.0.0.1", port, files))
        options = SurveyOptions(peers=tuple(f"127.0.0.1:{port}" for port in ports), discover_seconds=0)

        async def deploy_once(folder: Path) -> str:
            found = await survey(store, options)
            try:
                _, report = await deploy(store, folder, found, policy)
            finally:
                await found.close()
            return report.model_id

        other = await deploy_once(elsewhere)
        old = await deploy_once(model)
        assert all({ref.model_id for ref in core.stages} == {other, old} for core in cores)
        manifest = model / "manifest.json"  # exported again: the same model, a manifest of other bytes
        manifest.write_text(manifest.read_text() + "\n")
        new = await deploy_once(model)
        assert len({other, old, new}) == 3
        # the other folder's export is that deployment's: kept, and still placed
        assert all({ref.model_id for ref in core.stages} == {other, new} for core in cores)
        records = json.loads((store.data_dir / "deployments.json").read_text())["body"]
        assert sorted(records) == sorted([other, new]) and records[new]["replaces"] == [old]
        assert undeployed_stages(store, {core.agent_id: list(core.stages) for core in cores}) == {}
        for server in servers:
            server.close()
            await server.wait_closed()

    asyncio.run(scenario())


@pytest.mark.parametrize("damage", ["lost", "cut"])
def test_a_deploy_checks_every_file_of_the_export_not_only_those_it_sends(tmp_path: Path, tiny_export: Path,
                                                                         damage: str) -> None:
    # an export missing layer_006.xml deployed ("0 bytes in 0 file(s) sent") where every PC held the file
    damaged = tmp_path / "export"
    shutil.copytree(tiny_export, damaged)
    layer = damaged / "layer_001.xml"
    if damage == "lost":
        layer.unlink()
    else:
        layer.write_bytes(layer.read_bytes()[:100])
    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    said = "is missing, though the export's manifest.json names it" if damage == "lost" else \
        r"has 100 bytes, the manifest says \d+: export the model again"
    with pytest.raises(ManifestError, match=said):  # before any agent is asked
        asyncio.run(deploy(store, damaged, cast(Any, None), PlanOptions(), Precision.F32, kv_cache="f32"))


def test_an_agents_refusal_names_the_files_of_the_shards_it_names() -> None:
    # an agent knows shards by content only: "cannot store shard c8f2a7394e6c… ... disk full" named no file
    from deskfleet.common.wire import ManifestEntry
    from deskfleet.controller.fleet_deploy import _name_shards

    head, layer = "c8f2a7394e6c" + "0" * 52, "ab" * 32
    by_sha = {head: ManifestEntry("head.bin", head, 10), layer: ManifestEntry("layer_000.bin", layer, 10)}
    named = _name_shards(f"refused: disk_full: cannot store shard {head[:12]}… (bytes 0 to 4 of 10): full", by_sha)
    assert named == f"refused: disk_full: cannot store shard {head[:12]}… (head.bin) (bytes 0 to 4 of 10): full"
    assert _name_shards("refused: busy: another deploy", by_sha) == "refused: busy: another deploy"


@pytest.mark.parametrize("stop", ["an agent failed", "Ctrl-C"])
def test_a_deploy_that_does_not_finish_releases_the_stages_it_assigned(
        tmp_path: Path, tiny_export: Path, monkeypatch: pytest.MonkeyPatch, stop: str) -> None:
    # A walk's deploy stopped by Ctrl-C left a compiled stage on an employee's PC until the agent restarted: `fleet
    # ls` listed it as not deployed, and said only a deploy of that model (the one just cancelled) would release it.
    import deskfleet.controller.fleet_deploy as fleet_deploy

    store = FleetStore(tmp_path / "controller")
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    ca = load_ca(store)
    settings = AgentSettings(thresholds=Thresholds(require_ac_power=False, min_free_memory_bytes=None))
    ports = [free_port(), free_port()]
    real_deploy_stage = fleet_deploy._deploy_stage
    assigned: list[str] = []

    async def second_stage_fails(link: Any, *args: Any, **kwargs: Any) -> None:
        if link.peer.agent_id == order[1]:
            while not assigned:  # the first stage's agent holds its stage by now
                await asyncio.sleep(0.01)
            if stop == "Ctrl-C":
                await asyncio.Event().wait()  # the deploy's task is cancelled meanwhile, as a Ctrl-C does
            raise DeployError("agent b: the link closed", agents=frozenset({order[1]}))
        await real_deploy_stage(link, *args, **kwargs)
        assigned.append(link.peer.agent_id)

    monkeypatch.setattr(fleet_deploy, "_deploy_stage", second_stage_fails)
    order: list[str] = []

    async def scenario() -> list[AgentCore]:
        cores, servers = [], []
        for index, port in enumerate(ports):
            files = make_member(ca, tmp_path / f"agent{index}", "agent")
            core = AgentCore(files, settings, ShardCache(tmp_path / f"cache{index}", 1 << 30), FakeMonitor(),
                             device_probe=lambda: ("CPU",))
            cores.append(core)
            servers.append(await start_server(core.serve_link, "127.0.0.1", port, files))
        found = await survey(store, SurveyOptions(peers=tuple(f"127.0.0.1:{port}" for port in ports),
                                                  discover_seconds=0))
        plan = fleet_deploy.plan_survey(fleet_deploy.footprint_of(load_manifest(tiny_export), "CPU", Precision.F32,
                                                                  "f32"), found,
                                        PlanOptions(policy=PlanPolicy.ALL_BY_SPEED, hop_cost=0.0))
        order.extend(stage.agent_id for stage in plan.stages)
        assert len(order) == 2
        try:
            deploying = asyncio.create_task(deploy(store, tiny_export, found, PlanOptions(
                policy=PlanPolicy.ALL_BY_SPEED, hop_cost=0.0), Precision.F32, kv_cache="f32"))
            if stop == "Ctrl-C":
                while not assigned:
                    await asyncio.sleep(0.01)
                deploying.cancel()
            with pytest.raises(DeployError if stop == "an agent failed" else asyncio.CancelledError):
                await deploying
            first = next(core for core in cores if core.agent_id == order[0])
            for _ in range(200):  # the release arrives on the link after the assignment
                if not first.stages:
                    break
                await asyncio.sleep(0.02)
        finally:
            await found.close()
            for server in servers:
                server.close()
                await server.wait_closed()
        return cores

    cores = asyncio.run(scenario())
    assert assigned and all(not core.stages for core in cores)
    with pytest.raises(DeployError, match="has not been deployed"):
        load_deployment(store, tiny_export)


def test_a_pc_whose_shard_cache_has_no_room_is_left_out_of_the_plan_and_the_deploy_goes_on(
        tmp_path: Path, tiny_export: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A plan gave a stage to a PC whose disk had no room for its files: the deploy failed whole at its start on
    # that PC's refusal, and a run's re-plan ended the run. The agent reports its shard cache's room
    # (StatusReport.shard_room_bytes) and the plan leaves the PC out, saying so.
    from deskfleet.controller.cli import main

    data = tmp_path / "controller"
    store = FleetStore(data)
    init_fleet(store, "test", ("127.0.0.1:1",), utc_now())
    settings = AgentSettings(thresholds=Thresholds(require_ac_power=False, min_free_memory_bytes=None))
    ports = [free_port(), free_port()]
    # below any stage's files: one layer's weights alone, without its .xml, the RoPE table and the manifest
    smallest_layer = min(load_manifest(tiny_export).layer_bytes)

    async def scenario() -> tuple[list[str], list[int]]:
        servers, ids = [], []
        for index, (port, limit) in enumerate(zip(ports, (1 << 30, smallest_layer - 1), strict=True)):
            files = make_member(load_ca(store), tmp_path / f"agent{index}", "agent")
            ids.append(files.own_identity().agent_id)
            core = AgentCore(files, settings, ShardCache(tmp_path / f"cache{index}", limit), FakeMonitor(),
                             device_probe=lambda: ("CPU",))
            servers.append(await start_server(core.serve_link, "127.0.0.1", port, files))
        peers = tuple(f"127.0.0.1:{port}" for port in ports)
        found = await survey(store, SurveyOptions(peers=peers, discover_seconds=0))
        try:
            plan, report = await deploy(store, tiny_export, found, PlanOptions(policy=PlanPolicy.ALL_BY_SPEED,
                                                                               hop_cost=0.0), Precision.F32,
                                        kv_cache="f32")
        finally:
            await found.close()
        left = {exclusion.agent_id: exclusion for exclusion in plan.exclusions}
        assert [stage.agent_id for stage in report.stages] == [ids[0]]
        assert left[ids[1]].reason.value == "too_little_disk"
        listed = await asyncio.to_thread(main, ["fleet", "ls", "--json", *(f"--peer={peer}" for peer in peers),
                                                "--discover-seconds", "0", "--data-dir", str(data)])
        assert listed == 0
        tokens = await asyncio.to_thread(drive, store, tiny_export)
        for server in servers:
            server.close()
            await server.wait_closed()
        return ids, tokens

    ids, tokens = asyncio.run(scenario())
    rooms = {entry["agent_id"]: entry["shard_room_bytes"] for entry in json.loads(capsys.readouterr().out)}
    assert rooms[ids[1]] == smallest_layer - 1 and rooms[ids[0]] > 0
    assert len(tokens) == 6
