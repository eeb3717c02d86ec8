"""`python -m deskfleet.agent`: the `deskfleet-agent` command. Autostart runs it so, with the install's own Python
(pythonw.exe on Windows, which opens no console window), never a `deskfleet-agent` looked up on the session's PATH."""

import sys

from deskfleet.common.launch import deskfleet_agent

if __name__ == "__main__":  # imported (a test walking the package): nothing runs
    sys.exit(deskfleet_agent())
