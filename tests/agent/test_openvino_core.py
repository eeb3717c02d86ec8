"""One OpenVINO Core per process (agent/openvino_core.py): stages released in any order, on any thread, leave a
Ctrl-C handled instead of a segmentation fault."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from deskfleet.agent.openvino_core import openvino_core

# Releases compiled stages the ways that left a thread's alternate signal stack unmapped when each stage loaded a
# CPU plugin of its own, then takes a Ctrl-C. Each case runs in a fresh interpreter: the crash kills the process.
RELEASED_THEN_CTRL_C = """
import gc, signal, sys, threading
from pathlib import Path
from deskfleet.agent.stage import LayerRange, Stage
from deskfleet.common.model_spec import load_manifest
from deskfleet.controller.pipeline import LocalPipeline

model, case = Path(sys.argv[1]), sys.argv[2]
manifest = load_manifest(model)
if case == "pipeline":  # stages made in chain order and let go of together, as generate --stages 3 does
    with LocalPipeline(model, 3, manifest=manifest) as pipeline:
        pass
    del pipeline
elif case == "other thread":  # made on this thread, released on another (an agent's to_thread, the reverse)
    layers = manifest.spec.num_layers
    held = [Stage(model, manifest, LayerRange(0, layers, layers))]
    releaser = threading.Thread(target=lambda: (held.clear(), gc.collect()))  # a stage's sessions refer to it
    releaser.start()
    releaser.join()
gc.collect()
handled = []
signal.signal(signal.SIGINT, lambda signum, frame: handled.append(signum))
signal.raise_signal(signal.SIGINT)
print("handled" if handled else "not handled")
"""


def _released_then_ctrl_c(model: Path, case: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", RELEASED_THEN_CTRL_C, str(model), case], capture_output=True,
                          text=True, timeout=300, check=False)


def test_a_ctrl_c_after_a_pipeline_of_three_stages_was_released_is_handled(tiny_export: Path) -> None:
    done = _released_then_ctrl_c(tiny_export, "pipeline")
    assert (done.returncode, done.stdout.strip()) == (0, "handled"), done.stderr[-2000:]  # was -11


def test_a_ctrl_c_after_a_stage_was_released_on_another_thread_is_handled(tiny_export: Path) -> None:
    done = _released_then_ctrl_c(tiny_export, "other thread")
    assert (done.returncode, done.stdout.strip()) == (0, "handled"), done.stderr[-2000:]  # was -11


def test_threads_asking_at_once_share_one_core(monkeypatch: pytest.MonkeyPatch) -> None:
    # two Cores made at once would be two CPU plugins again, the very case the module exists to prevent
    from deskfleet.agent import openvino_core as module

    made: list[object] = []

    def slow_core() -> object:
        time.sleep(0.05)  # every thread arrives while the first is still making it
        made.append(object())
        return made[-1]

    monkeypatch.setattr(module, "_core", None)
    monkeypatch.setattr(module.ov, "Core", slow_core)
    seen: list[object] = []
    threads = [threading.Thread(target=lambda: seen.append(openvino_core())) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(made) == 1 and seen == made * 8
