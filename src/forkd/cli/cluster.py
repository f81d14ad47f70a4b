"""``forkd node start`` and ``forkd cluster``: operating forkd across the nodes of a Ray cluster.

``forkd.cluster`` (and Ray) are imported only inside the commands: the rest of the CLI works without
the ``forkd[ray]`` extra. See docs/scale-out.md.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click

from forkd.cli.common import console, print_json, reports_errors
from forkd.config import paths_from_env
from forkd.safetext import for_rich
from forkd.sdk.controller import Controller, DaemonUnreachable, ForkdError

START_BOUND_S = 60.0
LABEL = "forkd-node"  # the Ray node label naming the forkd node id


def _cluster_module() -> Any:
    try:
        import forkd.cluster as cluster
    except ImportError as exc:
        raise click.ClickException(str(exc)) from None
    return cluster


def _connect(ray_address: str | None) -> Any:
    cluster = _cluster_module()
    where = ray_address or os.environ.get("RAY_ADDRESS")
    if where:
        _check_reachable(where)
    try:
        return cluster.Cluster(ray_address)
    except ConnectionError as exc:
        raise click.ClickException(f"cannot reach the Ray cluster at {where}: {exc}" if where else
                                   "no Ray cluster found on this host: pass --ray-address HOST:PORT "
                                   "(the head's) or set RAY_ADDRESS") from None


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Refuse at once a HOST:PORT nothing answers on (Ray itself would wait for minutes)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "://" in address:
        return  # "auto", a ray:// client address: Ray's own to resolve
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise click.ClickException(f"nothing answers at the Ray address {address} ({exc.strerror or exc}): "
                                   f"give the head's GCS address, HOST:PORT (6379 by default)") from None


@click.group("node")
def node() -> None:
    """This host as a node of a forkd cluster on Ray."""


@node.command("start")
@click.option("--ray-address", required=True, metavar="HOST:PORT", help="the Ray cluster's head (GCS) address")
@click.option("--listen", default="0.0.0.0:7070", show_default=True, metavar="HOST:PORT",
              help="where a daemon this command starts serves the cluster (TCP, bearer token)")
@click.option("--url", "advertised", metavar="URL",
              help="the daemon's URL as other nodes and drivers reach it (default $FORKD_URL when it is "
                   "http(s), else http://<this node's IP>:<port of --listen>)")
@click.option("--token-file", type=click.Path(dir_okay=False, path_type=Path),
              help="the bearer token (default: $FORKD_TOKEN, else one made once under FORKD_HOME)")
@click.option("--e2b-listen", metavar="HOST:PORT",
              help="where a daemon this command starts serves E2B's API (for `forkd cluster e2b`)")
@click.option("--e2b-url", metavar="URL", help="the node's E2B front as the cluster's E2B gateway reaches it "
                                               "(default $FORKD_E2B_URL, else from --e2b-listen)")
@click.option("--block", is_flag=True, help="stay in the foreground with Ray's node processes (a container's "
                                            "or a service's main process)")
@click.argument("ray_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- RAY START OPTIONS]")
@reports_errors
def node_start(ray_address: str, listen: str, advertised: str | None, token_file: Path | None,
               e2b_listen: str | None, e2b_url: str | None, block: bool, ray_args: tuple[str, ...]) -> None:
    """Attach this host's daemon (or start one on TCP) and join the Ray cluster as a forkd node.

    A daemon already at the URL (e.g. a Kubernetes DaemonSet's) is attached; otherwise one is started
    with --listen. The Ray node gets the `forkd` resource and the `forkd-node` label; its workers find
    the daemon in FORKD_URL and FORKD_TOKEN, which is how the cluster's node agent reaches it. Options
    after `--` go to `ray start` as they are (e.g. `-- --num-cpus 8 --temp-dir /var/tmp/ray`)."""
    _check_reachable(ray_address)
    paths = paths_from_env()
    token = _token(token_file or paths.home / "node-token")
    env_url = os.environ.get("FORKD_URL", "")
    given = advertised or (env_url if env_url.startswith(("http://", "https://")) else None)
    url = given or _reachable_url(listen, ray_address)
    e2b_url = e2b_url or os.environ.get("FORKD_E2B_URL") or (_reachable_url(e2b_listen, ray_address)
                                                              if e2b_listen else None)
    controller = Controller(url=url, token=token)
    if not _answers(controller) and given is None:
        if _answers(Controller(url=f"unix://{paths.socket}")):
            raise click.ClickException(f"a local daemon runs but does not answer at {url}: restart it with "
                                       f"`forkd daemon --listen {listen}` and this token, or pass --url")
        _start_daemon(paths, listen, token, e2b_listen)
    _wait(controller)
    node_id = controller.request("GET", "/v1/node")["node_id"]
    env = {**os.environ, "FORKD_URL": url, "FORKD_TOKEN": token, **({"FORKD_E2B_URL": e2b_url} if e2b_url else {})}
    command = [str(Path(sys.executable).parent / "ray"), "start", "--address", ray_address,
               "--resources", json.dumps({"forkd": 1}), "--labels", f"{LABEL}={node_id}",
               *(["--block"] if block else []), *ray_args]
    console.print(f"forkd node {node_id} ({url}) joining the Ray cluster at {ray_address}")
    done = subprocess.run(command, env=env, stdin=subprocess.DEVNULL, timeout=None if block else 300)
    if done.returncode != 0:
        raise click.ClickException(f"`ray start` failed (exit {done.returncode}); see its output above")


def _token(path: Path) -> str:
    """$FORKD_TOKEN, else the token kept in ``path`` (made once, 0600)."""
    if token := os.environ.get("FORKD_TOKEN"):
        return token
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(token := secrets.token_urlsafe(32))
    return token


def _reachable_url(listen: str, ray_address: str) -> str:
    """``http://HOST:PORT`` for a listen address, a wildcard host replaced by this node's IP."""
    host, _, port = listen.rpartition(":")
    return f"http://{_node_ip(ray_address) if host in ('0.0.0.0', '') else host}:{port}"


def _node_ip(ray_address: str) -> str:
    """The address this host uses to reach the Ray head: the one its peers can reach it on."""
    host, _, port = ray_address.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host or ray_address, int(port or 6379)))
        return str(probe.getsockname()[0])


def _answers(controller: Controller) -> bool:
    try:
        controller.health()
        return True
    except DaemonUnreachable:
        return False


def _start_daemon(paths: Any, listen: str, token: str, e2b_listen: str | None) -> None:
    paths.home.mkdir(parents=True, exist_ok=True)
    with open(paths.daemon_log, "ab") as log:
        subprocess.Popen([sys.executable, "-m", "forkd", "daemon", "--listen", listen,
                          *(["--e2b-listen", e2b_listen] if e2b_listen else [])], stdin=subprocess.DEVNULL,
                         stdout=log, stderr=log, start_new_session=True, env={**os.environ, "FORKD_TOKEN": token})


def _wait(controller: Controller) -> None:
    deadline = time.monotonic() + START_BOUND_S
    while not _answers(controller):
        if time.monotonic() > deadline:
            raise ForkdError(0, "unreachable", f"the daemon did not answer at {controller.url} within "
                                               f"{START_BOUND_S:.0f} s; see {paths_from_env().daemon_log}")
        time.sleep(0.2)


@click.group("cluster")
def cluster() -> None:
    """The forkd nodes of a Ray cluster: what each holds, and moving snapshots between them."""


@cluster.command("status")
@click.option("--ray-address", metavar="HOST:PORT", help="the Ray cluster (default $RAY_ADDRESS)")
@click.option("--json", "as_json", is_flag=True)
@reports_errors
def status(ray_address: str | None, as_json: bool) -> None:
    """Nodes, their compatibility key, free slots and the snapshots each holds (by digest)."""
    connected = _connect(ray_address)
    try:
        nodes = sorted(connected.directory.nodes.values(), key=lambda s: s.node_id)
        if as_json:
            print_json({"nodes": [_node_json(s) for s in nodes]})
            return
        groups = sorted({s.compat_key for s in nodes})
        for s in nodes:
            state = "alive" if s.alive else "DEAD"
            console.print(f"{for_rich(s.node_id)}  {state}  {for_rich(s.url)}  compat {groups.index(s.compat_key) + 1} "
                          f"({for_rich(s.compat_key[:12])})  slots {s.slots_free}/{s.max_sandboxes} free  "
                          f"{s.live} live", soft_wrap=True)
            for copy in s.snapshots:
                console.print(f"    {for_rich(copy.tag)}@{copy.digest[:12]}  {copy.bytes} bytes  {copy.status}",
                              soft_wrap=True)
        if len(groups) > 1:
            console.print(f"{len(groups)} compatibility groups: a snapshot moves only between nodes of one group")
    finally:
        connected.close()


def _node_json(state: Any) -> dict[str, Any]:
    return {"node_id": state.node_id, "ray_node_id": state.ray_node_id, "url": state.url, "alive": state.alive,
            "compat_key": state.compat_key, "compat": state.compat, "slots_free": state.slots_free,
            "max_sandboxes": state.max_sandboxes, "live": state.live,
            "snapshots": [{"tag": c.tag, "digest": c.digest, "bytes": c.bytes} for c in state.snapshots]}


@cluster.command("replicate")
@click.argument("snapshot")
@click.option("--to", "count", type=click.IntRange(min=1), required=True, help="how many nodes should hold it")
@click.option("--ray-address", metavar="HOST:PORT", help="the Ray cluster (default $RAY_ADDRESS)")
@reports_errors
def replicate(snapshot: str, count: int, ray_address: str | None) -> None:
    """Make COUNT compatible nodes hold SNAPSHOT (a tag or a digest), pulling it peer to peer by digest."""
    connected = _connect(ray_address)
    try:
        try:
            pulls = connected.replicate(snapshot, count)
        except _cluster_module().PlacementError as exc:
            raise click.ClickException(str(exc)) from None
        for pull in pulls:
            console.print(f"{for_rich(pull['target'])} pulled {pull['digest'][:12]} from {for_rich(pull['source'])} "
                          f"({pull['pulled_layers']} layers, {pull['bytes']} bytes) as {for_rich(pull['tag'])!r}",
                          soft_wrap=True)
        if not pulls:
            console.print(f"{snapshot} is already on enough nodes")
    finally:
        connected.close()


@cluster.command("e2b")
@click.option("--listen", default="127.0.0.1:3000", show_default=True, metavar="HOST:PORT",
              help="where E2B's SDKs reach the cluster (E2B_API_URL and E2B_SANDBOX_URL)")
@click.option("--ray-address", metavar="HOST:PORT", help="the Ray cluster (default $RAY_ADDRESS)")
@reports_errors
def e2b_gateway(listen: str, ray_address: str | None) -> None:
    """Serve one E2B endpoint over the cluster: creates placed on the nodes, each sandbox's traffic
    routed to its node (every node started with `forkd node start --e2b-url`, accepting the same
    API keys). Runs until stopped. See docs/e2b.md."""
    import uvicorn

    from forkd.cluster.e2b_gateway import Gateway
    from forkd.cluster.e2b_view import ClusterView

    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise click.ClickException(f"--listen {listen!r}: give HOST:PORT")
    view = ClusterView(_connect(ray_address))
    fronts = ", ".join(f"{s.node_id} at {s.e2b_url}" for s in view.fronts) or "none yet"
    console.print(f"forkd E2B gateway on http://{listen} over the nodes' E2B fronts: {fronts}", soft_wrap=True)
    uvicorn.run(Gateway(view), host=host.strip("[]"), port=int(port), log_level="warning")


CLUSTER_COMMANDS = (node, cluster)
