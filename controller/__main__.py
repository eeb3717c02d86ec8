"""`python -m deskfleet.controller`: the `deskfleet` command. The fleet window's deploy dialog runs it so, with this
install's own Python, never a `deskfleet` looked up on the session's PATH."""

import sys

from deskfleet.common.launch import deskfleet

if __name__ == "__main__":  # imported (a test walking the package): nothing runs
    sys.exit(deskfleet())
