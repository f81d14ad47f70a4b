"""The node API between real daemons: each its own FORKD_HOME, the FakeVmm (real processes, real guest
protocol, no VM), served by uvicorn on loopback TCP behind its bearer token; peers are reached with
the token of the node they pull from. Hostile peers are small real HTTP servers serving a real
daemon's answers, tampered with or cut off."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import io
import json
import secrets
import tarfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import zstandard
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from conftest import run_bounded, served_on_loopback, short_tmp_dir
from forkd.config import Paths
from forkd.daemon.app import create_app
from forkd.daemon.middleware.auth import TokenAuth
from forkd.guest.protocol import AGENT_VERSION
from forkd.image.store import Image
from forkd.packs import archive
from forkd.runtime.options import RuntimeOptions
from forkd.runtime.runtime import Runtime
from forkd.runtime.snapshots import SnapshotRequest
from forkd.sdk.async_controller import AsyncController
from forkd.sdk.errors import ForkdError
from forkd.store.chains import layer_digest
from forkd.vmm.base import BootSpec, MachineIdentity, SavedVm, VmHandle, no_stage_marks
from forkd.vmm.fake import FakeVmm

T = TypeVar("T")
BOUND_S = 60.0


def run(make: Callable[[], Awaitable[T]]) -> T:
    return run_bounded(make, BOUND_S)  # type: ignore[no-any-return]


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    with short_tmp_dir("fkn-") as directory:
        yield directory


@dataclass
class Node:
    runtime: Runtime
    url: str
    token: str
    api: AsyncController


@contextlib.asynccontextmanager
async def node(root: Path, vmm: FakeVmm | None = None, options: RuntimeOptions | None = None) -> AsyncIterator[Node]:
    """A daemon on loopback TCP with its own FORKD_HOME under ``root`` and its own token."""
    runtime = await Runtime.open(Paths(home=root / "home", cache=root / "cache", socket=root / "forkd.sock"),
                                 vmm or FakeVmm(), options)
    token = secrets.token_hex(32)
    async with served_on_loopback(TokenAuth(create_app(runtime), token)) as url:
        api = AsyncController(url, token)
        try:
            yield Node(runtime, url, token, api)
        finally:
            await api.close()


def _image(root: Path) -> Image:
    directory = root / "image"
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("vmlinuz", "initrd.img", "rootfs.ext4"):
        (directory / name).write_bytes(name.encode())
    return Image(name="default", key="k", path=directory, kernel=directory / "vmlinuz",
                 initrd=directory / "initrd.img", rootfs=directory / "rootfs.ext4", kernel_version="6.12",
                 kernel_sha256="0" * 64, agent_version=AGENT_VERSION, created_at=0.0, size_bytes=3,
                 disk_size_mib=1, spec={}, inputs={})


async def bake(node_: Node, root: Path, tag: str) -> str:
    """A snapshot made on the node; answers its digest."""
    record = await node_.runtime.snapshots.create(SnapshotRequest(tag=tag, memory_mib=1), _image(root),
                                                  lambda _line: None)
    return layer_digest(record.meta["sha256"])


async def branch_of(node_: Node, base: str, tag: str) -> str:
    """A diff layer over ``base`` (a child of it changed and branched); answers its digest."""
    child = (await node_.api.fork(base, 1))["sandboxes"][0]["id"]
    node_.runtime.vmm.write_guest_memory(node_.runtime.sandboxes.get(child).vm, 4096, b"changed")
    record = await node_.runtime.branches.branch(child, tag, mode="diff")
    await node_.api.kill(child)
    return layer_digest(record.meta["sha256"])


def leftovers(runtime: Runtime) -> list[str]:
    """What a refused or broken pull must not leave: snapshot directories, build directories, records."""
    return sorted(p.name for p in runtime.paths.snapshots.iterdir()) + [r.tag for r in runtime.registry.list_snapshots()]


async def expect_error(call: Awaitable[Any], status: int, code: str) -> str:
    with pytest.raises(ForkdError) as caught:
        await call
    assert (caught.value.status, caught.value.code) == (status, code), caught.value.message
    return caught.value.message


# GET /v1/node ---------------------------------------------------------------------------------------

def test_a_node_describes_its_id_compat_capacity_and_snapshots(tmp_path: Path) -> None:
    async def scenario() -> None:
        options = RuntimeOptions(max_sandboxes=5)
        async with node(tmp_path / "a", options=options) as a:
            base = await bake(a, tmp_path, "base")
            b1 = await branch_of(a, "base", "b1")
            await a.api.fork("base", 2)
            described = await a.api.node()
            first_id = described["node_id"]
        assert described["backend"] == "fake"
        identity = FakeVmm().identity(BootSpec(kernel=Path(), initrd=Path(), cmdline="", memory_mib=1, vcpus=1,
                                               kernel_sha256="", agent_version=AGENT_VERSION))
        assert described["compat"] == {"vmm": "fake", "vmm_version": identity.vmm_version, "machine": identity.machine,
                                       "accel": identity.accelerator, "cpu_model": identity.cpu_model,
                                       "agent_version": AGENT_VERSION}
        canonical = json.dumps(described["compat"], sort_keys=True, separators=(",", ":")).encode()
        assert described["compat_key"] == hashlib.sha256(canonical).hexdigest()
        capacity = described["capacity"]
        assert (capacity["max_sandboxes"], capacity["live"], capacity["slots_free"]) == (5, 2, 3)
        assert capacity["mem_available_bytes"] > 0 and capacity["cpus"] >= 1 and capacity["load1"] >= 0
        listed = {s["tag"]: s for s in described["snapshots"]}
        assert listed["base"]["digest"] == base and listed["base"]["parent_digest"] is None
        assert listed["b1"]["digest"] == b1 and listed["b1"]["parent_digest"] == base
        assert all(s["bytes"] > 0 and s["status"] == "ready" for s in listed.values())
        async with node(tmp_path / "a") as again:  # the same FORKD_HOME is the same node
            assert (await again.api.node())["node_id"] == first_id
        async with node(tmp_path / "other") as other:
            assert (await other.api.node())["node_id"] != first_id

    run(scenario)


# peer transfer --------------------------------------------------------------------------------------

def test_a_pull_by_digest_takes_only_the_layers_it_lacks_and_digests_match(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with node(tmp_path / "a") as a, node(tmp_path / "b") as b:
            base = await bake(a, tmp_path, "base")
            b1 = await branch_of(a, "base", "b1")
            async with httpx.AsyncClient(base_url=a.url, headers={"Authorization": f"Bearer {a.token}"}) as client:
                full = (await client.get(f"/v1/node/chains/{b1}")).content
                diff = (await client.get(f"/v1/node/chains/{b1}", params={"have": base})).content
                refused = await client.get(f"/v1/node/chains/{b1}", params={"have": "not-a-digest"})
            assert chain_of(full, tmp_path) == [("base", None), ("b1", base)]
            assert chain_of(diff, tmp_path) == [("b1", base)] and len(diff) < len(full)
            assert refused.status_code == 400
            twice = await asyncio.gather(*(b.api.node_pull(base, a.url, a.token) for _ in range(2)))
            assert sorted(p["pulled_layers"] for p in twice) == [0, 1]  # one after the other: the second holds it
            pulled = next(p for p in twice if p["pulled_layers"])
            assert (pulled["digest"], pulled["tag"]) == (base, "base")
            held_base = b.runtime.registry.get_snapshot("base")
            # The diff child over a base already held: the peer sends only the diff (the puller refuses a
            # pack whose first layer is not the first one it lacks), and the base is not touched.
            pulled = await b.api.node_pull(b1, a.url, a.token)
            assert (pulled["tag"], pulled["pulled_layers"]) == ("b1", 1)
            assert b.runtime.registry.get_snapshot("base").created_at == held_base.created_at
            assert {s["digest"] for s in (await b.api.node())["snapshots"]} == {base, b1}
            for tag in ("base", "b1"):
                assert b.runtime.registry.get_snapshot(tag).meta["sha256"] == \
                    a.runtime.registry.get_snapshot(tag).meta["sha256"]
            again = await b.api.node_pull(b1, a.url, a.token)  # already held: answered at once
            assert (again["tag"], again["pulled_layers"], again["bytes"]) == ("b1", 0, 0)
            forked = await b.api.fork(None, 2, snapshot_digest=b1)  # the pulled chain restores
            assert len(forked["sandboxes"]) == 2 and not forked["errors"]
            assert {s["snapshot_tag"] for s in forked["sandboxes"]} == {"b1"}

    run(scenario)


def chain_of(pack: bytes, tmp_path: Path) -> list[tuple[str, str | None]]:
    """The layers a served pack holds: (tag, parent digest) from its manifest."""
    path = tmp_path / f"served-{secrets.token_hex(4)}.tar.zst"
    path.write_bytes(pack)
    return [(s.tag, s.parent_digest) for s in archive.read_manifest(path).snapshots]


def test_a_pulled_top_layer_whose_tag_is_taken_here_gets_a_digest_name(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with node(tmp_path / "a") as a, node(tmp_path / "b") as b:
            base = await bake(a, tmp_path, "base")
            b1 = await branch_of(a, "base", "b1")
            await b.api.node_pull(base, a.url, a.token)
            await bake(b, tmp_path, "b1")  # another snapshot under that tag on this node
            pulled = await b.api.node_pull(b1, a.url, a.token)
            assert (pulled["tag"], pulled["pulled_layers"]) == (f"d-{b1[:12]}", 1)
            assert b.runtime.store.get_digest(b1).parent_tag == "base"

    run(scenario)


def test_a_pull_that_would_break_the_free_space_floor_is_disk_full_before_fetching(tmp_path: Path) -> None:
    """The pack and its unpacked layers must fit above the floor (set above any disk's free space here)."""
    async def scenario() -> None:
        async with node(tmp_path / "a") as a, \
                node(tmp_path / "b", options=RuntimeOptions(free_floor_bytes=1 << 60)) as b:
            base = await bake(a, tmp_path, "base")
            message = await expect_error(b.api.node_pull(base, a.url, a.token), 507, "disk_full")
            assert f"pulling {base[:12]} from {a.url}" in message and "forkd rmi" in message
            assert leftovers(b.runtime) == []

    run(scenario)


def test_an_unknown_digest_is_a_404_naming_the_peer(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with node(tmp_path / "a") as a, node(tmp_path / "b") as b:
            await bake(a, tmp_path, "base")
            missing = "0" * 64
            message = await expect_error(b.api.node_pull(missing, a.url, a.token), 404, "snapshot_not_found")
            assert a.url in message and missing in message
            await expect_error(a.api.request("GET", f"/v1/node/chains/{missing}"), 404, "snapshot_not_found")
            await expect_error(a.api.fork(None, 1, snapshot_digest=missing), 404, "snapshot_not_found")
            await expect_error(b.api.node_pull(missing, a.url, "x" * 64), 502, "peer_error")  # wrong token
            assert leftovers(b.runtime) == []

    run(scenario)


class OtherVersionVmm(FakeVmm):
    """A node whose VMM is another version: its snapshots do not restore on the first kind."""

    def identity(self, spec: BootSpec) -> MachineIdentity:
        return dataclasses.replace(super().identity(spec), vmm_version="2")


def test_an_incompatible_peer_is_refused_naming_the_field(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with node(tmp_path / "a") as a, node(tmp_path / "b", OtherVersionVmm()) as b:
            base = await bake(a, tmp_path, "base")
            message = await expect_error(b.api.node_pull(base, a.url, a.token), 409, "incompatible_snapshot")
            assert "vmm_version" in message and "'1'" in message and "'2'" in message
            assert (await a.api.node())["compat_key"] != (await b.api.node())["compat_key"]
            assert leftovers(b.runtime) == []

    run(scenario)


def _tampered(pack: bytes, member: str) -> bytes:
    """``pack`` with one byte of ``member``'s content flipped; the manifest still lists the original digest."""
    raw = bytearray(zstandard.ZstdDecompressor().stream_reader(io.BytesIO(pack)).read())
    with tarfile.open(fileobj=io.BytesIO(bytes(raw)), mode="r:") as tar:
        offset = tar.getmember(member).offset_data
    raw[offset] ^= 0xFF
    return zstandard.ZstdCompressor().compress(bytes(raw))


@contextlib.asynccontextmanager
async def hostile_peer(real: Node, chain: Callable[[bytes], AsyncIterator[bytes]]) -> AsyncIterator[str]:
    """A peer answering /v1/node as ``real`` does and streaming ``chain(real pack)`` for any chain."""
    async with httpx.AsyncClient(base_url=real.url, headers={"Authorization": f"Bearer {real.token}"}) as client:
        listing = (await client.get("/v1/node")).json()
        digest = listing["snapshots"][0]["digest"]
        pack = (await client.get(f"/v1/node/chains/{digest}")).content

    async def describe(_: Request) -> Response:
        return JSONResponse(listing)

    async def serve_chain(_: Request) -> Response:
        return StreamingResponse(chain(pack), media_type="application/octet-stream")

    app = Starlette(routes=[Route("/v1/node", describe), Route("/v1/node/chains/{digest}", serve_chain)])
    async with served_on_loopback(app) as url:
        yield url


def test_a_peer_serving_a_corrupted_layer_is_refused_and_nothing_is_registered(tmp_path: Path) -> None:
    async def corrupted(pack: bytes) -> AsyncIterator[bytes]:
        yield _tampered(pack, "base/state")

    async def scenario() -> None:
        async with node(tmp_path / "a") as a, node(tmp_path / "b") as b:
            base = await bake(a, tmp_path, "base")
            async with hostile_peer(a, corrupted) as peer:
                message = await expect_error(b.api.node_pull(base, peer, None), 502, "peer_error")
            assert "base/state" in message and "SHA-256" in message
            assert leftovers(b.runtime) == []

    run(scenario)


def test_a_pull_cut_off_or_cancelled_mid_stream_leaves_nothing(tmp_path: Path) -> None:
    sent_half = asyncio.Event()

    async def cut_off(pack: bytes) -> AsyncIterator[bytes]:
        yield pack[: len(pack) // 2]
        raise ConnectionResetError("the peer died")  # uvicorn drops the connection mid-body

    async def stalled(pack: bytes) -> AsyncIterator[bytes]:
        yield pack[: len(pack) // 2]
        sent_half.set()
        await asyncio.Event().wait()
        yield b""

    async def scenario() -> None:
        async with node(tmp_path / "a") as a, node(tmp_path / "b") as b:
            base = await bake(a, tmp_path, "base")
            async with hostile_peer(a, cut_off) as peer:
                await expect_error(b.api.node_pull(base, peer, None), 502, "peer_error")
            assert leftovers(b.runtime) == []
            async with hostile_peer(a, stalled) as peer:
                pull = asyncio.create_task(b.runtime.peers.pull(base, peer, None, lambda _line: None))
                await sent_half.wait()
                while not list(b.runtime.paths.snapshots.glob(".build-*/chain.tar.zst")):
                    await asyncio.sleep(0.01)  # the download is being written into a build directory
                pull.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await pull
            assert leftovers(b.runtime) == []
            assert (await b.api.node_pull(base, a.url, a.token))["pulled_layers"] == 1  # a later pull works

    run(scenario)


# fork by digest, idempotency keys, owners -----------------------------------------------------------

def test_a_repeated_fork_key_never_makes_more_children(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with node(tmp_path / "a") as a:
            base = await bake(a, tmp_path, "base")
            first = await a.api.fork(None, 2, snapshot_digest=base, idempotency_key="job-1:step.7", owner="job-1")
            assert len(first["sandboxes"]) == 2
            assert await a.api.fork(None, 2, snapshot_digest=base, idempotency_key="job-1:step.7",
                                    owner="job-1") == first
            concurrent = await asyncio.gather(*(a.api.fork("base", 3, idempotency_key="k2") for _ in range(4)))
            assert all(answer == concurrent[0] for answer in concurrent) and len(concurrent[0]["sandboxes"]) == 3
            assert len(await a.api.sandboxes()) == 5
            unknown = "1" * 64  # a fork refused as a whole keeps no answer: its retry runs again
            await expect_error(a.api.fork(None, 1, snapshot_digest=unknown, idempotency_key="k3"), 404,
                               "snapshot_not_found")
            assert len((await a.api.fork("base", 1, idempotency_key="k3"))["sandboxes"]) == 1
            assert len(await a.api.sandboxes()) == 6
            message = await expect_error(a.api.fork(None, 3, snapshot_digest=base, idempotency_key="job-1:step.7"),
                                         409, "idempotency_conflict")
            assert "job-1:step.7" in message
            await expect_error(a.api.request("POST", "/v1/sandboxes", json={
                "snapshot_tag": "base", "idempotency_key": "bad key"}), 400, "invalid_request")
            await expect_error(a.api.request("POST", "/v1/sandboxes", json={
                "snapshot_tag": "base", "snapshot_digest": base}), 400, "invalid_request")
        async with node(tmp_path / "a") as again:  # a restarted daemon still knows the key
            assert await again.api.fork(None, 2, snapshot_digest=base, idempotency_key="job-1:step.7",
                                        owner="job-1") == first
            assert await again.api.sandboxes() == []

    run(scenario)


class GatedVmm(FakeVmm):
    """A FakeVmm whose restores wait for a pass each: a test decides when each child may answer."""

    def __init__(self) -> None:
        super().__init__()
        self.passes = asyncio.Semaphore(0)

    async def complete_restore(self, vm: VmHandle, saved: SavedVm, on_stage: Callable[[str], None] = no_stage_marks) -> None:
        await self.passes.acquire()
        await super().complete_restore(vm, saved, on_stage)


async def until(check: Callable[[], bool], what: str, bound_s: float = 10.0) -> None:
    """Wait (bounded) until ``check()`` holds."""
    deadline = asyncio.get_running_loop().time() + bound_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, f"not within {bound_s} s: {what}"
        await asyncio.sleep(0.02)


async def leave_a_keyed_fork(node_: Node, key: str, n: int) -> None:
    """Ask for a keyed fork and leave before it answers (a client's timeout)."""
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {node_.token}"}, timeout=0.3) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(f"{node_.url}/v1/sandboxes", json={"snapshot_tag": "base", "n": n, "idempotency_key": key})


def test_a_keyed_fork_nobody_waits_for_is_given_up_and_its_retry_forks_again(tmp_path: Path) -> None:
    """Its children still starting are stopped (one queued for a restore slot at once), those that
    answered are killed, no answer is kept: the retry forks anew."""
    async def scenario() -> None:
        vmm = GatedVmm()
        async with node(tmp_path / "a", vmm, RuntimeOptions(max_concurrent_forks=1)) as a:
            a.runtime.driver_forks.abandon_s = 0.5
            await bake(a, tmp_path, "base")
            await leave_a_keyed_fork(a, "job:7", 3)
            vmm.passes.release()  # the first child answers; the second restores (held); the third waits for a slot
            await until(lambda: len(a.runtime.sandboxes.live()) == 1 and a.runtime.spawner.starting() == 2,
                        "one child answered, two starting")
            first = a.runtime.sandboxes.live()[0].record.id
            await until(lambda: a.runtime.spawner.starting() == 1, "the queued child stopped once the fork was given up")
            vmm.passes.release()  # the held child answers: it is killed, as is the one that answered before
            await until(lambda: a.runtime.spawner.starting() == 0 and a.runtime.sandboxes.live() == [],
                        "nothing of the given-up fork left")
            assert a.runtime.registry.recall_fork("job:7", 0) is None
            for _ in range(3):
                vmm.passes.release()
            again = await a.api.fork("base", 3, idempotency_key="job:7")
            ids = {s["id"] for s in again["sandboxes"]}
            assert len(ids) == 3 and first not in ids
            assert {s.record.id for s in a.runtime.sandboxes.live()} == ids
            assert await a.api.fork("base", 3, idempotency_key="job:7") == again

    run(scenario)


def test_an_answer_no_client_took_is_kept_for_a_retry_then_undone(tmp_path: Path) -> None:
    """A keyed fork that answers after its client left: a retry within the grace takes the answer; one
    nobody comes back for has its children killed and its key forgotten."""
    async def scenario() -> None:
        vmm = GatedVmm()
        async with node(tmp_path / "a", vmm) as a:
            a.runtime.driver_forks.abandon_s = 1.0
            await bake(a, tmp_path, "base")
            await leave_a_keyed_fork(a, "taken", 1)
            await leave_a_keyed_fork(a, "left", 1)
            vmm.passes.release()
            vmm.passes.release()
            await until(lambda: len(a.runtime.sandboxes.live()) == 2, "both children answered")
            taken = await a.api.fork("base", 1, idempotency_key="taken")
            (kept,) = taken["sandboxes"]
            await until(lambda: [s.record.id for s in a.runtime.sandboxes.live()] == [kept["id"]],
                        "the child of the answer nobody took killed")
            assert a.runtime.registry.recall_fork("left", 0) is None
            await asyncio.sleep(1.5)  # the answer a client took is kept past the grace, its child alive
            assert await a.api.fork("base", 1, idempotency_key="taken") == taken
            assert [s.record.id for s in a.runtime.sandboxes.live()] == [kept["id"]]

    run(scenario)


def test_a_node_keeps_at_most_max_kept_fork_keys_the_oldest_forgotten(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with node(tmp_path / "a") as a:
            a.runtime.driver_forks.max_kept = 2
            await bake(a, tmp_path, "base")
            answers = [await a.api.fork("base", 1, idempotency_key=f"k{i}") for i in range(3)]
            assert [a.runtime.registry.recall_fork(f"k{i}", 0) is not None for i in range(3)] == [False, True, True]
            assert await a.api.fork("base", 1, idempotency_key="k2") == answers[2]
            assert await a.api.fork("base", 1, idempotency_key="k1") == answers[1]
            again = await a.api.fork("base", 1, idempotency_key="k0")  # forgotten: forked again
            assert again["sandboxes"][0]["id"] != answers[0]["sandboxes"][0]["id"]

    run(scenario)


def test_children_are_listed_and_killed_by_owner(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with node(tmp_path / "a") as a:
            await bake(a, tmp_path, "base")
            mine = {s["id"] for s in (await a.api.fork("base", 2, owner="driver-1"))["sandboxes"]}
            theirs = {s["id"] for s in (await a.api.fork("base", 1, owner="driver-2"))["sandboxes"]}
            unowned = {s["id"] for s in (await a.api.fork("base", 1))["sandboxes"]}
            assert {s["id"] for s in await a.api.sandboxes(owner="driver-1")} == mine
            described = await a.api.sandbox(next(iter(mine)))
            assert described["owner"] == "driver-1"
            assert set(await a.api.kill_owner("driver-1")) == mine
            assert {s["id"] for s in await a.api.sandboxes()} == theirs | unowned
            assert await a.api.kill_owner("driver-1") == []
            await expect_error(a.api.request("DELETE", "/v1/sandboxes"), 400, "invalid_request")

    run(scenario)
