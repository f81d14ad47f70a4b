"""The Helm chart in packaging/helm/forkd renders, validates and fits the daemon it deploys.

No Kubernetes server runs on the machines the tests run on, so everything here is offline: the
chart is rendered by Helm's own engine (Helm's Go SDK, bundled by helm-python-sdk), every core
object is validated against the Kubernetes JSON schemas kubernetes-validate ships (strict: unknown
fields are errors), and the RayCluster against the fields of KubeRay's ray.io/v1 CRD (no copy of
that CRD is available offline, so the fields we rely on are written out below) with its pod
templates validated as core PodTemplateSpecs. Then what no schema sees: both halves on the same
nodes, the probe's route served without the token, every Secret, volume and variable referenced
actually defined, and the environment variables the daemon and SDK really read. Last, the
DaemonSet's container runs as a real daemon process (its command and environment, host paths in a
temporary directory, the fake VMM backend so it can fork here) and its preStop script drains it.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml

from conftest import _fake_image
from forkd.daemon.config import ENV_KEYS
from forkd.daemon.middleware.auth import OPEN_PATHS
from forkd.daemon.routes import ROUTERS
from forkd.sdk.connection import ConnectionConfig
from forkd.sdk.controller import Controller, ForkdError

CHART = Path(__file__).resolve().parents[2] / "packaging" / "helm" / "forkd"
KUBERNETES_VERSION = "1.37.0"  # the newest schemas kubernetes-validate 1.37.0 ships
TOKEN = "k8s-chart-Qw3rTy9UiOp2AsDfGh7JkLzXcVbNm4Pq"
VALUES: dict[str, Any] = {"image": {"repository": "registry.invalid/forkd"}, "token": {"value": TOKEN}}

# KubeRay v1.7.0's RayCluster (ray.io/v1) CRD: the fields it accepts at the levels the chart writes
# (the CRD prunes anything else, so a misspelt field would silently vanish) and what it requires.
_INT32 = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_TEMPLATE = {"type": "object", "required": ["spec"], "properties": {"metadata": {"type": "object"},
                                                                   "spec": {"type": "object"}}}
_HEAD_FIELDS = ("enableIngress", "headService", "ingressOptions", "labels", "resources")
_WORKER_FIELDS = ("idleTimeoutSeconds", "labels", "numOfHosts", "priority", "resources", "scaleStrategy", "suspend")
_SPEC_FIELDS = ("authOptions", "autoscalerOptions", "enableInTreeAutoscaling", "gcsFaultToleranceOptions",
                "headServiceAnnotations", "historyServerOptions", "managedBy", "networkPolicy", "suspend",
                "tlsOptions", "upgradeStrategy")
RAYCLUSTER_V1 = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"}, "kind": {"const": "RayCluster"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object", "required": ["headGroupSpec"], "additionalProperties": False,
            "properties": {**{name: {} for name in _SPEC_FIELDS}, "rayVersion": {"type": "string"},
                "headGroupSpec": {
                    "type": "object", "required": ["template"], "additionalProperties": False,
                    "properties": {**{name: {} for name in _HEAD_FIELDS}, "serviceType": {"type": "string"},
                                   "rayStartParams": _STRING_MAP, "template": _TEMPLATE}},
                "workerGroupSpecs": {"type": "array", "items": {
                    "type": "object", "required": ["groupName", "maxReplicas", "minReplicas", "template"],
                    "additionalProperties": False,
                    "properties": {**{name: {} for name in _WORKER_FIELDS}, "groupName": {"type": "string"},
                                   "replicas": _INT32, "minReplicas": _INT32, "maxReplicas": _INT32,
                                   "rayStartParams": _STRING_MAP, "template": _TEMPLATE}}}}},
    },
}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values, name="demo", namespace="forkd")
    return [doc for text in manifests.values() for doc in yaml.safe_load_all(text) if doc]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [obj for obj in objects if obj["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} objects rendered"
    return found[0]


def validate_raycluster(raycluster: dict[str, Any]) -> None:
    """KubeRay's CRD fields, its operator's rules we rely on, and each pod template as a core PodTemplateSpec."""
    jsonschema.validate(raycluster, RAYCLUSTER_V1)
    spec = raycluster["spec"]
    for group in spec.get("workerGroupSpecs", []):
        if not group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"]:
            raise ValueError(f"KubeRay refuses {group['groupName']}: minReplicas <= replicas <= maxReplicas")
    for template in pod_templates(raycluster):
        if not template["spec"].get("containers"):
            raise ValueError("KubeRay refuses a group without a container")
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                      "template": template}, KUBERNETES_VERSION, strict=True)


def pod_templates(raycluster: dict[str, Any]) -> list[dict[str, Any]]:
    spec = raycluster["spec"]
    return [spec["headGroupSpec"]["template"], *(group["template"] for group in spec.get("workerGroupSpecs", []))]


def validate(obj: dict[str, Any]) -> None:
    if obj["kind"] == "RayCluster":
        validate_raycluster(obj)
    else:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in container.get("env", [])}


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    return render(VALUES)


@pytest.fixture(scope="module")
def daemon(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objects, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]


@pytest.fixture(scope="module")
def worker(objects: list[dict[str, Any]]) -> dict[str, Any]:
    [group] = one(objects, "RayCluster")["spec"]["workerGroupSpecs"]
    return group["template"]


def test_chart_lints_clean() -> None:
    report = helm.lint(CHART, values=VALUES, strict=True, kube_version=f"v{KUBERNETES_VERSION}")
    assert report["errors"] == [] and all(m["severity"] < 2 for m in report["messages"]), report


def test_every_object_validates(objects: list[dict[str, Any]]) -> None:
    assert sorted(obj["kind"] for obj in objects) == ["DaemonSet", "RayCluster", "Secret"]
    for obj in objects:
        validate(obj)


@pytest.mark.parametrize(("kind", "breakage"), [
    ("DaemonSet", lambda o: o["spec"]["template"]["spec"]["containers"][0].update(readinesProbe={})),
    ("DaemonSet", lambda o: o["spec"]["template"]["spec"].update(hostNetwork="yes")),
    ("RayCluster", lambda o: o["spec"]["workerGroupSpecs"][0].update(groupname="x")),
    ("RayCluster", lambda o: o["spec"]["workerGroupSpecs"][0].pop("maxReplicas")),
    ("RayCluster", lambda o: o["spec"]["workerGroupSpecs"][0].update(minReplicas=5)),
    ("RayCluster", lambda o: o["spec"]["headGroupSpec"]["template"]["spec"].update(nodeSelectr={})),
    ("RayCluster", lambda o: o["spec"]["workerGroupSpecs"][0]["template"]["spec"].update(containers=[])),
])
def test_validation_catches_a_broken_object(objects: list[dict[str, Any]], kind: str, breakage: Any) -> None:
    broken = copy.deepcopy(one(objects, kind))
    breakage(broken)
    with pytest.raises((jsonschema.ValidationError, ValueError)):
        validate(broken)


def test_ray_workers_run_on_exactly_the_daemons_nodes(objects: list[dict[str, Any]],
                                                      worker: dict[str, Any]) -> None:
    daemonset = one(objects, "DaemonSet")["spec"]
    assert daemonset["template"]["spec"]["nodeSelector"] == worker["spec"]["nodeSelector"] == {"forkd.dev/kvm": "true"}
    assert daemonset["selector"]["matchLabels"].items() <= daemonset["template"]["metadata"]["labels"].items()
    # An update stops the old daemon before the new one starts: never two on one FORKD_HOME.
    assert daemonset["updateStrategy"]["rollingUpdate"].get("maxSurge", 0) == 0
    # One worker per node: the anti-affinity selects the workers themselves, across hostnames.
    [term] = worker["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= worker["metadata"]["labels"].items()
    assert not term["labelSelector"]["matchLabels"].items() <= daemonset["template"]["metadata"]["labels"].items()


def test_head_is_kept_off_the_forkd_nodes_and_runs_no_tasks(objects: list[dict[str, Any]]) -> None:
    head = one(objects, "RayCluster")["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert "nodeSelector" not in head["template"]["spec"]
    [preference] = head["template"]["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preference["preference"]["matchExpressions"] == [
        {"key": "forkd.dev/kvm", "operator": "NotIn", "values": ["true"]}]


def test_readiness_probe_hits_a_route_the_daemon_serves_without_the_token(daemon: dict[str, Any]) -> None:
    probe = daemon["readinessProbe"]["httpGet"]
    served = {(method, route.path) for router in ROUTERS for route in router.routes
              for method in getattr(route, "methods", ())}
    assert ("GET", probe["path"]) in served
    assert probe["path"] in OPEN_PATHS  # the kubelet sends no bearer token
    [port] = [p for p in daemon["ports"] if p["name"] == probe["port"]]
    assert env_of(daemon)["FORKD_LISTEN"]["value"] == f"$(HOST_IP):{port['containerPort']}"


def test_worker_reaches_its_own_nodes_daemon(daemon: dict[str, Any], worker: dict[str, Any],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    [container] = worker["spec"]["containers"]
    env = env_of(container)
    assert env["HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    assert env_of(daemon)["HOST_IP"] == env["HOST_IP"]
    [port] = [p["containerPort"] for p in daemon["ports"] if p["name"] == "api"]
    assert env["FORKD_URL"]["value"] == f"http://$(HOST_IP):{port}"
    # What the SDK inside `forkd node start` makes of those variables once the kubelet expanded them.
    monkeypatch.setenv("FORKD_URL", env["FORKD_URL"]["value"].replace("$(HOST_IP)", "10.0.0.7"))
    monkeypatch.setenv("FORKD_TOKEN", TOKEN)
    connection = ConnectionConfig.from_env()
    assert (connection.url, connection.token) == (f"http://10.0.0.7:{port}", TOKEN)
    assert worker["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    assert container["command"][-1].startswith('exec forkd node start --ray-address "${RAY_ADDRESS:?')


def test_daemon_is_configured_through_variables_it_reads(objects: list[dict[str, Any]],
                                                         daemon: dict[str, Any]) -> None:
    env = env_of(daemon)
    assert {"FORKD_HOME", "FORKD_CACHE", "FORKD_LISTEN", "FORKD_TOKEN_FILE"} <= ENV_KEYS.keys()
    mounts = {m["name"]: m["mountPath"] for m in daemon["volumeMounts"]}
    volumes = {v["name"]: v for v in one(objects, "DaemonSet")["spec"]["template"]["spec"]["volumes"]}
    assert mounts.keys() <= volumes.keys()
    assert mounts["home"] == env["FORKD_HOME"]["value"] == volumes["home"]["hostPath"]["path"]
    assert mounts["cache"] == env["FORKD_CACHE"]["value"] == volumes["cache"]["hostPath"]["path"]
    assert volumes["kvm"]["hostPath"] == {"path": "/dev/kvm", "type": "CharDevice"} and mounts["kvm"] == "/dev/kvm"
    assert env["FORKD_TOKEN_FILE"]["value"] == f"{mounts['token']}/token"
    assert daemon["securityContext"]["privileged"] is True


def test_every_variable_is_defined_before_it_is_used(objects: list[dict[str, Any]]) -> None:
    # The kubelet expands $(NAME) only for variables defined earlier in the same container's env.
    containers = [c for obj in objects if obj["kind"] == "DaemonSet" for c in obj["spec"]["template"]["spec"]["containers"]]
    containers += [c for t in pod_templates(one(objects, "RayCluster")) for c in t["spec"]["containers"]]
    used = 0
    for container in containers:
        defined: set[str] = set()
        for item in container.get("env", []):
            for name in re.findall(r"\$\((\w+)\)", item.get("value", "")):
                assert name in defined, f"{container['name']}: {item['name']} uses $({name}) before it is set"
                used += 1
            defined.add(item["name"])
    assert used >= 2


def test_both_halves_read_the_token_from_the_secret_the_chart_makes(objects: list[dict[str, Any]],
                                                                  worker: dict[str, Any]) -> None:
    secret = one(objects, "Secret")
    assert secret["stringData"] == {"token": TOKEN}
    [volume] = [v for v in one(objects, "DaemonSet")["spec"]["template"]["spec"]["volumes"] if v["name"] == "token"]
    reference = env_of(worker["spec"]["containers"][0])["FORKD_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert volume["secret"]["secretName"] == reference["name"] == secret["metadata"]["name"]
    assert reference["key"] in secret["stringData"]


def test_an_existing_secret_is_referenced_not_made() -> None:
    objects = render({**VALUES, "token": {"existingSecret": "site-forkd-token"}})
    assert "Secret" not in {obj["kind"] for obj in objects}
    [volume] = [v for v in one(objects, "DaemonSet")["spec"]["template"]["spec"]["volumes"] if v["name"] == "token"]
    assert volume["secret"]["secretName"] == "site-forkd-token"


@pytest.mark.parametrize(("values", "message"), [
    ({"image": VALUES["image"]}, "token.existingSecret or token.value is required"),
    ({**VALUES, "token": {"value": TOKEN, "existingSecret": "s"}}, "not both"),
    ({"token": VALUES["token"]}, "image.repository is required"),
    # values.schema.json
    ({**VALUES, "token": {"value": "too-short-for-the-daemon"}}, "at '/token/value'"),
    ({**VALUES, "ray": {"workers": {"replicas": "two"}}}, "at '/ray/workers/replicas': got string, want integer"),
    ({**VALUES, "nodeSelector": None}, "missing property 'nodeSelector'"),  # null deletes a default
    ({**VALUES, "daemon": {"port": 70000}}, "at '/daemon/port'"),
])
def test_bad_values_are_refused_naming_what_to_set(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        render(values)


def test_ray_can_be_left_out() -> None:
    objects = render({**VALUES, "ray": {"enabled": False}})
    assert sorted(obj["kind"] for obj in objects) == ["DaemonSet", "Secret"]


def expand(env: list[dict[str, Any]], node_ip: str) -> dict[str, str]:
    """A container's environment as the kubelet makes it: the downward API's node IP, $(VAR) expanded."""
    values: dict[str, str] = {}
    for item in env:
        if item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.hostIP":
            values[item["name"]] = node_ip
        else:
            values[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: values[m[1]], item["value"])
    return values


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Any], dict[str, str]]]:
    """The DaemonSet's container run as a real daemon process: its command and environment, host paths
    under a temporary directory, the node's IP 127.0.0.1, the Secret's token as the mounted file; its
    VMM backend the fake one (``FORKD_VMM=fake``, with a fake guest image) so that it forks here."""
    root = tmp_path_factory.mktemp("node")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    objects = render({**VALUES, "daemon": {"home": str(root / "home"), "cache": str(root / "cache"), "port": port}})
    container = one(objects, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    token_dir = root / "token"
    token_dir.mkdir()
    (token_dir / "token").write_text(one(objects, "Secret")["stringData"]["token"])
    [mount] = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == "token"]
    env = {key: value.replace(mount, str(token_dir)) for key, value in expand(container["env"], "127.0.0.1").items()}
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("FORKD_")}, **env,
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "FORKD_VMM": "fake"}
    _fake_image(Path(env["FORKD_CACHE"]))
    assert shutil.which(container["command"][0], path=env["PATH"]), "the image's forkd entry point"
    log = open(root / "daemon.out", "wb")
    process = subprocess.Popen(container["command"], env=env, stdout=log, stderr=subprocess.STDOUT)
    probe_url = f"http://127.0.0.1:{port}{container['readinessProbe']['httpGet']['path']}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(probe_url, timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the pod's daemon did not get ready: {(root / 'daemon.out').read_text()[-2000:]}")
        time.sleep(0.2)
    yield container, env
    if process.poll() is None:
        process.terminate()
        process.wait(timeout=60)
    log.close()


def start_pre_stop(container: dict[str, Any], env: dict[str, str]) -> subprocess.Popen[str]:
    """The preStop hook's command, reading the token from where the fixture put the mounted file."""
    hook = container["lifecycle"]["preStop"]["exec"]["command"]
    command = [part.replace("/etc/forkd/token/token", env["FORKD_TOKEN_FILE"]) for part in hook]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def pre_stop(container: dict[str, Any], env: dict[str, str]) -> str:
    hook = start_pre_stop(container, env)
    stdout, stderr = hook.communicate(timeout=120)
    assert hook.returncode == 0, stderr
    return stdout.strip()


def test_pods_daemon_serves_the_token_on_the_node_ip_and_drains(pod: tuple[dict[str, Any], dict[str, str]]) -> None:
    container, env = pod
    url = f"http://{env['FORKD_LISTEN']}"
    token = Path(env["FORKD_TOKEN_FILE"]).read_text()
    assert httpx.get(f"{url}/v1/sandboxes").status_code == 401
    assert httpx.get(f"{url}/v1/sandboxes", headers={"Authorization": f"Bearer {token}"}).json() == {"sandboxes": []}
    assert pre_stop(container, env) == "drain: no sandboxes left"
    assert httpx.delete(f"{url}/v1/node/drain", headers={"Authorization": f"Bearer {token}"}).json()["draining"] is False


def test_pre_stop_refuses_new_forks_and_waits_for_the_running_sandboxes(
        pod: tuple[dict[str, Any], dict[str, str]]) -> None:
    container, env = pod
    token = Path(env["FORKD_TOKEN_FILE"]).read_text()
    with Controller(f"http://{env['FORKD_LISTEN']}", token) as api:
        api.create_snapshot("base", memory_mib=1024, warm_modules=[])
        child = api.fork("base", 1)["sandboxes"][0]["id"]
        hook = start_pre_stop(container, env)
        try:
            deadline = time.monotonic() + 60
            while not api.node()["draining"]:
                assert hook.poll() is None and time.monotonic() < deadline, "the preStop hook did not drain"
                time.sleep(0.1)
            with pytest.raises(ForkdError) as refused:
                api.fork("base", 1)
            assert (refused.value.status, refused.value.code) == (503, "draining")
            assert api.exec(child, "true")["exit_code"] == 0  # the running sandbox is served while it waits
            assert hook.poll() is None  # it waits for that sandbox
            api.kill(child)
            stdout, stderr = hook.communicate(timeout=120)
        finally:
            if hook.poll() is None:
                hook.kill()
        assert (hook.returncode, stdout.strip()) == (0, "drain: no sandboxes left"), stderr
        # `forkd node drain` itself: a sandbox left after the wait is its exit status 3, which the hook reports.
        api.undrain()
        left = api.fork("base", 1)["sandboxes"][0]["id"]
        cli_env = {**env, "FORKD_URL": f"http://{env['FORKD_LISTEN']}", "FORKD_TOKEN": token}
        drained = subprocess.run(["forkd", "node", "drain"], env=cli_env, capture_output=True, text=True, timeout=120)
        assert drained.returncode == 3, drained.stderr
        assert f"drain: 1 sandboxes still running ({left}), 0 starting" in drained.stdout
        api.kill(left)
        api.undrain()


def test_drain_lets_a_daemon_that_is_gone_stop(pod: tuple[dict[str, Any], dict[str, str]]) -> None:
    container, env = pod
    assert pre_stop(container, {**env, "HOST_IP": "127.0.0.2"}) == "drain: the daemon did not answer; stopping it"


def test_worker_command_matches_the_cli() -> None:
    from forkd.cli.main import cli
    node = cli.commands.get("node")
    start = getattr(node, "commands", {}).get("start")
    if start is None:
        pytest.skip("`forkd node start` is not on this branch yet (the cluster contract's command)")
    assert "--ray-address" in {opt for param in start.params for opt in param.opts}
