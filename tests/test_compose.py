"""The deployment files hold together: compose validates and is wired right, the image installs
the way the README does, the Kubernetes Pod shares what the pool needs, and the health probe works.

No Docker engine or cluster is needed: compose is checked with the `compose-spec` validator
after the interpolation and YAML merges Docker Compose itself does, and the wiring by reading it.
"""

from __future__ import annotations

import fnmatch
import importlib
import json
import os
import re
import subprocess
import sys
from concurrent import futures
from pathlib import Path
from urllib.parse import urlparse

import grpc
import pytest
import yaml
from compose_spec import PyCompose
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
CACHE_SERVICES = ("cache", "cache-gpu")
COMPUTE_SERVICES = ("compute", "compute-gpu")

# ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, $VAR and the $$ escape, as compose reads them.
_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_]\w*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|(?P<named>[A-Za-z_]\w*))"
)


def interpolate(text: str, env: dict[str, str]) -> str:
    def substitute(m: re.Match) -> str:
        if m["escaped"]:
            return "$"
        name, op, arg = m["braced"] or m["named"], m["op"], m["arg"]
        value = env.get(name)
        if op == ":-" and not value or op == "-" and value is None:
            return arg
        if value is None or (op == ":?" and not value):
            raise KeyError(f"compose variable {name} is unset and has no default")
        return value

    return _VARIABLE.sub(substitute, text)


def load_compose(env: dict[str, str] | None = None) -> dict:
    """docker-compose.yml as compose sees it: interpolated, merged, validated by compose-spec."""
    data = yaml.safe_load(interpolate((ROOT / "docker-compose.yml").read_text(), env or {}))
    PyCompose.from_json(json.dumps(data)).validate()  # raises ValueError on any bad key or value
    return data


@pytest.fixture(scope="module")
def services() -> dict[str, dict]:
    return load_compose()["services"]


def flag(command: list[str], name: str) -> str:
    """The value of `--name=value` in a command list."""
    values = [arg.split("=", 1)[1] for arg in command if arg.startswith(f"--{name}=")]
    assert len(values) == 1, f"--{name}= appears {len(values)} times in {command}"
    return values[0]


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def test_validator_rejects_an_unknown_service_key():
    bad = {"services": {"cache": {"image": "kvtier:cpu", "ipc_mode": "shareable"}}}
    with pytest.raises(ValueError, match="ipc_mode"):
        PyCompose.from_json(json.dumps(bad))


def test_compose_file_is_valid_with_defaults_and_with_overrides():
    load_compose()
    overridden = load_compose({"KVTIER_TOKEN": "s3cret", "KVTIER_SHM_SIZE": "8gb", "KVTIER_GPU": "3"})
    assert overridden["services"]["cache"]["environment"]["KVTIER_TOKEN"] == "s3cret"
    assert overridden["services"]["cache"]["shm_size"] == "8gb"
    assert overridden["services"]["compute-gpu"]["deploy"]["resources"]["reservations"]["devices"][0][
        "device_ids"
    ] == ["3"]


def test_token_defaults_from_env_and_is_shared_by_cache_and_compute(services):
    assert "${KVTIER_TOKEN:-change-me}" in (ROOT / "docker-compose.yml").read_text()
    for name in CACHE_SERVICES + COMPUTE_SERVICES:
        assert services[name]["environment"]["KVTIER_TOKEN"] == "change-me", name


def test_every_otlp_endpoint_is_a_defined_service_and_exposed_port(services):
    endpoints = [
        (name, svc["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"])
        for name, svc in services.items()
        if "OTEL_EXPORTER_OTLP_ENDPOINT" in svc.get("environment", {})
    ]
    assert {name for name, _ in endpoints} >= set(CACHE_SERVICES + COMPUTE_SERVICES)
    for name, endpoint in endpoints:
        url = urlparse(endpoint)
        assert url.hostname in services, f"{name}: {endpoint} names no service"
        exposed = {int(p) for p in services[url.hostname].get("expose", [])}
        assert url.port in exposed, f"{name}: {endpoint}: port not exposed by {url.hostname} ({exposed})"


def test_each_service_reports_its_own_service_name(services):
    for name in CACHE_SERVICES:
        assert services[name]["environment"]["OTEL_SERVICE_NAME"] == "kvtier-cache"
    for name in COMPUTE_SERVICES:
        assert services[name]["environment"]["OTEL_SERVICE_NAME"] == "kvtier-compute"


@pytest.mark.parametrize(("compute", "cache"), list(zip(COMPUTE_SERVICES, CACHE_SERVICES, strict=True)))
def test_compute_shares_ipc_and_pid_with_its_cache_and_dials_it(services, compute: str, cache: str):
    c = services[compute]
    assert c["ipc"] == f"service:{cache}"
    assert c["pid"] == f"service:{cache}"
    assert services[cache]["ipc"] == "shareable"
    assert c["depends_on"][cache]["condition"] == "service_healthy"
    target = urlparse(flag(c["command"], "cache"))
    assert (target.scheme, target.hostname) == ("tcp", cache)
    assert target.port == port_of(flag(services[cache]["command"], "listen"))
    assert str(target.port) in services[cache]["expose"]


@pytest.mark.parametrize("compute", COMPUTE_SERVICES)
def test_compute_can_scale_no_container_name_no_fixed_host_port(services, compute: str):
    c = services[compute]
    assert "container_name" not in c
    for port in c.get("ports", []):
        spec = str(port["published"] if isinstance(port, dict) and "published" in port else port)
        assert ":" not in spec and "published" not in str(port), (
            f"{compute} publishes a fixed host port: {port}"
        )


def test_cpu_pool_fits_in_the_shared_memory_of_the_cache(services):
    gib = float(flag(services["cache"]["command"], "kv-cache-space"))
    shm = services["cache"]["shm_size"]
    number, unit = re.fullmatch(r"(\d+)([kmg]?)b?", shm.lower()).groups()
    shm_bytes = int(number) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[unit]
    assert gib * (1 << 30) < shm_bytes


@pytest.mark.parametrize("name", CACHE_SERVICES + COMPUTE_SERVICES)
def test_healthcheck_probes_the_port_the_service_listens_on(services, name: str):
    svc = services[name]
    test = svc["healthcheck"]["test"]
    assert test[:4] == ["CMD", "python", "-m", "kvtier.healthcheck"]
    assert port_of(test[4]) == port_of(flag(svc["command"], "listen"))


def test_gpu_profile_reserves_one_nvidia_device_and_cpu_default_none(services):
    for name in ("cache-gpu", "compute-gpu"):
        svc = services[name]
        assert svc["profiles"] == ["gpu"]
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        assert svc["image"] == "kvtier:gpu" and svc["build"]["args"]["PIP_EXTRA_INDEX_URL"] == ""
    assert flag(services["cache-gpu"]["command"], "backend") == "cuda"
    for name in ("cache", "compute"):
        assert "profiles" not in services[name] and "deploy" not in services[name]
        assert services[name]["image"] == "kvtier:cpu"


def test_prometheus_targets_are_services_on_their_metrics_ports(services):
    config = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    mount = next(v for v in services["prometheus"]["volumes"] if v.startswith("./deploy/prometheus.yml:"))
    assert mount.split(":")[1] in services["prometheus"]["command"][0]
    discovered: set[str] = set()
    for job in config["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            for name in sd["names"]:
                assert name in services, f"{job['job_name']}: {name} is not a compose service"
                assert str(sd["port"]) in services[name]["expose"]
                assert int(flag(services[name]["command"], "metrics-port")) == sd["port"]
                discovered.add(name)
    assert discovered == set(CACHE_SERVICES + COMPUTE_SERVICES)


def commands_of(dockerfile: str, instruction: str) -> list[str]:
    """Arguments of every `instruction` line, continuation lines joined."""
    joined = re.sub(r"\\\n", " ", dockerfile)
    return [
        line.split(None, 1)[1] for line in joined.splitlines() if line.upper().startswith(instruction + " ")
    ]


def test_image_installs_with_the_readme_setup_command_and_runs_from_its_venv():
    dockerfile = (ROOT / "Dockerfile").read_text()
    runs = commands_of(dockerfile, "RUN")
    assert any(re.search(r"(^|\s)bash scripts/setup\.sh$", run.strip()) for run in runs), runs
    readme = ROOT / "README.md"
    assert readme.exists(), "README.md is missing: its first lines give the setup command"
    head = "\n".join(readme.read_text().splitlines()[:15])
    assert "bash scripts/setup.sh" in head, "README's first lines must run the same setup as the image"
    (entrypoint,) = commands_of(dockerfile, "ENTRYPOINT")
    assert json.loads(entrypoint)[0] == "/opt/kvtier/.venv/bin/python"
    assert "WORKDIR /opt/kvtier" in dockerfile


def test_dockerignore_keeps_what_setup_needs_and_drops_the_host_venv():
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip()[:1] not in ("", "#")
    ]

    def ignored(path: str) -> bool:
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        return any(
            fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(parts[-1], pat) for pat in patterns for p in prefixes
        )

    for needed in (
        "scripts/setup.sh",
        "pyproject.toml",
        "README.md",
        "proto/kvtier/v1/cache.proto",
        "kvtier/pool.py",
    ):
        assert not ignored(needed), needed
    for dropped in (".venv/bin/python", ".git/HEAD", "kvtier/__pycache__/x.pyc"):
        assert ignored(dropped), dropped


@pytest.mark.parametrize(
    ("module", "names"), [("cachesvc", CACHE_SERVICES), ("computesvc", COMPUTE_SERVICES)]
)
def test_compose_commands_parse_with_the_service_flag_parser(services, module: str, names: tuple[str, ...]):
    try:
        config = importlib.import_module(f"{module}.config")
    except ModuleNotFoundError:
        pytest.skip(f"{module}.config (build_parser) does not exist yet, so its flags cannot be checked")
    parser = config.build_parser()
    parser.exit_on_error = False
    for name in names:
        command = services[name]["command"]
        assert command[0] == module
        # A bad value raises argparse.ArgumentError; unknown flags come back as leftovers.
        _, unknown = parser.parse_known_args(command[1:])
        assert unknown == [], f"{name}: not flags of python -m {module}: {unknown}"


# ---------------------------------------------------------------- Kubernetes


@pytest.fixture(scope="module")
def k8s() -> dict[str, dict]:
    docs = [
        d
        for f in sorted((ROOT / "deploy/k8s").glob("*.yaml"))
        for d in yaml.safe_load_all(f.read_text())
        if d
    ]
    return {d["kind"]: d for d in docs}


def test_k8s_pod_shares_pid_shm_and_one_gpu_claim_across_containers(k8s):
    pod = k8s["StatefulSet"]["spec"]["template"]["spec"]
    assert pod["shareProcessNamespace"] is True
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"]["medium"] == "Memory"
    (claim,) = pod["resourceClaims"]
    assert claim["resourceClaimTemplateName"] == k8s["ResourceClaimTemplate"]["metadata"]["name"]
    names = [c["name"] for c in pod["containers"]]
    assert names[0] == "cache" and len(names) >= 2
    for c in pod["containers"]:
        assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"], c["name"]
        assert c["resources"]["claims"] == [{"name": claim["name"]}], c["name"]
        assert "grpc" in c["readinessProbe"], c["name"]


def test_k8s_ports_are_distinct_and_computes_dial_the_pod_local_cache(k8s):
    pod = k8s["StatefulSet"]["spec"]["template"]["spec"]
    ports = [p["containerPort"] for c in pod["containers"] for p in c["ports"]]
    assert len(ports) == len(set(ports)), ports
    cache, *computes = pod["containers"]
    cache_port = port_of(flag(cache["args"], "listen"))
    for c in computes:
        assert c["args"][0] == "computesvc"
        assert flag(c["args"], "cache") == f"tcp://localhost:{cache_port}"
        listen = port_of(flag(c["args"], "listen"))
        assert c["readinessProbe"]["grpc"]["port"] == listen
        assert {p["containerPort"] for p in c["ports"]} == {listen, int(flag(c["args"], "metrics-port"))}
    port_names = {p["name"] for c in pod["containers"] for p in c["ports"]}
    for endpoint in k8s["PodMonitor"]["spec"]["podMetricsEndpoints"]:
        assert endpoint["port"] in port_names
    service_ports = {p["port"] for p in k8s["Service"]["spec"]["ports"]}
    assert service_ports == {port_of(flag(c["args"], "listen")) for c in pod["containers"]}


# ---------------------------------------------------------------- the health probe the files use


@pytest.fixture
def health_server():
    """A sync gRPC server: "" SERVING, "draining" NOT_SERVING; yields its address."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("draining", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"tcp://127.0.0.1:{port}"
    server.stop(grace=None)


def probe(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "kvtier.healthcheck", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )


def test_healthcheck_exits_zero_only_when_serving(health_server):
    serving = probe(health_server)
    assert serving.returncode == 0 and "SERVING" in serving.stdout
    draining = probe(health_server, "--service", "draining")
    assert draining.returncode == 1 and "NOT_SERVING" in draining.stdout
    unknown = probe(health_server, "--service", "nope")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr


def test_healthcheck_fails_fast_when_nothing_listens(tmp_path: Path):
    down = probe(f"unix://{tmp_path}/absent.sock", "--timeout", "1")
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr
