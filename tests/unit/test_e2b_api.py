"""The rest of E2B's control plane on the real front, runtime and registry over the FakeVmm: every
route of E2B's OpenAPI document served or answering 501, snapshots, lifecycle (pause at the
timeout, resume on traffic), metrics, quotas and the collection of E2B's layers, each with two
owners' keys."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_e2b_tenants import ADMIN, KEYS, SECRET, A, B, _client, _key, _to
from test_runtime_fake_vmm import _image, _runtime, run
from test_runtime_fake_vmm import tmp_path  # noqa: F401  (a short directory: agent socket paths are bounded)

from forkd.daemon.app import create_app
from forkd.daemon.middleware.body_limit import BodyLimit
from forkd.e2b import app as e2b_app
from forkd.e2b.app import E2BFront
from forkd.e2b.keys import Credentials
from forkd.e2b.lifecycle import PAUSE_AT_LABEL
from forkd.e2b.metrics import cpu_times, disk, memory
from forkd.e2b.storage import GRACE_S, Storage
from forkd.runtime.recovery import recover
from forkd.runtime.runtime import Runtime
from forkd.runtime.snapshots import SnapshotRequest
from forkd.store.space import SpaceFloor
from forkd.vmm.fake import FakeVmm

# Every route of E2B's control-plane OpenAPI document (spec/openapi.yml of e2b-dev/E2B, 2026-08).
E2B_ROUTES = """
GET /teams; GET /teams/{teamID}/metrics; GET /teams/{teamID}/metrics/max; GET /sandboxes; POST /sandboxes;
GET /v2/sandboxes; GET /sandboxes/metrics; GET /sandboxes/{sandboxID}/logs; GET /v2/sandboxes/{sandboxID}/logs;
GET /sandboxes/{sandboxID}; DELETE /sandboxes/{sandboxID}; GET /sandboxes/{sandboxID}/metrics;
POST /sandboxes/{sandboxID}/pause; POST /sandboxes/{sandboxID}/resume; POST /sandboxes/{sandboxID}/fork;
POST /sandboxes/{sandboxID}/connect; POST /sandboxes/{sandboxID}/timeout; PUT /sandboxes/{sandboxID}/network;
POST /sandboxes/{sandboxID}/refreshes; POST /sandboxes/{sandboxID}/snapshots; GET /snapshots; POST /v3/templates;
GET /v2/templates; POST /v2/templates; GET /templates/{templateID}/files/{hash}; GET /templates; POST /templates;
GET /templates/{templateID}; POST /templates/{templateID}; DELETE /templates/{templateID};
PATCH /templates/{templateID}; POST /templates/{templateID}/builds/{buildID};
POST /v2/templates/{templateID}/builds/{buildID}; PATCH /v2/templates/{templateID};
GET /templates/{templateID}/builds/{buildID}/status; GET /templates/{templateID}/builds/{buildID}/logs;
POST /templates/tags; DELETE /templates/tags; GET /templates/{templateID}/tags; GET /templates/aliases/{alias};
GET /nodes; GET /nodes/{nodeID}; POST /nodes/{nodeID}; POST /admin/teams/{teamID}/sandboxes/kill;
GET /admin/sandboxes/running-counts; POST /admin/teams/{teamID}/builds/cancel; POST /admin/teams/{teamID}/api-keys;
DELETE /admin/teams/{teamID}/api-keys/{apiKeyID}; POST /access-tokens; DELETE /access-tokens/{accessTokenID};
GET /api-keys; POST /api-keys; PATCH /api-keys/{apiKeyID}; DELETE /api-keys/{apiKeyID}; GET /volumes; POST /volumes;
GET /volumes/{volumeID}; DELETE /volumes/{volumeID}; GET /secrets; POST /secrets; GET /secrets/{secretID};
POST /secrets/{secretID}; DELETE /secrets/{secretID}
"""
SERVED = {"GET /sandboxes", "POST /sandboxes", "GET /v2/sandboxes", "GET /sandboxes/metrics",
          "GET /sandboxes/{sandboxID}", "DELETE /sandboxes/{sandboxID}", "GET /sandboxes/{sandboxID}/metrics",
          "POST /sandboxes/{sandboxID}/pause", "POST /sandboxes/{sandboxID}/resume", "POST /sandboxes/{sandboxID}/fork",
          "POST /sandboxes/{sandboxID}/connect", "POST /sandboxes/{sandboxID}/timeout",
          "POST /sandboxes/{sandboxID}/snapshots", "GET /snapshots", "GET /templates", "DELETE /templates/{templateID}",
          "PUT /sandboxes/{sandboxID}/network"}


def _routes() -> list[tuple[str, str]]:
    return [tuple(r.strip().split(" ", 1)) for r in E2B_ROUTES.split(";")]  # type: ignore[misc]


def _front_with(runtime: Runtime, storage: Storage | None = None) -> tuple[E2BFront, BodyLimit]:
    """The front (its rounds are called directly, no timing) and the app a client talks to."""
    front = E2BFront(runtime, Credentials(KEYS, SECRET), storage=storage)
    return front, BodyLimit(front, is_upload=e2b_app.is_upload, is_stream=e2b_app.is_stream,
                            shape=e2b_app.refusal_shape)


class HostProbe:
    """The fake guest reads no files: the host's /proc and df stand in for the guest's."""

    async def read(self, _: str, path: str) -> str:
        return Path(path).read_text()

    async def df(self, _: str) -> str:
        return subprocess.run(["df", "-B1", "-P", "/"], capture_output=True, text=True, check=True).stdout


Scenario = Callable[[Runtime, E2BFront, httpx.AsyncClient], Awaitable[None]]
OnFront = Callable[[Scenario], None]


@pytest.fixture
def on_front(tmp_path: Path) -> OnFront:
    """Runs a scenario against a front over a fresh runtime (FakeVmm, base template); the runtime
    stops after it, whatever happened."""
    def go(scenario: Scenario) -> None:
        async def main() -> None:
            runtime = await _runtime(tmp_path, FakeVmm())
            front, app = _front_with(runtime)
            try:
                async with _client(app) as client:
                    await scenario(runtime, front, client)
            finally:
                await runtime.stop()

        run(main)

    return go


async def _create(client: httpx.AsyncClient, key: str, **body: Any) -> dict[str, Any]:
    made = await client.post("/sandboxes", headers=_key(key), json={"templateID": "base", "timeout": 600, **body})
    assert made.status_code == 201, made.text
    return made.json()  # type: ignore[no-any-return]


def test_every_route_of_e2bs_document_is_served_or_answers_501_never_404(on_front: OnFront) -> None:
    async def scenario(runtime: Runtime, front: E2BFront, client: httpx.AsyncClient) -> None:
        routes = _routes()
        assert len(routes) == 63 and SERVED <= {f"{m} {p}" for m, p in routes}
        for method, path in routes:
            concrete = path.replace("{sandboxID}", "sb-aaaaaaaaaaaa").replace("{", "").replace("}", "")
            answer = await client.request(method, concrete, headers=_key(A), json={},
                                          params={"sandbox_ids": "sb-aaaaaaaaaaaa"})
            if f"{method} {path}" in SERVED:
                assert answer.status_code != 501, (method, path, answer.text)
            else:
                assert answer.status_code == 501, (method, path, answer.status_code, answer.text)
                assert "not supported by this server" in answer.json()["message"]
        # without a key: 401, as for every control-plane route
        assert (await client.get("/volumes")).status_code == 401

    on_front(scenario)


def test_templates_show_each_snapshots_machine_type(on_front: OnFront, tmp_path: Path) -> None:
    async def scenario(runtime: Runtime, front: E2BFront, client: httpx.AsyncClient) -> None:
        await runtime.snapshots.create(SnapshotRequest(tag="small", memory_mib=1, warm_modules=(), machine="microvm"),
                                       _image(tmp_path), lambda _line: None)
        listed = (await client.get("/templates", headers=_key(A))).json()
        assert {t["templateID"]: t["machine"] for t in listed} == {"base": "q35", "small": "microvm"}

    on_front(scenario)


def test_snapshots_belong_to_their_owner_start_sandboxes_and_are_removed_once_unused(on_front: OnFront) -> None:
    async def scenario(runtime: Runtime, front: E2BFront, client: httpx.AsyncClient) -> None:
        sa = (await _create(client, A))["sandboxID"]
        refused = await client.post(f"/sandboxes/{sa}/snapshots", headers=_key(A), json={"memory": False})
        assert refused.status_code == 400 and "filesystem" in refused.json()["message"]
        assert (await client.post(f"/sandboxes/{sa}/snapshots", headers=_key(B), json={})).status_code == 404
        made = await client.post(f"/sandboxes/{sa}/snapshots", headers=_key(A), json={"name": "mine"})
        assert made.status_code == 201, made.text
        snap = made.json()["snapshotID"]
        assert made.json()["names"] == [snap] and snap.endswith("-mine")
        again = await client.post(f"/sandboxes/{sa}/snapshots", headers=_key(A), json={"name": "mine"})
        assert again.status_code == 409

        listed = await client.get("/snapshots", headers=_key(A))
        assert [s["snapshotID"] for s in listed.json()] == [snap]
        assert (await client.get("/snapshots", headers=_key(B))).json() == []
        assert [s["snapshotID"] for s in (await client.get("/snapshots", headers=_key(ADMIN))).json()] == [snap]
        by_source = await client.get("/snapshots", headers=_key(A), params={"sandboxID": sa})
        assert [s["snapshotID"] for s in by_source.json()] == [snap]
        assert (await client.get("/snapshots", headers=_key(A), params={"sandboxID": "sb-other0000000"})).json() == []

        assert (await client.post("/sandboxes", headers=_key(B), json={"templateID": snap})).status_code == 404
        child = (await _create(client, A, templateID=snap))["sandboxID"]
        assert (await client.delete(f"/templates/{snap}", headers=_key(B))).status_code == 404
        assert (await client.delete(f"/templates/{snap}", headers=_key(A))).status_code == 204
        assert (await client.get("/snapshots", headers=_key(A))).json() == []
        assert snap not in {t["templateID"] for t in (await client.get("/templates", headers=_key(A))).json()}
        assert (await client.delete(f"/templates/{snap}", headers=_key(A))).status_code == 404
        assert (await client.post("/sandboxes", headers=_key(A), json={"templateID": snap})).status_code == 404
        # hidden, but kept while its child runs and while the source's next BRANCH chains onto it
        assert runtime.snapshot(snap) is not None
        await client.delete(f"/sandboxes/{child}", headers=_key(A))
        await front.storage.collect()
        assert runtime.snapshot(snap) is not None  # the source sandbox's head
        await client.delete(f"/sandboxes/{sa}", headers=_key(A))
        assert snap in await front.storage.collect()
        assert runtime.snapshot(snap) is None and snap not in front.storage.doomed

    on_front(scenario)


def test_a_pausing_sandbox_is_paused_at_its_timeout_and_resumed_by_traffic_keeping_its_id(on_front: OnFront) -> None:
    async def scenario(runtime: Runtime, front: E2BFront, client: httpx.AsyncClient) -> None:
        for bad in ({"autoPause": True, "autoPauseMemory": False}, {"autoResume": {"enabled": True}}):
            answer = await client.post("/sandboxes", headers=_key(A), json={"templateID": "base", **bad})
            assert answer.status_code == 400, answer.text
        made = await _create(client, A, timeout=300, autoPause=True, autoResume={"enabled": True})
        sa, token = made["sandboxID"], made["envdAccessToken"]
        plain = (await _create(client, A, timeout=300, autoPause=True))["sandboxID"]
        info = (await client.get(f"/sandboxes/{sa}", headers=_key(A))).json()
        assert info["lifecycle"] == {"onTimeout": "pause", "autoResume": True}
        assert runtime.sandboxes.get(sa).record.end_at is None  # no runtime deadline: the keeper pauses it

        assert await front.sandboxes.pause_due() == []  # not due yet
        assert set(await front.sandboxes.pause_due(now=time.time() + 301)) == {sa, plain}
        states = {s["sandboxID"]: s["state"] for s in (await client.get("/v2/sandboxes", headers=_key(A))).json()}
        assert states == {sa: "paused", plain: "paused"}

        # another owner's requests, or traffic without a token, wake nothing
        for call in (client.post(f"/sandboxes/{sa}/timeout", headers=_key(B), json={"timeout": 60}),
                     client.post(f"/sandboxes/{sa}/connect", headers=_key(B), json={"timeout": 60}),
                     client.get(f"/sandboxes/{sa}/metrics", headers=_key(B)),
                     client.post(f"/sandboxes/{sa}/snapshots", headers=_key(B), json={})):
            assert (await call).status_code == 404
        assert front.sandboxes.resolve(sa).live is None
        assert (await client.get("/health", headers=_to(sa, 49983))).status_code == 502
        wrong = await client.get("/files", params={"path": "/etc/hostname"}, headers=_to(plain, 49983, token))
        assert wrong.status_code == 401  # another sandbox's token
        plain_token = (await client.get(f"/sandboxes/{plain}", headers=_key(A))).json()["envdAccessToken"]
        still = await client.get("/files", params={"path": "/etc/hostname"}, headers=_to(plain, 49983, plain_token))
        assert still.status_code == 502 and "paused" in still.json()["message"]  # no autoResume
        # the fake guest reads no files (501), but the request reached it: the sandbox was resumed
        reached = await client.get("/files", params={"path": "/etc/hostname"}, headers=_to(sa, 49983, token))
        assert reached.status_code != 502, reached.text
        resolved = front.sandboxes.resolve(sa)
        assert resolved.live is not None and float(resolved.labels[PAUSE_AT_LABEL]) > time.time() + 250
        assert {s["sandboxID"]: s["state"] for s in (await client.get("/v2/sandboxes", headers=_key(A))).json()} \
            == {sa: "running", plain: "paused"}
        # a timeout request extends the pause deadline, not a kill deadline
        assert (await client.post(f"/sandboxes/{sa}/timeout", headers=_key(A), json={"timeout": 900})).status_code == 204
        resolved = front.sandboxes.resolve(sa)
        assert resolved.live is not None and resolved.live.record.end_at is None
        assert float(resolved.labels[PAUSE_AT_LABEL]) > time.time() + 800
        # connect resumes the one without autoResume, with the timeout it asks for
        assert (await client.post(f"/sandboxes/{plain}/connect", headers=_key(A), json={"timeout": 60})).status_code == 201
        assert float(front.sandboxes.resolve(plain).labels[PAUSE_AT_LABEL]) < time.time() + 61

    on_front(scenario)


def test_metrics_are_sampled_from_the_guest_in_e2bs_shape_for_the_owner_only(on_front: OnFront) -> None:
    async def scenario(runtime: Runtime, front: E2BFront, client: httpx.AsyncClient) -> None:
        front.metrics.probe = HostProbe()  # type: ignore[assignment]
        sa = (await _create(client, A))["sandboxID"]
        assert (await client.get(f"/sandboxes/{sa}/metrics", headers=_key(B))).status_code == 404
        await front.metrics.round()
        assert front.metrics.history == {}  # nobody asked: the guest is left alone (idle stops)
        answer = await client.get(f"/sandboxes/{sa}/metrics", headers=_key(A))
        assert answer.status_code == 200, answer.text
        (sample,) = answer.json()  # taken by the call
        await front.metrics.round()  # asked for now: the rounds sample it
        assert len(front.metrics.history[sa]) == 2
        assert set(sample) == {"timestamp", "timestampUnix", "cpuCount", "cpuUsedPct", "memUsed", "memTotal",
                               "memCache", "diskUsed", "diskTotal"}
        assert sample["cpuCount"] >= 1 and 0 <= sample["cpuUsedPct"] <= 100
        assert 0 < sample["memUsed"] < sample["memTotal"] and 0 < sample["diskUsed"] < sample["diskTotal"]
        assert (await client.get(f"/sandboxes/{sa}/metrics", headers=_key(A),
                                 params={"start": sample["timestampUnix"] + 10})).json() == []
        many = await client.get("/sandboxes/metrics", headers=_key(A), params={"sandbox_ids": sa})
        assert many.json() == {"sandboxes": {sa: front.metrics.history[sa][-1].to_e2b()}}
        assert (await client.get("/sandboxes/metrics", headers=_key(B), params={"sandbox_ids": sa})).json() \
            == {"sandboxes": {}}
        await client.delete(f"/sandboxes/{sa}", headers=_key(A))
        await front.metrics.round()
        assert sa not in front.metrics.history

    on_front(scenario)


def test_proc_files_and_df_parse_and_a_hostile_one_is_refused() -> None:
    stat = "cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 50 0 25 400 25 0 0 0 0 0\ncpu1 50 0 25 400 25 0 0 0 0 0\nintr 5\n"
    assert cpu_times(stat) == (150, 1000, 2)
    assert memory("MemTotal: 1000 kB\nMemFree: 100 kB\nMemAvailable: 400 kB\nBuffers: 10 kB\nCached: 90 kB\n") \
        == (600 * 1024, 1000 * 1024, 100 * 1024)
    assert disk("Filesystem 1-blocks Used Available Capacity Mounted on\n/dev/vda 1000 300 700 30% /\n") == (300, 1000)
    with pytest.raises(ValueError):
        cpu_times("intr 5\n")


def test_fork_snapshots_and_pause_layers_are_collected_and_quota_and_floor_refuse_clearly(on_front: OnFront) -> None:
    async def scenario(runtime: Runtime, front: E2BFront, client: httpx.AsyncClient) -> None:
        sa = (await _create(client, A))["sandboxID"]
        forked = await client.post(f"/sandboxes/{sa}/fork", headers=_key(A), json={"count": 1})
        child = forked.json()[0]["sandbox"]
        tag = child["templateID"]
        later = time.time() + GRACE_S + 1
        assert await front.storage.collect(now=later) == []  # its child runs; the source's head
        await client.delete(f"/sandboxes/{child['sandboxID']}", headers=_key(A))
        assert await front.storage.collect(now=later) == []  # the source's next BRANCH chains onto it
        assert (await client.post(f"/sandboxes/{sa}/pause", headers=_key(A))).status_code == 204
        layers = list(runtime.workspaces.get(sa).meta["suspends"])
        assert await front.storage.collect(now=later) == []  # the pause layer was branched from it
        assert await front.storage.usage("team-a") > 0 and await front.storage.usage("team-b") == 0
        await client.delete(f"/sandboxes/{sa}", headers=_key(A))
        assert set(await front.storage.collect(now=later)) == {tag, *layers}
        assert all(runtime.snapshot(t) is None for t in (tag, *layers))

        tight = Storage(runtime, quota_bytes=1)
        _, strict = _front_with(runtime, tight)
        async with _client(strict) as limited:
            sb = (await _create(limited, A))["sandboxID"]
            first = await limited.post(f"/sandboxes/{sb}/snapshots", headers=_key(A), json={})
            assert first.status_code == 201  # nothing used yet
            over = await limited.post(f"/sandboxes/{sb}/snapshots", headers=_key(A), json={})
            assert over.status_code == 507 and "quota" in over.json()["message"]
            assert (await limited.post(f"/sandboxes/{sb}/fork", headers=_key(A), json={})).status_code == 507
            other = (await _create(limited, B))["sandboxID"]  # another owner is not held to A's use
            assert (await limited.post(f"/sandboxes/{other}/snapshots", headers=_key(B), json={})).status_code == 201
        runtime.space = SpaceFloor(floor_bytes=1 << 62)  # the daemon's floor, out of reach
        _, starved = _front_with(runtime, Storage(runtime))
        async with _client(starved) as cramped:
            answer = await cramped.post(f"/sandboxes/{other}/pause", headers=_key(B))
            assert answer.status_code == 507 and "disk full" in answer.json()["message"]
            assert front.sandboxes.resolve(other).live is not None  # refused before anything was touched

    on_front(scenario)


def test_the_pause_policy_and_deleted_snapshots_outlive_a_daemon_restart_and_the_keeper_runs_with_the_app(
        tmp_path: Path) -> None:
    async def scenario() -> None:
        vmm = FakeVmm()
        runtime = await _runtime(tmp_path, vmm)
        front, app = _front_with(runtime)
        async with _client(app) as client:
            sa = (await _create(client, A, timeout=300, autoPause=True, autoResume={"enabled": True}))["sandboxID"]
            sb = (await _create(client, A))["sandboxID"]
            snap = (await client.post(f"/sandboxes/{sb}/snapshots", headers=_key(A), json={})).json()["snapshotID"]
            assert (await client.delete(f"/templates/{snap}", headers=_key(A))).status_code == 204
        await runtime.sandboxes.detach_all()  # the daemon goes, its VMMs stay (its watchers must not outlive it)
        runtime.registry.close()
        restarted = await Runtime.open(runtime.paths, vmm)
        await recover(restarted.sandboxes, restarted.store)
        try:
            front, app = _front_with(restarted)
            assert snap in front.storage.doomed  # still hidden, still to be removed
            async with _client(app) as client:
                info = (await client.get(f"/sandboxes/{sa}", headers=_key(A))).json()
                assert info["lifecycle"] == {"onTimeout": "pause", "autoResume": True}
                assert await front.sandboxes.pause_due(now=time.time() + 301) == [sa]
            # the daemon's app starts the keeper once the runtime has started, and stops it first
            api = create_app(restarted, [front.keeper])
            async with api.router.lifespan_context(api):
                assert front.keeper.running
            assert not front.keeper.running
        finally:
            await restarted.stop()

    run(scenario)


def test_a_timeout_set_while_the_sandbox_is_being_paused_resumes_it_or_answers_409(on_front: OnFront) -> None:
    """Before: set_timeout saw the sandbox running, then found it paused under the lifecycle lock
    and failed an assertion (500)."""
    async def scenario(runtime: Runtime, front: E2BFront, client: httpx.AsyncClient) -> None:
        for auto_resume, status in ((True, 204), (False, 409)):
            made = await _create(client, A, timeout=300, autoPause=True, autoResume={"enabled": auto_resume})
            sa = made["sandboxID"]
            lock = front.sandboxes.lock(sa)
            await lock.acquire()  # what a pause at the timeout holds
            try:
                call = asyncio.ensure_future(client.post(f"/sandboxes/{sa}/timeout", headers=_key(A),
                                                         json={"timeout": 120}))
                await asyncio.sleep(0.2)  # it saw the sandbox running and now waits for the lock
                assert not call.done()
                await front.sandboxes._pause(None, sa)
            finally:
                lock.release()
            answer = await call
            assert answer.status_code == status, answer.text
            info = (await client.get(f"/sandboxes/{sa}", headers=_key(A))).json()
            assert info["state"] == ("running" if auto_resume else "paused")
            if auto_resume:  # the new deadline holds from now
                labels = front.sandboxes.resolve(sa).labels
                assert abs(float(labels[PAUSE_AT_LABEL]) - (time.time() + 120)) < 10
            else:
                assert "paused" in answer.json()["message"]

    on_front(scenario)
