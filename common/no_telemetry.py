"""Keep OpenVINO's and NNCF's usage telemetry from leaving the PC.

`import openvino` loads openvino.tools.ovc, which sends an "import" event to www.google-analytics.com
unless a consent file (~/intel/openvino_telemetry) says no or a CI variable is set; NNCF's exporter sends
its own. deskfleet runs on employees' PCs and promises that nothing leaves the office, so every deskfleet
package calls block_openvino_telemetry() before anything imports openvino: it makes the
`openvino_telemetry` package unimportable in this process, and both libraries then fall back to their
own no-op stubs (openvino.tools.ovc.telemetry_stub, NNCF's NNCFTelemetryStub). No file is written.
DESKFLEET_OPENVINO_TELEMETRY=1 leaves the libraries as they are (their own consent rules apply).
"""

from __future__ import annotations

import os
import sys

ENV_VAR = "DESKFLEET_OPENVINO_TELEMETRY"
MODULE = "openvino_telemetry"


def block_openvino_telemetry() -> bool:
    """Make `import openvino_telemetry` fail in this process; True if it is blocked (now or already).

    False when the user opted in, or when the module was already imported before deskfleet was: then the
    libraries have already decided, and this process cannot take that back.
    """
    if os.environ.get(ENV_VAR, "").strip() == "1":
        return False
    if MODULE in sys.modules:
        return sys.modules[MODULE] is None
    sys.modules[MODULE] = None  # type: ignore[assignment]  # the documented way to make an import fail
    return True
