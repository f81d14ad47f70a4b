"""The E2B gateway over a cluster (docs/e2b.md, "A cluster behind one endpoint"): the unmodified E2B
Python SDK talks only to ``forkd cluster e2b``, in front of three real daemons (fake VMM backend, each
with its own FORKD_HOME and E2B front, one key file) on ``ray.cluster_utils`` raylets. Every wait is
bounded.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray", reason="the cluster tests need the forkd[ray] extra (scripts/setup installs it)")
e2b = pytest.importorskip("e2b", reason="the E2B SDK comes with the test extra")
e2b_code_interpreter = pytest.importorskip("e2b_code_interpreter", reason="the E2B SDK comes with the test extra")

from cluster_harness import raylet_nodes
from cluster_nodes import SLOTS, ForkdNode, free_port

pytestmark = pytest.mark.timeout(600)
TAG = "base"
KEY_A, KEY_B = ("e2b_" + secrets.token_hex(20) for _ in range(2))
BOUND_S = 60.0


@pytest.fixture
def cluster() -> Iterator[tuple[str, list[ForkdNode], object]]:
    """The nodes (node 0 holds the template), Ray, and the gateway; its URL, the nodes, Ray's cluster."""
    root = Path(tempfile.mkdtemp(prefix="fkg-", dir="/tmp"))  # short: Unix socket paths
    keys = root / "e2b-keys"
    keys.write_text(f"{KEY_A} team-a\n{KEY_B} team-b\n")
    keys.chmod(0o600)
    forkd = [ForkdNode(f"n{i}", root / f"n{i}", e2b_keys=keys) for i in range(3)]
    gateway = None
    try:
        for node in forkd:
            node.start_daemon()
        forkd[0].bake(TAG)
        with raylet_nodes(root, forkd) as ray_cluster:
            port = free_port()
            log = open(root / "gateway.log", "ab")  # noqa: SIM115 - the gateway writes it until it ends
            gateway = subprocess.Popen([sys.executable, "-m", "forkd", "cluster", "e2b", "--listen",
                                        f"127.0.0.1:{port}", "--ray-address", ray_cluster.address],
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            log.close()
            url = f"http://127.0.0.1:{port}"
            until(lambda: _health(url).get("nodes") == 3, f"the gateway did not see 3 nodes: "
                  f"{(root / 'gateway.log').read_text()[-3000:]}")
            yield url, forkd, ray_cluster
    finally:
        if gateway is not None:
            gateway.send_signal(signal.SIGTERM)
            try:
                gateway.wait(30)
            except subprocess.TimeoutExpired:
                gateway.kill()
                gateway.wait(10)
        for node in forkd:
            node.stop_daemon()
        if (root / "gateway.log").exists():  # shown when the test fails
            sys.stderr.write((root / "gateway.log").read_text()[-6000:])
        shutil.rmtree(root, ignore_errors=True)


def _health(url: str) -> dict[str, object]:
    try:
        return dict(httpx.get(f"{url}/health", timeout=5).json())
    except httpx.HTTPError:
        return {}


def until(check: object, message: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, message
        time.sleep(0.3)


def running_on(node: ForkdNode) -> set[str]:
    with node.controller() as controller:
        return {str(s["id"]) for s in controller.sandboxes()}


def use(sandbox: e2b.Sandbox) -> None:
    """A command (a Connect server stream) and a file written and read back, through the gateway."""
    assert sandbox.commands.run("true").exit_code == 0
    content = f"hello from {sandbox.sandbox_id}"
    sandbox.files.write("/tmp/where", content)
    assert sandbox.files.read("/tmp/where") == content


def test_the_e2b_sdk_addresses_a_cluster_through_the_gateway(
        cluster: tuple[str, list[ForkdNode], object], monkeypatch: pytest.MonkeyPatch) -> None:
    url, forkd, ray_cluster = cluster
    for variable, value in (("E2B_API_URL", url), ("E2B_SANDBOX_URL", url), ("E2B_API_KEY", KEY_A)):
        monkeypatch.setenv(variable, value)

    # refused at the gateway, saying why: no key; a template no node holds
    assert httpx.get(f"{url}/sandboxes", timeout=30).status_code == 401
    unknown = httpx.post(f"{url}/sandboxes", json={"templateID": "nope"}, headers={"x-api-key": KEY_A}, timeout=30)
    assert unknown.status_code == 404 and "no alive node has a snapshot tagged 'nope'" in unknown.json()["message"]
    huge = httpx.post(f"{url}/sandboxes", content=b"x" * (2 << 20), headers={"x-api-key": KEY_A}, timeout=30)
    assert huge.status_code == 413
    bad = httpx.get(f"{url}/health", headers={"e2b-sandbox-id": "../x", "e2b-sandbox-port": "49983"}, timeout=30)
    assert bad.status_code == 502 and "not a sandbox id" in bad.json()["message"]

    # creates fill the holder, then the template is replicated and creates land on another node
    sandboxes = [e2b.Sandbox.create(TAG, timeout=600) for _ in range(SLOTS + 2)]
    where = {node.name: running_on(node) & {s.sandbox_id for s in sandboxes} for node in forkd}
    assert len(where["n0"]) == SLOTS and sum(len(ids) for ids in where.values()) == SLOTS + 2
    assert all(s.get_info().template_id == TAG for s in sandboxes[-2:])  # the client's name, not the node's
    for sandbox in sandboxes:
        use(sandbox)

    # a host name addresses a sandbox as E2B's own domain does: {port}-{id}.{domain}
    other = sandboxes[-1]
    answer = httpx.get(f"{url}/files", params={"path": "/tmp/where"}, timeout=30,
                       headers={"host": f"49983-{other.sandbox_id}.cluster.test",
                                "x-access-token": other._envd_access_token or ""})
    assert answer.status_code == 200 and answer.text == f"hello from {other.sandbox_id}"

    # the code interpreter's port (a streamed /execute, a context made with the traffic token), on the
    # node that pulled the template, through E2B's code-interpreter SDK
    interpreter = e2b_code_interpreter.Sandbox.connect(other.sandbox_id)
    assert interpreter.run_code("1 + 1").error is None
    interpreter.create_code_context()  # raises unless its node answered (the fake guest names no context id)

    # list merges the nodes, each filtering by the key's owner; another owner sees only its own
    listed = {s.sandbox_id for s in e2b.Sandbox.list().next_items()}
    assert listed == {s.sandbox_id for s in sandboxes}
    theirs = e2b.Sandbox.create(TAG, timeout=600, api_key=KEY_B)
    assert {s.sandbox_id for s in e2b.Sandbox.list(api_key=KEY_B).next_items()} == {theirs.sandbox_id}
    with pytest.raises(e2b.NotFoundException):
        e2b.Sandbox.connect(theirs.sandbox_id)  # team-a's key does not see team-b's sandbox
    theirs.kill()

    # a fork branches on its parent's node and spills past its free slots (the branch pulled by another
    # node); kill frees a sandbox wherever it is
    home = next(node for node in forkd[1:] if where[node.name])
    spare = next(node for node in forkd[1:] if node is not home)
    parent = next(s for s in sandboxes if s.sandbox_id in where[home.name])
    sandboxes[0].kill()
    assert sandboxes[0].sandbox_id not in running_on(forkd[0])
    children = parent.fork(count=SLOTS - 1, timeout=600)  # home has SLOTS - 2 free
    assert all(isinstance(child, e2b.Sandbox) for child in children), children
    on_home = [c for c in children if c.sandbox_id in running_on(home)]
    spilled = [c for c in children if c.sandbox_id in running_on(spare)]
    assert (len(on_home), len(spilled)) == (SLOTS - 2, 1)
    for child in children:
        use(child)
    child = on_home[0]

    # the node running `parent` dies: its sandboxes answer that they were lost with it, the others work
    with home.controller() as controller:
        home_id = controller.request("GET", "/v1/node")["node_id"]
    for pid in [home.daemon_pid or 0, *home.vmm_pids()]:  # the host dies: its daemon and its VMMs
        os.kill(pid, signal.SIGKILL)
    ray_cluster.remove_node(home.ray_node, allow_graceful=False)  # type: ignore[attr-defined]
    until(lambda: home_id in (_health(url).get("dead") or []), "the gateway never saw the node die")
    with pytest.raises(e2b.SandboxException, match=f"lost with node {home_id}"):
        parent.commands.run("true")
    with pytest.raises(e2b.SandboxException, match=f"lost with node {home_id}"):
        child.files.read("/tmp/where")
    with pytest.raises(e2b.SandboxException, match=f"lost with node {home_id}"):
        e2b.Sandbox.connect(parent.sandbox_id)
    with pytest.raises(e2b.SandboxException, match=f"lost with node {home_id}"):
        parent.kill()
    survivors = [s for s in sandboxes[1:] if s.sandbox_id not in where[home.name]] + spilled
    for sandbox in survivors:
        use(sandbox)
    assert {s.sandbox_id for s in e2b.Sandbox.list().next_items()} == {s.sandbox_id for s in survivors}
    late = e2b.Sandbox.create(TAG, timeout=600)
    use(late)
    for sandbox in [*survivors, late]:
        sandbox.kill()
    assert not any(running_on(node) or node.vmm_pids() for node in forkd if node is not home)
