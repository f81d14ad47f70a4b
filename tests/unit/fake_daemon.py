"""Test-only entry: the real ``forkd daemon`` (config, listeners, auth, routes, runtime) on the FakeVmm.

Stands in for ``FORKD_VMM=fake`` until the backend registry lands: the cluster tests start one of these
per node as its own process, with its own FORKD_HOME. Arguments are ``forkd daemon``'s.
"""

from __future__ import annotations

import sys

import forkd.daemon.server as server
from forkd.cli.main import main
from forkd.vmm.fake import FakeVmm

if __name__ == "__main__":
    server.QemuVmm = lambda **_: FakeVmm()  # type: ignore[assignment,misc]
    sys.argv = ["forkd", "daemon", *sys.argv[1:]]
    main()
