"""OpenVINO's and NNCF's telemetry stay off in every deskfleet process unless the user opts in."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from deskfleet.common import no_telemetry

# Runs in a fresh interpreter: records every name resolution (the telemetry sends to
# www.google-analytics.com) and which telemetry implementation openvino and nncf ended up with.
PROBE = """
import json, socket, sys
looked_up = []
def getaddrinfo(host, *args, **kwargs):
    looked_up.append(host)
    raise OSError("no network in this test")
socket.getaddrinfo = getaddrinfo
{imports}
import openvino
import openvino.tools.ovc.telemetry_utils as ovc_telemetry
from nncf.telemetry.wrapper import telemetry
print(json.dumps({{"ovc": ovc_telemetry.tm.__name__, "nncf": type(telemetry).__name__, "looked_up": looked_up}}))
"""


def _probe(imports: str, opt_in: bool) -> dict[str, object]:
    # The libraries turn their telemetry off themselves under CI variables (and nncf under pytest): the
    # probe runs with none of them, as a user's process would.
    env = {key: value for key, value in os.environ.items()
           if key not in {no_telemetry.ENV_VAR, "CI", "NNCF_CI", "NNCF_DEV", "TF_BUILD", "JENKINS_URL"}}
    if opt_in:
        env[no_telemetry.ENV_VAR] = "1"
    done = subprocess.run([sys.executable, "-c", PROBE.format(imports=imports)], env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow
def test_importing_deskfleet_first_keeps_the_telemetry_stubbed() -> None:
    result = _probe("import deskfleet.agent.stage\nimport deskfleet.controller.export", opt_in=False)
    assert result == {"ovc": "openvino.tools.ovc.telemetry_stub", "nncf": "MagicMock", "looked_up": []}


@pytest.mark.slow
def test_the_opt_in_leaves_openvino_as_it_is() -> None:
    result = _probe("import deskfleet.agent.stage", opt_in=True)
    assert result["ovc"] == "openvino_telemetry"  # the real package: its own consent rules apply


def test_block_is_a_no_op_once_the_module_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(no_telemetry.ENV_VAR, raising=False)
    monkeypatch.setitem(sys.modules, no_telemetry.MODULE, None)
    assert no_telemetry.block_openvino_telemetry()
    monkeypatch.setitem(sys.modules, no_telemetry.MODULE, object())  # imported before deskfleet was
    assert not no_telemetry.block_openvino_telemetry()
    monkeypatch.delitem(sys.modules, no_telemetry.MODULE)
    monkeypatch.setenv(no_telemetry.ENV_VAR, "1")
    assert not no_telemetry.block_openvino_telemetry()
    assert no_telemetry.MODULE not in sys.modules
