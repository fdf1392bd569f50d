"""deploy/k8s/ holds together, offline (there is no cluster here).

Every object of a kind Kubernetes itself defines is validated against that Kubernetes version's
OpenAPI schema, strict (an unknown or misspelled field fails), by `kubernetes-validate` from PyPI,
which bundles the schemas. The Prometheus Operator's PodMonitor, a CRD, is validated by the
models `cloudcoil-models-prometheus-operator` generates from the operator's CRD schemas (types
and patterns; a field the model does not know fails the round trip). The rest asserts what the
schemas cannot see: the wiring between objects
(selectors, ports, DNS names, Secrets, volumes), host namespaces only where CUDA IPC needs them,
resources and probes on every container, no token in any file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import urlparse

import kubernetes_validate
import pytest
import yaml
from test_compose import flag, port_of, unparsed_gateway_flags

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy/k8s"
# The oldest Kubernetes the manifests are written for: gRPC probes (GA 1.27), internalTrafficPolicy
# (GA 1.26), autoscaling/v2 behavior; validated against both ends of what the package bundles.
K8S_VERSIONS = ("1.29", kubernetes_validate.utils.latest_version())
NAMESPACE = "kvtier"
WORKLOADS = {
    "cache": ("DaemonSet", "kvtier-cache"),
    "compute": ("Deployment", "kvtier-compute"),
    "gateway": ("Deployment", "kvtier-gateway"),
}
# Mooncake Store, the caches' shared tier (25-mooncake.yaml): no kvtier flags, token or API keys.
STORE_WORKLOADS = {
    "mooncake-master": ("Deployment", "kvtier-mooncake-master"),
    "mooncake-store": ("Deployment", "kvtier-mooncake-store"),
}
ALL_WORKLOADS = {**WORKLOADS, **STORE_WORKLOADS}
SECRETS = {"kvtier-token": "token", "kvtier-api-keys": "api-keys.json"}
NOT_IN_THE_SCHEMAS = {("monitoring.coreos.com/v1", "PodMonitor")}


def load_docs() -> list[tuple[str, dict]]:
    files = sorted(K8S.glob("*.yaml"))
    assert files, "no manifests in deploy/k8s"
    return [(f.name, d) for f in files for d in yaml.safe_load_all(f.read_text()) if d]


DOCS = load_docs()


def ident(doc: dict) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


def obj(kind: str, name: str) -> dict:
    (found,) = [d for _, d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def pod(role: str) -> dict:
    return obj(*ALL_WORKLOADS[role])["spec"]["template"]["spec"]


def container(role: str) -> dict:
    (c,) = pod(role)["containers"]
    return c


def pod_labels(role: str) -> dict:
    return obj(*ALL_WORKLOADS[role])["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def roles_selected_by(selector: dict) -> list[str]:
    return [role for role in ALL_WORKLOADS if selects(selector, pod_labels(role))]


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def quantity(value: str | int) -> float:
    """A Kubernetes quantity (2, 500m, 12Gi, 1G) as a number."""
    number, suffix = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(value)).groups()
    scale = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    return float(number) * scale[suffix]


def cluster_dns(address: str) -> tuple[str, str, int]:
    """`svc.ns.svc.cluster.local:port` (optionally tcp://) -> (svc, ns, port)."""
    host_port = address.removeprefix("tcp://")
    host, port = host_port.rsplit(":", 1)
    match = re.fullmatch(r"([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local", host)
    assert match, f"not a Service's cluster DNS name: {address}"
    return match[1], match[2], int(port)


# ---------------------------------------------------------------- schema


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(("file", "doc"), DOCS, ids=[f"{f}:{ident(d)}" for f, d in DOCS])
def test_manifest_validates_against_the_kubernetes_schema(file: str, doc: dict, version: str):
    if (doc["apiVersion"], doc["kind"]) in NOT_IN_THE_SCHEMAS:
        pytest.skip(f"{doc['kind']} is a CRD: test_podmonitor_validates_against_the_operators_crd_models")
    kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_rejects_a_misspelled_field():
    daemonset = yaml.safe_load(yaml.safe_dump(obj(*WORKLOADS["cache"])))
    daemonset["spec"]["template"]["spec"]["hostIpc"] = True  # hostIPC
    with pytest.raises(kubernetes_validate.ValidationError, match="hostIpc"):
        kubernetes_validate.validate(daemonset, K8S_VERSIONS[0], strict=True)
    probe = yaml.safe_load(yaml.safe_dump(obj(*WORKLOADS["compute"])))
    probe["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(probe, K8S_VERSIONS[0], strict=True)  # grpc.port is an integer


def test_only_the_podmonitor_lacks_a_bundled_schema():
    kinds = {(d["apiVersion"], d["kind"]) for _, d in DOCS}
    assert kinds & NOT_IN_THE_SCHEMAS == NOT_IN_THE_SCHEMAS
    for _, doc in DOCS:
        if (doc["apiVersion"], doc["kind"]) in NOT_IN_THE_SCHEMAS:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, K8S_VERSIONS[0], strict=True)


# ---------------------------------------------------------------- objects and namespace


def test_the_pieces_are_all_there_in_one_namespace_created_first():
    first_file, first = DOCS[0]
    assert first["kind"] == "Namespace" and first["metadata"]["name"] == NAMESPACE, first_file
    for _, doc in DOCS[1:]:
        assert doc["metadata"]["namespace"] == NAMESPACE, ident(doc)
    kinds = [d["kind"] for _, d in DOCS]
    for kind in ("DaemonSet", "Deployment", "Service", "PodDisruptionBudget"):
        assert kind in kinds
    assert {"HorizontalPodAutoscaler", "PodMonitor", "PersistentVolumeClaim"} <= set(kinds)
    assert len({ident(d) for _, d in DOCS}) == len(DOCS), "two objects of one kind and name"


# ---------------------------------------------------------------- images, resources, probes


@pytest.mark.parametrize("role", WORKLOADS)
def test_images_are_tagged_never_latest(role: str):
    for c in pod(role)["containers"] + pod(role).get("initContainers", []):
        name, _, tag = c["image"].rpartition(":")
        assert name and tag and "/" not in tag, f"{role}: untagged image {c['image']}"
        assert tag != "latest", f"{role}: {c['image']}"
        assert c["imagePullPolicy"] == "IfNotPresent"


@pytest.mark.parametrize("role", WORKLOADS)
def test_every_container_has_requests_and_limits(role: str):
    for c in pod(role)["containers"]:
        requests, limits = c["resources"]["requests"], c["resources"]["limits"]
        for resource in ("cpu", "memory"):
            assert quantity(requests[resource]) <= quantity(limits[resource]), (role, resource)
        for resource in set(requests) | set(limits):
            if "/" in resource:  # extended resources (GPUs): requests must equal limits
                assert requests.get(resource) == limits.get(resource), (role, resource)


def test_gpu_on_cache_and_compute_only():
    for role in ("cache", "compute"):
        assert container(role)["resources"]["limits"]["nvidia.com/gpu"] == 1, role
    assert not any("gpu" in r for r in container("gateway")["resources"]["limits"])
    assert container("gateway")["image"].endswith(":cpu")


def test_cache_memory_limit_holds_its_host_tier():
    c = container("cache")
    host = float(flag(c["args"], "host-cache-gib")) * (1 << 30)
    assert quantity(c["resources"]["requests"]["memory"]) > host
    assert quantity(c["resources"]["limits"]["memory"]) > host


def named_port(c: dict, port: int | str) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in c["ports"] if p["name"] == port]
    return number


@pytest.mark.parametrize("role", ["cache", "compute"])
def test_grpc_services_have_grpc_health_probes_on_their_listen_port(role: str):
    c = container(role)
    listen = port_of(flag(c["args"], "listen"))
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["grpc"]["port"] == listen, (role, probe)
        assert "service" not in c[probe]["grpc"]  # "": the server as a whole
    live = c["livenessProbe"]
    assert ("grpc" in live and live["grpc"]["port"] == listen) or named_port(
        c, live["tcpSocket"]["port"]
    ) == listen


def test_cache_liveness_is_grpc_health():
    assert container("cache")["livenessProbe"]["grpc"]["port"] == port_of(
        flag(container("cache")["args"], "listen")
    )


@pytest.mark.parametrize("role", sorted(WORKLOADS))
def test_every_workload_restarts_its_container_and_probes_it(role: str):
    """Kubernetes restarts an exited container (restartPolicy Always, the only one a DaemonSet or
    Deployment allows) and a hung one (liveness), and routes only to a ready one (readiness)."""
    assert pod(role).get("restartPolicy", "Always") == "Always"
    c = container(role)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probe in c, (role, probe)
    assert c["livenessProbe"]["failureThreshold"] >= 2, "one slow answer must not restart it"


def test_gateway_probes_are_http_on_its_port():
    c = container("gateway")
    port = int(flag(c["args"], "port"))
    assert flag(c["args"], "host") == "0.0.0.0"
    paths = {}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert named_port(c, c[probe]["httpGet"]["port"]) == port, probe
        paths[probe] = c[probe]["httpGet"]["path"]
    # /health turns 503 when no replica serves: readiness only, or a cluster-wide outage of
    # compute would restart every gateway too.
    assert paths["readinessProbe"] == "/health"
    assert paths["livenessProbe"] != "/health"
    from kvtier.gateway.app import ENDPOINTS

    assert set(paths.values()) <= ENDPOINTS


# ---------------------------------------------------------------- host namespaces and placement


def test_host_ipc_and_pid_only_on_cache_and_compute():
    for role in WORKLOADS:
        spec = pod(role)
        shared = role in ("cache", "compute")
        assert spec.get("hostIPC", False) is shared, role
        assert spec.get("hostPID", False) is shared, role
        assert not spec.get("hostNetwork", False), role
        assert not spec.get("shareProcessNamespace", False), role
        for c in spec["containers"]:
            sc = c.get("securityContext", {})
            assert not sc.get("privileged", False), role
            assert sc["allowPrivilegeEscalation"] is False, role
            assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"], role
        assert spec["securityContext"]["runAsNonRoot"] is True, role
        assert spec["automountServiceAccountToken"] is False, role
    namespace = obj("Namespace", NAMESPACE)["metadata"]["labels"]
    assert namespace["pod-security.kubernetes.io/enforce"] == "privileged"  # host namespaces need it


def test_cache_and_compute_run_as_one_user():
    """The cpu-shm pool is a 0600 segment: only its owner's uid maps it."""
    uids = {
        (pod(role)["securityContext"]["runAsUser"], pod(role)["securityContext"]["runAsGroup"])
        for role in ("cache", "compute")
    }
    assert len(uids) == 1, uids
    assert pod("gateway")["securityContext"]["runAsUser"] not in {u for u, _ in uids}


def test_the_readme_says_what_host_namespaces_open():
    readme = (ROOT / "deploy/README.md").read_text()
    for words in ("hostIPC", "hostPID", "cudaIpcOpenMemHandle", "/dev/shm"):
        assert words in readme, words


def test_cache_is_a_daemonset_on_gpu_nodes():
    assert WORKLOADS["cache"][0] == "DaemonSet"
    spec = pod("cache")
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert flag(container("cache")["args"], "backend") == "cuda"


def test_compute_is_placed_beside_a_cache_pod():
    spec = pod("compute")
    (term,) = spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert roles_selected_by(term["labelSelector"]["matchLabels"]) == ["cache"]
    # It must be allowed onto the same (tainted, labelled) nodes the cache is on.
    assert spec["nodeSelector"] == pod("cache")["nodeSelector"]
    assert spec["tolerations"] == pod("cache")["tolerations"]
    assert flag(container("compute")["args"], "device") == "cuda"


def test_compute_dials_the_cache_on_its_own_node():
    cache_address = flag(container("compute")["args"], "cache")
    assert urlparse(cache_address).scheme == "tcp"
    name, namespace, port = cluster_dns(cache_address)
    assert namespace == NAMESPACE
    service = obj("Service", name)
    # Local: only the endpoint on the caller's node, never another node's cache (whose pool
    # this replica could not map).
    assert service["spec"]["internalTrafficPolicy"] == "Local"
    assert roles_selected_by(service["spec"]["selector"]) == ["cache"]
    (service_port,) = [p for p in service["spec"]["ports"] if p["port"] == port]
    assert named_port(container("cache"), service_port["targetPort"]) == port_of(
        flag(container("cache")["args"], "listen")
    )


def test_compute_scales_on_its_own_and_rolls_without_dropping_capacity():
    deployment = obj(*WORKLOADS["compute"])
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert obj(*WORKLOADS["cache"])["kind"] != deployment["kind"]  # a compute rollout keeps the caches


# ---------------------------------------------------------------- services, router, secrets


@pytest.mark.parametrize(
    "service", [d for _, d in DOCS if d["kind"] == "Service"], ids=lambda d: d["metadata"]["name"]
)
def test_every_service_selects_one_workload_and_targets_a_named_port(service: dict):
    (role,) = roles_selected_by(service["spec"]["selector"])
    c = container(role)
    names = {p["name"] for p in c["ports"]}
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in names, (service["metadata"]["name"], port)


@pytest.mark.parametrize(("index", "role"), [(0, "cache"), (1, "compute")])
def test_gateway_discovers_nodes_through_headless_services(index: int, role: str):
    """`--nodes-dns CACHE_HOST:PORT,COMPUTE_HOST:PORT`: one headless Service per role."""
    args = container("gateway")["args"]
    assert flag(args, "routing") == "kv-aware"
    services = flag(args, "nodes-dns").split(",")
    assert len(services) == 2
    name, namespace, port = cluster_dns(services[index])
    assert namespace == NAMESPACE
    service = obj("Service", name)
    assert service["spec"]["clusterIP"] == "None", f"{name}: DNS must answer with each pod, not a VIP"
    assert roles_selected_by(service["spec"]["selector"]) == [role]
    assert port_of(flag(container(role)["args"], "listen")) == port
    assert any(p["port"] == port for p in service["spec"]["ports"])


def test_compute_names_itself_by_its_generate_address():
    """The cache service's GetStats lists each lease's client name: the router joins replicas
    to nodes by it."""
    c = container("compute")
    listen = port_of(flag(c["args"], "listen"))
    assert flag(c["args"], "name") == f"$(POD_IP):{listen}"
    assert env_of(c)["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_gateway_and_service_commands_parse_with_their_flag_parsers():
    unknown = unparsed_gateway_flags(container("gateway")["args"])
    assert not unknown, f"not flags of python -m kvtier.gateway: {unknown}"
    from kvtier.cachesvc.config import build_parser as cache_parser
    from kvtier.computesvc.config import build_parser as compute_parser

    for role, parser in (("cache", cache_parser()), ("compute", compute_parser())):
        parser.exit_on_error = False
        args = container(role)["args"]
        assert args[0] == {"cache": "kvtier.cachesvc", "compute": "kvtier.computesvc"}[role]
        _, left = parser.parse_known_args(args[1:])
        assert left == [], f"{role}: {left}"


def test_no_token_or_key_in_any_manifest():
    for path in sorted(K8S.glob("*.yaml")):
        text = path.read_text()
        # No long run of letters and digits (a token, a key, a Secret's data), comments included.
        for run in re.findall(r"[A-Za-z0-9+/=_-]{24,}", text):
            assert not (re.search(r"\d", run) and re.search(r"[A-Za-z]", run)), (path.name, run)
        assert not re.search(r"\bsk-[A-Za-z0-9]", text), path.name
    for _, doc in DOCS:
        assert doc["kind"] != "Secret", "Secrets are created by the documented commands, never applied"
    for role in WORKLOADS:
        c = container(role)
        env = env_of(c)
        assert env["KVTIER_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "kvtier-token", "key": "token"}}
        for var in ("KVTIER_API_KEY", "KVTIER_TOKEN_FILE"):
            assert var not in env, (role, var)
        for name, e in env.items():
            if re.search("TOKEN|KEY|SECRET|PASSWORD", name):
                assert "value" not in e, (role, name)
        assert not any(a.startswith(("--api-key=", "--api-key ")) or a == "--api-key" for a in c["args"])


def test_secrets_are_the_documented_ones_and_mounted_where_the_flags_read():
    readme = (ROOT / "deploy/README.md").read_text()
    assert re.search(
        r"kubectl -n kvtier create secret generic kvtier-token --from-literal=token=\"?\$\(openssl rand -hex 32\)",
        readme,
    )
    assert "kubectl -n kvtier create secret generic kvtier-api-keys --from-file=api-keys.json=" in readme
    for role in WORKLOADS:
        spec, c = pod(role), container(role)
        volumes = {v["name"]: v for v in spec["volumes"]}
        for mount in c["volumeMounts"]:
            assert mount["name"] in volumes, (role, mount)
        for name, volume in volumes.items():
            if "secret" in volume:
                assert volume["secret"]["secretName"] in SECRETS, (role, name)
            if "persistentVolumeClaim" in volume:
                obj("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert SECRETS[ref["name"]] == ref["key"], (role, e)
        if role != "cache":  # client API keys: the gateway checks them, Generate charges them
            path = flag(c["args"], "api-keys")
            (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
            assert volumes[mount["name"]]["secret"]["secretName"] == "kvtier-api-keys"
            assert path == f"{mount['mountPath']}/{SECRETS['kvtier-api-keys']}"
            assert mount["readOnly"] is True


# ---------------------------------------------------------------- disruption, scaling, metrics


@pytest.mark.parametrize("role", WORKLOADS)
def test_each_workload_has_one_disruption_budget_that_lets_a_drain_proceed(role: str):
    budgets = [
        d
        for _, d in DOCS
        if d["kind"] == "PodDisruptionBudget"
        and selects(d["spec"]["selector"]["matchLabels"], pod_labels(role))
    ]
    assert len(budgets) == 1, (role, [ident(b) for b in budgets])
    (budget,) = budgets
    assert (
        budget["spec"]["selector"]["matchLabels"] == obj(*WORKLOADS[role])["spec"]["selector"]["matchLabels"]
    )
    if "minAvailable" in budget["spec"]:
        assert replicas_of(role) > budget["spec"]["minAvailable"], role
    else:
        assert budget["spec"]["maxUnavailable"] >= 1, role


def autoscaler_of(role: str) -> dict | None:
    kind, name = WORKLOADS[role]
    found = [
        d
        for _, d in DOCS
        if d["kind"] == "HorizontalPodAutoscaler"
        and (d["spec"]["scaleTargetRef"]["kind"], d["spec"]["scaleTargetRef"]["name"]) == (kind, name)
    ]
    assert len(found) <= 1, role
    return found[0] if found else None


def replicas_of(role: str) -> int:
    """The fewest pods a Deployment runs: its HPA's minReplicas, else its replicas."""
    hpa = autoscaler_of(role)
    if hpa is not None:
        assert "replicas" not in obj(*WORKLOADS[role])["spec"], f"{role}: the HPA owns the count"
        return hpa["spec"]["minReplicas"]
    return obj(*WORKLOADS[role])["spec"]["replicas"]


def test_hpa_scales_compute_on_a_metric_the_replicas_export():
    hpa = autoscaler_of("compute")
    assert [d for _, d in DOCS if d["kind"] == "HorizontalPodAutoscaler"] == [hpa]
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == WORKLOADS["compute"]
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    from prometheus_client import CollectorRegistry

    from kvtier.computesvc.metrics import ComputeMetrics

    exported = {m.name for m in ComputeMetrics(CollectorRegistry()).registry.collect()}
    assert name in exported, f"{name} is not a compute replica metric ({sorted(exported)})"
    assert name in (ROOT / "deploy/README.md").read_text(), "the adapter rule for it is documented"
    assert hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"] >= 2


def test_podmonitor_validates_against_the_operators_crd_models():
    from cloudcoil.models.prometheus_operator.v1 import PodMonitor

    doc = obj("PodMonitor", "kvtier")
    model = PodMonitor.model_validate(doc)  # types, required fields, patterns (durations, ...)
    # The models accept unknown fields and drop them: a misspelled one shows as a difference.
    assert model.model_dump(by_alias=True, exclude_none=True) == doc
    misspelled = yaml.safe_load(yaml.safe_dump(doc))
    misspelled["spec"]["podMetricsEndpoints"][0]["intervall"] = "10s"
    assert PodMonitor.model_validate(misspelled).model_dump(by_alias=True, exclude_none=True) != misspelled


def test_podmonitor_scrapes_every_workload():
    monitor = obj("PodMonitor", "kvtier")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    assert {frozenset(e) <= {"port", "path", "interval", "scheme"} for e in endpoints} == {True}
    selector = monitor["spec"]["selector"]["matchLabels"]
    for role in WORKLOADS:
        assert selects(selector, pod_labels(role)), role
        c = container(role)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        scraped = [e for e in endpoints if e["port"] in ports]
        assert scraped, f"{role}: no endpoint names a port of it"
        for endpoint in scraped:
            assert endpoint["path"] == "/metrics"
            number = ports[endpoint["port"]]
            if role == "gateway":
                assert number == int(flag(c["args"], "port"))
            else:
                assert number == int(flag(c["args"], "metrics-port"))


# ---------------------------------------------------------------- the shared tier (Mooncake Store)


def gflag(args: list[str], name: str) -> str:
    """A mooncake binary's `--name=value` or `--name value` (gflags takes both)."""
    for i, arg in enumerate(args):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}":
            return args[i + 1]
    raise AssertionError(f"--{name} not in {args}")


def test_every_cache_points_at_the_mooncake_master_service():
    """The caches' --shared-tier and the store servers name the master's Service, on the ports its
    container serves the RPC and the built-in metadata server on; the Service stays in the cluster."""
    master = container("mooncake-master")
    service = obj("Service", "kvtier-mooncake-master")
    assert service["spec"]["type"] == "ClusterIP"
    assert roles_selected_by(service["spec"]["selector"]) == ["mooncake-master"]
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert int(gflag(master["args"], "rpc_port")) == named_port(master, "rpc") == ports["rpc"]
    assert gflag(master["args"], "enable_http_metadata_server") == "true"
    assert int(gflag(master["args"], "http_metadata_server_port")) == named_port(master, "metadata")
    rpc = f"kvtier-mooncake-master.{NAMESPACE}.svc.cluster.local:{ports['rpc']}"
    metadata = f"http://kvtier-mooncake-master.{NAMESPACE}.svc.cluster.local:{ports['metadata']}/metadata"
    cache = container("cache")["args"]
    assert flag(cache, "shared-tier") == f"mooncake://{rpc}"
    assert flag(cache, "shared-tier-metadata") == metadata
    assert cluster_dns(rpc)[0] == service["metadata"]["name"]
    store = container("mooncake-store")["args"]
    assert gflag(store, "master_server_address") == rpc and gflag(store, "metadata_server") == metadata
    assert gflag(store, "host") == "$(POD_IP)"
    assert env_of(container("mooncake-store"))["POD_IP"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "status.podIP"}
    }


def test_one_master_and_store_servers_whose_memory_holds_their_segment():
    master = obj(*STORE_WORKLOADS["mooncake-master"])
    assert master["spec"]["replicas"] == 1 and master["spec"]["strategy"]["type"] == "Recreate"
    store = container("mooncake-store")
    segment = quantity(gflag(store["args"], "global_segment_size").replace("GB", "Gi"))
    assert quantity(store["resources"]["requests"]["memory"]) > segment
    assert obj(*STORE_WORKLOADS["mooncake-store"])["spec"]["replicas"] >= 2


def test_the_master_runs_strict_multi_tenant_mode_on_a_policy_written_from_the_api_keys_secret(tmp_path):
    """Its init container writes Mooncake's tenant policy from the kvtier-api-keys Secret (the
    command run here on a sample file) where the master reads it; the store it shares out is what
    the store servers lend in all."""
    from kvtier.cli.store_master import build_parser, main

    spec, master = pod("mooncake-master"), container("mooncake-master")
    (init,) = spec["initContainers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in init["volumeMounts"]}
    assert init["command"] == ["/opt/kvtier/.venv/bin/python", "-m", "kvtier.cli.store_master"]
    args = build_parser().parse_args(init["args"])
    keys = mounts[str(Path(args.api_keys).parent)]
    assert volumes[keys["name"]]["secret"]["secretName"] == "kvtier-api-keys" and keys["readOnly"] is True
    assert Path(args.api_keys).name == SECRETS["kvtier-api-keys"]
    policy_dir = mounts[str(Path(args.policy).parent)]
    assert "emptyDir" in volumes[policy_dir["name"]]
    assert {(m["name"], m["mountPath"], m["readOnly"]) for m in master["volumeMounts"]} == {
        (policy_dir["name"], policy_dir["mountPath"], True)
    }
    assert gflag(master["args"], "enable_multi_tenants") == "true"
    assert gflag(master["args"], "tenant_quota_connector_type") == "file"
    assert gflag(master["args"], "tenant_quota_connector_uri") == args.policy
    segment = quantity(gflag(container("mooncake-store")["args"], "global_segment_size").replace("GB", "Gi"))
    assert args.store_gib * 2**30 == obj(*STORE_WORKLOADS["mooncake-store"])["spec"]["replicas"] * segment
    for c in (init, master):
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]} and c["resources"]["limits"]
    sample = tmp_path / "api-keys.json"
    tenants = {
        "acme": {"keys": ["sk-acme-0123456789abcdef"], "shared_gib": 4},
        "globex": {"keys": ["sk-globex-0123456789"]},
    }
    sample.write_text(json.dumps({"tenants": tenants}))
    main([f"--api-keys={sample}", f"--store-gib={args.store_gib}", f"--policy={tmp_path / 'tenants.yaml'}"])
    share = int(args.store_gib - 4) * 2**30 // 2
    assert yaml.safe_load((tmp_path / "tenants.yaml").read_text()) == {
        "version": 1,
        "tenants": [
            {"name": "kvtier.acme", "quota": 4 * 2**30},
            {"name": "kvtier-default", "quota": share},
            {"name": "kvtier.globex", "quota": share},
        ],
    }
    assert (tmp_path / "tenants.yaml").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("role", STORE_WORKLOADS)
def test_store_workloads_are_tagged_limited_probed_budgeted_and_never_root(role: str):
    c = container(role)
    assert c["image"].startswith("kvtier:") and c["image"] != "kvtier:latest"
    assert (
        c["command"][0]
        == f"/opt/kvtier/.venv/bin/{'mooncake_master' if role == 'mooncake-master' else 'mooncake_client'}"
    )
    for resource in ("cpu", "memory"):
        assert quantity(c["resources"]["requests"][resource]) <= quantity(c["resources"]["limits"][resource])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert named_port(c, c[probe]["tcpSocket"]["port"]) in {p["containerPort"] for p in c["ports"]}
    assert pod(role)["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    budgets = [
        d for _, d in DOCS
        if d["kind"] == "PodDisruptionBudget" and selects(d["spec"]["selector"]["matchLabels"], pod_labels(role))
    ]  # fmt: skip
    assert len(budgets) == 1 and budgets[0]["spec"]["maxUnavailable"] >= 1, role
