"""The Kubernetes manifests (deploy/kubernetes), checked offline.

No cluster runs here. What is checked instead:

* ``kubectl kustomize`` renders the base and every overlay;
* ``kubernetes-validate`` accepts every built-in object in strict mode
  against ``KUBERNETES_VERSION`` (unknown fields are errors); the CRD
  objects (KEDA ``ScaledObject``, prometheus-operator ``ServiceMonitor``
  and ``PodMonitor``) are not in its schemas, so they are checked by
  structure: what they point at exists in the render;
* every container's command and environment parse with the real CLI and
  settings classes, as ``test_systemd_units.py`` does for the units;
* the frontend's probe paths are routes of the real app, and the exec
  probes parse with the real ``llamapool probe``;
* the Secrets ``make-secrets.sh`` makes from a real ``llamapool keygen``,
  mounted as the kubelet mounts them, load with the real CURVE classes.
"""

from __future__ import annotations

import base64
import os
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from frontend.app import create_app
from frontend.auth import PUBLIC_PATHS
from frontend.metrics import REQUESTS_REFUSED_NO_SLOT, SLOT_HOLD
from frontend.settings import FrontendSettings
from llamapool import cli
from protocol.curve import client_keys, load_key_pair
from protocol.settings import load
from tests.system_tools import require_tool
from workers.broker.security import BrokerSecurity, KeyDirectory

pytestmark = pytest.mark.stack  # kubectl is a process

ROOT = Path(__file__).resolve().parents[2]
KUBE_DIR = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("base", "overlays/cpu", "overlays/gpu")
#: The Kubernetes release the built-in objects are validated against.
KUBERNETES_VERSION = "1.32.0"
CRD_KINDS = {"ScaledObject", "ServiceMonitor", "PodMonitor"}
WORKLOADS = {"Deployment", "StatefulSet"}


@pytest.fixture(scope="module")
def renders() -> dict[str, list[dict]]:
    kubectl = require_tool("kubectl")
    out = {}
    for name in OVERLAYS:
        result = subprocess.run([kubectl, "kustomize", str(KUBE_DIR / name)],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        out[name] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return out


def objects(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_specs(docs: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["name"]: d["spec"]["template"]
            for d in docs if d["kind"] in WORKLOADS}


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def test_every_render_has_each_part(renders):
    for name, docs in renders.items():
        kinds = {d["kind"] for d in docs}
        assert {"StatefulSet", "Deployment", "Service", "PodDisruptionBudget",
                "NetworkPolicy", "ConfigMap", "PersistentVolumeClaim"} <= kinds, name
        assert objects(docs, "StatefulSet")["llamapool-broker"]["spec"]["replicas"] == 2
        if name != "base":
            assert CRD_KINDS <= kinds, name


@pytest.mark.parametrize("name", OVERLAYS)
def test_builtin_objects_are_valid_in_strict_mode(renders, name):
    checked = 0
    for doc in renders[name]:
        if doc["kind"] in CRD_KINDS:
            continue
        # Raises ValidationError on any unknown or mistyped field.
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        checked += 1
    assert checked >= 15


def test_strict_validation_is_not_vacuous(renders):
    worker = dict(pod_specs(renders["base"])["llamapool-worker"]["spec"])
    doc = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"},
           "spec": {**worker, "terminationGracePeriod": 45}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_broker_dns_names_match_the_lists(renders):
    docs = renders["base"]
    brokers = objects(docs, "StatefulSet")["llamapool-broker"]
    service = objects(docs, "Service")[brokers["spec"]["serviceName"]]
    assert service["spec"]["clusterIP"] == "None"
    assert selects(brokers["spec"]["selector"],
                   {**service["spec"]["selector"]})
    lists = objects(docs, "ConfigMap")["llamapool-brokers"]["data"]
    names = [f"{brokers['metadata']['name']}-{i}.{service['metadata']['name']}"
             for i in range(brokers["spec"]["replicas"])]
    assert lists["workers"] == ",".join(f"tcp://{n}:5556" for n in names)
    assert lists["frontends"] == ",".join(f"tcp://{n}:5555" for n in names)


# --- the containers' commands, with the real settings ---------------------------

def container_env(docs: list[dict], container: dict) -> dict[str, str]:
    """The environment a kubelet gives ``container`` (envFrom, then env)."""
    maps = objects(docs, "ConfigMap")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(maps[source["configMapRef"]["name"]]["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "configMapKeyRef" in var["valueFrom"]:
            ref = var["valueFrom"]["configMapKeyRef"]
            env[var["name"]] = maps[ref["name"]]["data"][ref["key"]]
        else:
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            env[var["name"]] = "llamapool-worker-5d4f-x2"
    return env


def parsed(docs, pod, container, monkeypatch):
    """The container's args, and its settings, through the real CLI."""
    env = container_env(docs, container)
    for key in [k for k in os.environ if k.startswith("LLAMAPOOL_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    args = cli.build_parser().parse_args(container["args"])
    return args, cli.settings_for(args), env


def mounts(pod: dict, container: dict) -> dict[str, dict]:
    """Mount path -> the volume mounted there."""
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    return {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}


def mounted_from(pod, container, path: str) -> tuple[str, dict]:
    """The mount that holds ``path``, and its volume."""
    found = [(m, v) for m, v in mounts(pod, container).items()
             if path.startswith(m.rstrip("/") + "/")]
    assert found, f"{path} is on no volume"
    return max(found, key=lambda mv: len(mv[0]))


@pytest.mark.parametrize("name", OVERLAYS)
def test_containers_parse_with_the_real_settings(renders, name, monkeypatch):
    docs = renders[name]
    for workload, pod in pod_specs(docs).items():
        (container,) = pod["spec"]["containers"]
        args, settings, env = parsed(docs, pod, container, monkeypatch)
        assert args.command in workload
        assert "LLAMAPOOL_INSECURE_PLAINTEXT" not in env
        if args.command == "broker":
            # Non-loopback binds, with CURVE: the bind policy lets them through.
            BrokerSecurity(settings.curve_secret_key, settings.curve_authorized_workers,
                           settings.curve_authorized_frontends,
                           settings.insecure_plaintext).check_endpoints(
                (settings.frontends_endpoint, settings.workers_endpoint))
            keys = (settings.curve_secret_key, settings.curve_authorized_workers,
                    settings.curve_authorized_frontends)
        else:
            # No plaintext link leaves a pod: every link to a broker is CURVE.
            assert settings.broker_endpoint.startswith("tcp://")
            assert settings.curve_server_key and settings.curve_secret_key
            keys = (settings.curve_server_key, settings.curve_secret_key)
        for path in keys:
            _, volume = mounted_from(pod, container, path + "/x")
            assert "secret" in volume, path


def test_worker_resources_follow_its_settings(renders, monkeypatch):
    for name in OVERLAYS:
        docs = renders[name]
        pod = pod_specs(docs)["llamapool-worker"]
        (container,) = pod["spec"]["containers"]
        _, settings, _ = parsed(docs, pod, container, monkeypatch)
        # CPU requests equal the threads llama.cpp spins.
        assert container["resources"]["requests"]["cpu"] == settings.n_threads
        # SIGTERM lets the running job finish before the kill.
        assert pod["spec"]["terminationGracePeriodSeconds"] > settings.shutdown_grace_s
        # The model is read from the read-only models volume.
        mount, volume = mounted_from(pod, container, settings.model_path)
        assert volume["persistentVolumeClaim"]["readOnly"] is True
        assert any(m["mountPath"] == mount and m["readOnly"]
                   for m in container["volumeMounts"])
        gpus = container["resources"]["limits"].get("nvidia.com/gpu")
        if name.endswith("gpu"):
            assert gpus == "1" and settings.gpu_layers != 0
            assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
        else:
            assert gpus is None and settings.gpu_layers == 0


def test_frontend_stop_grace_and_metrics_dir(renders, monkeypatch):
    docs = renders["base"]
    pod = pod_specs(docs)["llamapool-frontend"]
    (container,) = pod["spec"]["containers"]
    _, settings, env = parsed(docs, pod, container, monkeypatch)
    assert pod["spec"]["terminationGracePeriodSeconds"] > int(
        env["LLAMAPOOL_GRACEFUL_TIMEOUT_S"])
    _, volume = mounted_from(pod, container, env["PROMETHEUS_MULTIPROC_DIR"] + "/x")
    assert "emptyDir" in volume
    assert settings.api_key_file
    mounted_from(pod, container, settings.api_key_file)


def test_read_only_non_root_everywhere(renders):
    for workload, pod in pod_specs(renders["base"]).items():
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        (container,) = pod["spec"]["containers"]
        sc = container["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True, workload
        assert sc["allowPrivilegeEscalation"] is False
        assert "/tmp" in mounts(pod, container), workload


# --- probes ----------------------------------------------------------------------

def test_frontend_probe_paths_are_public_routes_apart_from_health(renders,
                                                                  monkeypatch):
    docs = renders["base"]
    pod = pod_specs(docs)["llamapool-frontend"]
    (container,) = pod["spec"]["containers"]
    _, settings, _ = parsed(docs, pod, container, monkeypatch)
    ready = container["readinessProbe"]["httpGet"]["path"]
    live = container["livenessProbe"]["httpGet"]["path"]
    assert len({ready, live, "/health"}) == 3
    app = create_app(load(FrontendSettings, {},
                          {"broker_endpoint": "tcp://127.0.0.1:1"}))
    for path in (ready, live):
        resource, *_ = app._router.find(path)
        assert resource is not None and hasattr(resource, "on_get"), path
        assert path in PUBLIC_PATHS  # a kubelet sends no key
    port = container["readinessProbe"]["httpGet"]["port"]
    bind_port = container_env(docs, container)["LLAMAPOOL_BIND"].rsplit(":")[1]
    assert {p["name"]: p["containerPort"] for p in container["ports"]}[port] == int(
        bind_port)


@pytest.mark.parametrize("workload", ["llamapool-broker", "llamapool-worker"])
def test_exec_probes_parse_and_read_the_metrics_port(renders, workload, monkeypatch):
    docs = renders["base"]
    pod = pod_specs(docs)[workload]
    (container,) = pod["spec"]["containers"]
    _, settings, _ = parsed(docs, pod, container, monkeypatch)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert settings.metrics_port == ports["metrics"]
    seen = set()
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = container[kind]["exec"]["command"]
        assert command[:2] == ["llamapool", "probe"]
        args = cli.build_parser().parse_args(command[1:])
        assert args.port == settings.metrics_port  # from the container's env
        seen.add(getattr(args, "require", None))
    if workload == "llamapool-worker":
        # Startup covers the load, readiness the registration, liveness
        # only the link thread (a broker restart must not restart workers).
        assert container["startupProbe"]["exec"]["command"][-1] == "loaded"
        assert container["readinessProbe"]["exec"]["command"][-1] == "registered"
        assert container["livenessProbe"]["exec"]["command"][-1] == "alive"
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


# --- disruption, scaling, monitoring ---------------------------------------------

def test_disruption_budgets_never_take_a_whole_role(renders):
    docs = renders["base"]
    workloads = {d["metadata"]["name"]: d for d in docs if d["kind"] in WORKLOADS}
    covered = set()
    for pdb in objects(docs, "PodDisruptionBudget").values():
        (name,) = [n for n, w in workloads.items() if selects(
            pdb["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])]
        assert 1 <= pdb["spec"]["minAvailable"] < workloads[name]["spec"]["replicas"]
        covered.add(name)
    assert covered == set(workloads)


def test_worker_rollout_never_lowers_the_slot_count(renders):
    worker = objects(renders["base"], "Deployment")["llamapool-worker"]
    assert worker["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_scaled_object_reads_the_demand_of_this_model(renders):
    docs = renders["overlays/cpu"]
    (scaled,) = objects(docs, "ScaledObject").values()
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    target = scaled["spec"]["scaleTargetRef"]["name"]
    assert target in objects(docs, "Deployment")
    pdb_min = objects(docs, "PodDisruptionBudget")[target]["spec"]["minAvailable"]
    assert scaled["spec"]["minReplicaCount"] > pdb_min
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metricType"] == "AverageValue"
    assert trigger["metadata"]["threshold"] == "1"  # one slot per worker pod
    query = trigger["metadata"]["query"]
    model = objects(docs, "ConfigMap")["llamapool-pool"]["data"]["LLAMAPOOL_MODEL_NAME"]
    # Series that exist, under the model the workers register as.
    refused = REQUESTS_REFUSED_NO_SLOT._name + "_total"
    hold = SLOT_HOLD._name
    for series in (refused, "llamapool_model_slots", hold + "_sum", hold + "_count"):
        assert series in query, series
    labelled = re.findall(r"(\w+)\{model=\"([^\"]*)\"", query)
    assert labelled and all(value == model for _, value in labelled)


def test_monitors_point_at_what_exists(renders):
    docs = renders["overlays/cpu"]
    services = objects(docs, "Service")
    for monitor in objects(docs, "ServiceMonitor").values():
        (service,) = [s for s in services.values()
                      if selects(monitor["spec"]["selector"], s["metadata"]["labels"])]
        ports = {p["name"] for p in service["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in ports
    frontend = objects(docs, "ServiceMonitor")["llamapool-frontend"]
    (endpoint,) = frontend["spec"]["endpoints"]
    assert endpoint["authorization"]["credentials"] == {
        "name": "llamapool-api-keys", "key": "prometheus"}
    for monitor in objects(docs, "PodMonitor").values():
        (name,) = [n for n, pod in pod_specs(docs).items() if selects(
            monitor["spec"]["selector"], pod["metadata"]["labels"])]
        (container,) = pod_specs(docs)[name]["spec"]["containers"]
        ports = {p["name"] for p in container["ports"]}
        assert all(e["port"] in ports for e in monitor["spec"]["podMetricsEndpoints"])


# --- the network rules, as deploy/nftables has them ------------------------------

def allowed_roles(docs, role: str, port: int) -> set[str]:
    """Which llamapool roles the policies let reach ``role``'s ``port``."""
    roles = set()
    for policy in objects(docs, "NetworkPolicy").values():
        if policy["spec"]["podSelector"]["matchLabels"].get(
                "app.kubernetes.io/component") != role:
            continue
        for rule in policy["spec"].get("ingress", []):
            if port not in [p["port"] for p in rule["ports"]]:
                continue
            for peer in rule["from"]:
                labels = peer.get("podSelector", {}).get("matchLabels", {})
                roles.add(labels.get("app.kubernetes.io/component", "<namespace>"))
    return roles


def test_network_policy_has_the_firewall_rules(renders):
    docs = renders["base"]
    nft = (ROOT / "deploy" / "nftables" / "llamapool.nft").read_text()
    port = {name: int(value) for name, value in
            re.findall(r"define llamapool_(\w+)_port = (\d+)", nft)}
    assert allowed_roles(docs, "broker", port["frontends"]) == {"frontend"}
    assert allowed_roles(docs, "broker", port["workers"]) == {"worker"}
    assert allowed_roles(docs, "frontend", port["http"]) == {"<namespace>"}
    deny = objects(docs, "NetworkPolicy")["llamapool-default-deny"]
    assert "ingress" not in deny["spec"] and deny["spec"]["policyTypes"] == ["Ingress"]
    for pod in pod_specs(docs).values():
        assert selects(deny["spec"]["podSelector"], pod["metadata"]["labels"])


# --- Secrets and their volumes, against what keygen writes ------------------------

@pytest.fixture(scope="module")
def secrets(tmp_path_factory) -> dict[str, dict[str, bytes]]:
    keys = tmp_path_factory.mktemp("keys") / "llamapool-keys"
    env = {**os.environ, "LLAMAPOOL": str(Path(sys.executable).parent / "llamapool"),
           "KUBECTL": require_tool("kubectl")}
    result = subprocess.run(["sh", str(KUBE_DIR / "make-secrets.sh"), str(keys)],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    out = {}
    for doc in yaml.safe_load_all(result.stdout):
        if doc:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            assert doc["metadata"]["namespace"] == "llamapool"
            out[doc["metadata"]["name"]] = {
                k: base64.b64decode(v) for k, v in doc["data"].items()}
    return out


def kubelet_mount(root: Path, mount: str, data: dict[str, bytes]) -> None:
    """A Secret volume as the kubelet writes it: the files in a timestamped
    directory, ``..data`` pointing at it, one symlink per key."""
    target = root / mount.lstrip("/")
    stamped = target / "..2026_01_01_00_00_00.000000001"
    stamped.mkdir(parents=True)
    for key, value in data.items():
        (stamped / key).write_bytes(value)
    (target / "..data").symlink_to(stamped.name)
    for key in data:
        (target / key).symlink_to(f"..data/{key}")


def rooted(root: Path, path: str) -> str:
    return str(root / path.lstrip("/"))


def test_secret_volumes_load_with_the_real_curve_classes(renders, secrets,
                                                         tmp_path, monkeypatch):
    docs = renders["base"]
    pods = pod_specs(docs)
    loaded = {}
    for workload, pod in pods.items():
        (container,) = pod["spec"]["containers"]
        root = tmp_path / workload
        for mount, volume in mounts(pod, container).items():
            if "secret" in volume:
                kubelet_mount(root, mount, secrets[volume["secret"]["secretName"]])
        _, settings, _ = parsed(docs, pod, container, monkeypatch)
        loaded[workload] = (root, settings)
    root, broker = loaded["llamapool-broker"]
    broker_public, _ = load_key_pair(rooted(root, broker.curve_secret_key))
    authorized = {role: KeyDirectory(role, rooted(root, path)).current for role, path in
                  (("workers", broker.curve_authorized_workers),
                   ("frontends", broker.curve_authorized_frontends))}
    for workload, role in (("llamapool-worker", "workers"),
                           ("llamapool-frontend", "frontends")):
        root, settings = loaded[workload]
        client = client_keys(rooted(root, settings.curve_server_key),
                             rooted(root, settings.curve_secret_key))
        # Its own key is in its role's directory, and only there.
        assert client.public in authorized[role]
        other = "frontends" if role == "workers" else "workers"
        assert client.public not in authorized[other]
        # It checks the key the broker really holds.
        assert client.server_public == broker_public
    api_keys = secrets["llamapool-api-keys"]
    assert api_keys["prometheus"].decode() in api_keys["api-keys"].decode().split()
