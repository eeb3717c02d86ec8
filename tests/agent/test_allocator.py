"""The process allocator: when a process re-executes on jemalloc, and that OpenVINO runs there."""

from __future__ import annotations

import ctypes.util
import json
import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from deskfleet.agent import allocator
from deskfleet.agent import cli as agent_cli
from deskfleet.agent.allocator import PRELOADED_VAR, TBB_VAR, jemalloc_environment, system_environment
from deskfleet.agent.paths import AgentPaths, AgentSettings, save_settings
from deskfleet.controller import cli

LIBRARY = "libjemalloc.so.2"


def found(name: str) -> str | None:
    return LIBRARY if name == "jemalloc" else None


def missing(name: str) -> None:
    return None


def environment(device: str = "CPU", **environ: str) -> dict[str, str] | None:
    return jemalloc_environment(device, {"PATH": "/usr/bin", **environ}, "linux", found)


def test_a_cpu_process_on_linux_re_executes_with_jemalloc_preloaded_and_tbb_without_deepbind() -> None:
    env = environment()
    assert env == {"PATH": "/usr/bin", "LD_PRELOAD": LIBRARY, TBB_VAR: "1", PRELOADED_VAR: LIBRARY,
                   "MALLOC_CONF": "background_thread:true"}


def test_jemalloc_purges_with_background_threads_unless_the_environment_says_otherwise() -> None:
    # an arena no thread uses any more never gave its freed pages back: every stage an agent let go kept its buffers
    # resident in the arena of the plugin's parked thread (38 MB a cycle on the demo target; 5 MB with them)
    env = environment(MALLOC_CONF="narenas:2")
    assert env is not None and env["MALLOC_CONF"] == "narenas:2,background_thread:true"
    env = environment(MALLOC_CONF="background_thread:false")
    assert env is not None and env["MALLOC_CONF"] == "background_thread:false"


def test_a_preload_already_there_is_kept_after_jemalloc() -> None:
    env = environment(LD_PRELOAD="/opt/libother.so")
    assert env is not None and env["LD_PRELOAD"] == f"{LIBRARY} /opt/libother.so"


@pytest.mark.parametrize("device", ["GPU", "GPU.1", "NPU", "AUTO", "HETERO:GPU,CPU"])
def test_other_devices_keep_the_system_allocator(device: str) -> None:
    assert environment(device) is None


def test_cpu_names_with_an_index_count_as_cpu() -> None:
    assert environment("cpu.0") is not None


def test_nothing_changes_off_linux_without_jemalloc_or_when_turned_off() -> None:
    assert jemalloc_environment("CPU", {}, "win32", found) is None
    assert jemalloc_environment("CPU", {}, "darwin", found) is None
    assert jemalloc_environment("CPU", {}, "linux", missing) is None
    assert environment(DESKFLEET_ALLOCATOR="system") is None
    assert environment(DESKFLEET_ALLOCATOR=" System ") is None
    assert environment(DESKFLEET_ALLOCATOR="jemalloc") is not None


def test_an_unknown_choice_is_an_error_that_names_the_variable() -> None:
    with pytest.raises(ValueError, match="DESKFLEET_ALLOCATOR='tcmalloc'"):
        environment(DESKFLEET_ALLOCATOR="tcmalloc")


def test_a_process_already_on_jemalloc_or_re_executed_once_never_loops() -> None:
    assert environment(LD_PRELOAD="/usr/lib/x86_64-linux-gnu/libjemalloc.so.2") is None
    assert environment(**{PRELOADED_VAR: LIBRARY}) is None  # the preload did not take: stay on glibc


def test_the_system_environment_undoes_exactly_what_was_added() -> None:
    before = {"PATH": "/usr/bin", "LD_PRELOAD": "/opt/libother.so"}
    after = jemalloc_environment("CPU", before, "linux", found)
    assert after is not None
    assert system_environment(after) == before
    own_conf = {"PATH": "/usr/bin", "MALLOC_CONF": "narenas:2"}
    after = jemalloc_environment("CPU", own_conf, "linux", found)
    assert after is not None and system_environment(after) == own_conf
    alone = jemalloc_environment("CPU", {"PATH": "/usr/bin"}, "linux", found)
    assert alone is not None and system_environment(alone) == {"PATH": "/usr/bin"}
    untouched = {"PATH": "/usr/bin", "LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}  # the user's own preload
    assert system_environment(untouched) == untouched


def test_in_use_reads_the_process_maps(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f10 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n")
    assert allocator.in_use(maps) == "jemalloc"
    maps.write_text("7f00-7f10 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert allocator.in_use(maps) == "system"
    assert allocator.in_use(tmp_path / "absent") == "system"


def test_the_cli_re_executes_only_its_own_command_line_and_only_when_it_runs_models(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[str] = []
    monkeypatch.setattr(cli, "run_on_jemalloc", calls.append)
    bench = ["bench", "speculative", "--model", str(tmp_path / "none"), "--device", "CPU.0"]
    assert cli.main(bench) == 2  # an argv from a caller: never replaced
    assert calls == []
    monkeypatch.setattr(sys, "argv", ["deskfleet", *bench])
    assert cli.main() == 2
    assert calls == ["CPU.0"]
    monkeypatch.setattr(sys, "argv", ["deskfleet", "fleet", "token", "--data-dir", str(tmp_path / "none")])
    assert cli.main() == 2  # no model runs here: the allocator stays
    assert calls == ["CPU.0"]


PROBE = textwrap.dedent("""
    import json, sys
    import numpy as np
    from deskfleet.agent import allocator
    allocator.run_on_jemalloc("CPU")
    import openvino as ov
    from openvino import opset13 as ops
    x = ops.parameter([-1, 8], np.float32, name="x")
    model = ov.Model([ops.relu(ops.matmul(x, ops.constant(np.eye(8, dtype=np.float32)), False, False))], [x])
    compiled = ov.Core().compile_model(model, "CPU")
    out = compiled({"x": np.arange(-8, 8, dtype=np.float32).reshape(2, 8)})[0]
    print(json.dumps({"allocator": allocator.in_use(), "sum": float(out.sum()), "argv": sys.argv[1:]}))
""")


@pytest.mark.skipif(sys.platform != "linux" or ctypes.util.find_library("jemalloc") is None,
                    reason="jemalloc is not installed (scripts/bootstrap.sh installs libjemalloc2 on Debian)")
@pytest.mark.parametrize("choice", ["jemalloc", "system"])
def test_openvino_compiles_and_runs_in_a_process_re_executed_on_jemalloc(choice: str) -> None:
    env = {key: value for key, value in os.environ.items()
           if key not in {"LD_PRELOAD", TBB_VAR, PRELOADED_VAR}}
    env["DESKFLEET_ALLOCATOR"] = choice
    done = subprocess.run([sys.executable, "-c", PROBE, "--flag", "value"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr  # without TBB_ENABLE_SANITIZERS: abort in compile_model
    report = json.loads(done.stdout)
    assert report == {"allocator": choice, "sum": 28.0, "argv": ["--flag", "value"]}


def test_the_headless_agent_picks_the_allocator_by_its_settings_device(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    calls: list[str] = []
    monkeypatch.setattr(allocator, "run_on_jemalloc", calls.append)
    save_settings(AgentPaths.resolve(tmp_path).settings_file, replace(AgentSettings(), device="GPU.1"))
    headless = ["--headless", "--data-dir", str(tmp_path)]
    assert agent_cli.main(headless) == 2  # not joined; an argv from a caller: never replaced
    assert calls == []
    monkeypatch.setattr(sys, "argv", ["deskfleet-agent", *headless])
    assert agent_cli.main() == 2
    assert calls == ["GPU.1"]


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="no signal masks on Windows")
def test_sigterm_blocked_across_the_re_exec_is_taken_again_where_no_re_exec_is_due() -> None:
    # `bench fleet`'s simulated PCs re-execute onto jemalloc through run_on_jemalloc, not the launcher: SIGTERM
    # stayed blocked for their whole life, and each stop waited 10 s for a SIGKILL
    code = textwrap.dedent("""
        import signal
        from deskfleet.agent import allocator
        from deskfleet.common.launch import block_across_exec
        block_across_exec()  # as before the exec
        allocator.jemalloc_environment = lambda device: None  # the new process: on jemalloc already
        allocator.run_on_jemalloc("CPU")
        print(sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])))
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert json.loads(run.stdout) == []
