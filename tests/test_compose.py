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
TOKEN = "test-token-0123456789abcdef"
# Per profile, its two nodes: (cache service, its replicas' services); one gateway per profile
# routes across both.
NODES = {
    "cpu": (("cache-0", ("compute-0-0", "compute-0-1")), ("cache-1", ("compute-1-0", "compute-1-1"))),
    "gpu": (
        ("cache-gpu-0", ("compute-gpu-0-0", "compute-gpu-0-1")),
        ("cache-gpu-1", ("compute-gpu-1-0", "compute-gpu-1-1")),
    ),
}
GATEWAYS = {"cpu": "gateway", "gpu": "gateway-gpu"}
CACHE_SERVICES = tuple(cache for nodes in NODES.values() for cache, _ in nodes)
PAIRS = [(cache, compute) for nodes in NODES.values() for cache, computes in nodes for compute in computes]
COMPUTE_SERVICES = tuple(compute for _, compute in PAIRS)

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
            raise KeyError(f"compose variable {name} is unset and has no default: {arg}")
        return value

    # compose refuses a `$` that starts none of the forms above ("invalid interpolation format");
    # it reads values, not comments.
    for line in text.splitlines():
        if not line.lstrip().startswith("#"):
            assert not re.search(r"\$(?![${A-Za-z_])", _VARIABLE.sub("", line)), f"a lone $ in {line!r}"
    return _VARIABLE.sub(substitute, text)


def load_compose(env: dict[str, str] | None = None) -> dict:
    """docker-compose.yml as compose sees it: interpolated, merged, validated by compose-spec."""
    env = {"KVTIER_TOKEN": TOKEN} if env is None else env
    data = yaml.safe_load(interpolate((ROOT / "docker-compose.yml").read_text(), env))
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


def flag_values(command: list[str], name: str) -> list[str]:
    """The values of a repeated `--name=value` in a command list, in order."""
    return [arg.split("=", 1)[1] for arg in command if arg.startswith(f"--{name}=")]


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def node_specs(command: list[str]) -> list[tuple[str, str, list[str]]]:
    """Each `--node=NAME@CACHE=REPLICA[,REPLICA...]` -> (name, cache address, replica addresses)."""
    specs = []
    for spec in flag_values(command, "node"):
        name, at, rest = spec.partition("@")
        cache, sep, replicas = rest.partition("=")
        assert at and sep and name and cache and replicas, f"not NAME@CACHE=REPLICA,...: {spec}"
        specs.append((name, cache, replicas.split(",")))
    return specs


def test_validator_rejects_an_unknown_service_key():
    bad = {"services": {"cache": {"image": "kvtier:cpu", "ipc_mode": "shareable"}}}
    with pytest.raises(ValueError, match="ipc_mode"):
        PyCompose.from_json(json.dumps(bad))


def test_compose_file_is_valid_with_overrides():
    overridden = load_compose(
        {
            "KVTIER_TOKEN": "s3cret",
            "KVTIER_SHM_SIZE": "8gb",
            "KVTIER_GPU_0": "3",
            "KVTIER_GPU_1": "5",
            "KVTIER_ROUTING": "round-robin",
        }
    )["services"]
    assert overridden["cache-1"]["environment"]["KVTIER_TOKEN"] == "s3cret"
    assert overridden["cache-0"]["shm_size"] == overridden["cache-1"]["shm_size"] == "8gb"
    for (cache, computes), gpu in zip(NODES["gpu"], ("3", "5"), strict=True):
        for service in (cache, *computes):
            (device,) = overridden[service]["deploy"]["resources"]["reservations"]["devices"]
            assert device["device_ids"] == [gpu], service
    assert flag(overridden["gateway"]["command"], "routing") == "round-robin"


def test_there_is_no_default_token(services):
    """No token is written in the file: compose refuses to start without KVTIER_TOKEN."""
    text = (ROOT / "docker-compose.yml").read_text()
    assert re.search(r"\$\{KVTIER_TOKEN:\?[^}]+\}", text), (
        "KVTIER_TOKEN must be required (${KVTIER_TOKEN:?...})"
    )
    with pytest.raises(KeyError, match="KVTIER_TOKEN"):
        load_compose({})
    with pytest.raises(KeyError, match="KVTIER_TOKEN"):
        load_compose({"KVTIER_TOKEN": ""})
    for name in CACHE_SERVICES + COMPUTE_SERVICES + tuple(GATEWAYS.values()):
        assert services[name]["environment"]["KVTIER_TOKEN"] == TOKEN, name


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
    for name in GATEWAYS.values():
        assert services[name]["environment"]["OTEL_SERVICE_NAME"] == "kvtier-gateway"


@pytest.mark.parametrize(("cache", "compute"), PAIRS)
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


@pytest.mark.parametrize("profile", NODES)
def test_two_nodes_two_pools_with_their_own_replicas(services, profile: str):
    """Each node's cache has its own IPC namespace (its own /dev/shm: a separate pool) and its
    own replicas; no replica joins the other node's namespace, and the GPU nodes hold apart GPUs."""
    (cache_a, computes_a), (cache_b, computes_b) = NODES[profile]
    assert cache_a != cache_b and not set(computes_a) & set(computes_b)
    for cache, computes in NODES[profile]:
        assert services[cache]["ipc"] == "shareable"  # its own namespace, not another service's
        assert len(computes) == 2, "two replicas per node"
        for compute in computes:
            assert services[compute]["ipc"] == services[compute]["pid"] == f"service:{cache}"
    # Every compute service belongs to exactly one node.
    compute_services = {n for n in services if n.startswith("compute")}
    assert compute_services == set(COMPUTE_SERVICES)
    if profile == "gpu":
        devices = [
            services[name]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
            for name in (cache_a, cache_b)
        ]
        assert devices[0] != devices[1], f"both nodes reserve GPU {devices[0]}"
        for cache, computes in NODES[profile]:
            for compute in computes:
                assert services[cache]["deploy"]["resources"] == services[compute]["deploy"]["resources"]


@pytest.mark.parametrize("profile", NODES)
def test_one_gateway_routes_across_both_nodes(services, profile: str):
    gateway = services[GATEWAYS[profile]]
    command = gateway["command"]
    assert command[0] == "kvtier.gateway"
    assert flag(command, "routing") == "kv-aware"
    assert flag(command, "host") == "0.0.0.0"
    listen = int(flag(command, "port"))
    assert str(listen) in gateway["expose"]
    (published,) = gateway["ports"]
    assert published.endswith(f":{listen}")
    specs = node_specs(command)
    assert len(specs) == len(NODES[profile]) == 2
    assert len({name for name, _, _ in specs}) == 2, "node names repeat"
    for (_, cache_address, replicas), (cache, computes) in zip(specs, NODES[profile], strict=True):
        target = urlparse(cache_address)
        assert (target.scheme, target.hostname) == ("tcp", cache)
        assert target.port == port_of(flag(services[cache]["command"], "listen"))
        assert len(replicas) == len(computes)
        for replica, compute in zip(replicas, computes, strict=True):
            target = urlparse(replica)
            assert (target.scheme, target.hostname) == ("tcp", compute)
            assert target.port == port_of(flag(services[compute]["command"], "listen"))
            assert flag(services[compute]["command"], "cache") == cache_address
            assert gateway["depends_on"][compute]["condition"] == "service_started"


def test_gateways_publish_apart_host_ports(services):
    published = [services[g]["ports"][0].split(":")[0] for g in GATEWAYS.values()]
    assert len(set(published)) == len(published), published
    assert services["gateway-gpu"]["profiles"] == ["gpu"] and "profiles" not in services["gateway"]


def test_gateway_holds_no_gpu_and_shares_no_namespace(services):
    for name in GATEWAYS.values():
        svc = services[name]
        assert svc["image"] == "kvtier:cpu"
        assert not {"ipc", "pid", "deploy", "shm_size"} & svc.keys(), name


@pytest.mark.parametrize("compute", COMPUTE_SERVICES)
def test_compute_can_scale_no_container_name_no_fixed_host_port(services, compute: str):
    c = services[compute]
    assert "container_name" not in c
    for port in c.get("ports", []):
        spec = str(port["published"] if isinstance(port, dict) and "published" in port else port)
        assert ":" not in spec and "published" not in str(port), (
            f"{compute} publishes a fixed host port: {port}"
        )


@pytest.mark.parametrize("cache", ["cache-0", "cache-1"])
def test_cpu_pool_fits_in_the_shared_memory_of_the_cache(services, cache: str):
    gib = float(flag(services[cache]["command"], "kv-cache-space"))
    shm = services[cache]["shm_size"]
    number, unit = re.fullmatch(r"(\d+)([kmg]?)b?", shm.lower()).groups()
    shm_bytes = int(number) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[unit]
    assert gib * (1 << 30) < shm_bytes


@pytest.mark.parametrize("name", CACHE_SERVICES + COMPUTE_SERVICES)
def test_healthcheck_probes_the_port_the_service_listens_on(services, name: str):
    svc = services[name]
    test = svc["healthcheck"]["test"]
    assert test[:4] == ["CMD", "python", "-m", "kvtier.healthcheck"]
    assert port_of(test[4]) == port_of(flag(svc["command"], "listen"))


@pytest.mark.parametrize("name", CACHE_SERVICES + COMPUTE_SERVICES + tuple(GATEWAYS.values()))
def test_every_kvtier_service_is_restarted_when_it_exits_and_has_a_healthcheck(services, name: str):
    """A service that exits (a crash, an OOM kill) comes back by itself, as under `kvtier up`; a
    replica re-attaches to its cache by itself, so no dependent is restarted with it."""
    svc = services[name]
    assert svc["restart"] in ("unless-stopped", "always"), name
    assert svc["healthcheck"]["retries"] >= 1 and svc["healthcheck"]["start_period"], name


@pytest.mark.parametrize("name", GATEWAYS.values())
def test_gateway_healthcheck_gets_its_health_endpoint(services, name: str):
    test = services[name]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"]
    url = urlparse(re.search(r"'(http://[^']+)'", test[3]).group(1))
    assert url.path == "/health" and url.port == int(flag(services[name]["command"], "port"))


def test_gpu_profile_reserves_one_nvidia_device_and_cpu_default_none(services):
    for name in CACHE_SERVICES + COMPUTE_SERVICES:
        if "gpu" not in name:
            continue
        svc = services[name]
        assert svc["profiles"] == ["gpu"]
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        assert svc["image"] == "kvtier:gpu" and svc["build"]["args"]["PIP_EXTRA_INDEX_URL"] == ""
    for cache, _ in NODES["gpu"]:
        assert flag(services[cache]["command"], "backend") == "cuda"
    for cache, computes in NODES["cpu"]:
        for name in (cache, *computes):
            assert "profiles" not in services[name]
            assert "resources" not in services[name].get("deploy", {})
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
                command = services[name]["command"]
                port = flag(command, "port" if command[0] == "kvtier.gateway" else "metrics-port")
                assert int(port) == sd["port"], name
                discovered.add(name)
    assert discovered == set(CACHE_SERVICES + COMPUTE_SERVICES + tuple(GATEWAYS.values()))


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
    ("module", "names"), [("kvtier.cachesvc", CACHE_SERVICES), ("kvtier.computesvc", COMPUTE_SERVICES)]
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


# The router's flags on the gateway (issue 11), as deploy/README.md documents them. Until
# gateway/config.py has them (it knows --routing) they are the only leftovers its parser may return.
ROUTER_FLAGS = frozenset({"--routing", "--routing-load-weight", "--node", "--node-file", "--nodes-dns"})


def unparsed_gateway_flags(command: list[str]) -> set[str]:
    """Flags of a gateway command that gateway/config.py does not know (the router's are let
    through while it does not know --routing); a bad value of a known flag raises
    argparse.ArgumentError."""
    from kvtier.gateway.config import build_parser

    parser = build_parser()
    parser.exit_on_error = False
    assert command[0] == "kvtier.gateway"
    _, unknown = parser.parse_known_args(command[1:])
    unknown_flags = {arg.split("=", 1)[0] for arg in unknown if arg.startswith("-")}
    if any("--routing" in action.option_strings for action in parser._actions):
        return unknown_flags  # the router is in: every flag must be known
    return unknown_flags - ROUTER_FLAGS


def test_router_flags_are_the_documented_ones():
    readme = (ROOT / "deploy/README.md").read_text()
    for name in ROUTER_FLAGS:
        assert f"`{name}" in readme, f"{name} is not documented in deploy/README.md"


@pytest.mark.parametrize("name", GATEWAYS.values())
def test_gateway_command_parses_with_the_gateway_flag_parser(services, name: str):
    unknown = unparsed_gateway_flags(services[name]["command"])
    assert not unknown, f"{name}: not flags of python -m kvtier.gateway: {unknown}"


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


def test_every_cache_points_at_the_mooncake_master_and_the_store_server_lends_it_memory(services):
    """The shared tier (issue 34): every node's cache service names the master's RPC port and its
    built-in metadata server; the store server registers with the same two; no store port is
    published outside the compose network (none of them authenticates)."""
    master, store = services["mooncake-master"]["command"], services["mooncake-store"]["command"]
    rpc = f"mooncake-master:{flag(master, 'rpc_port')}"
    metadata = f"http://mooncake-master:{flag(master, 'http_metadata_server_port')}/metadata"
    assert flag(master, "enable_http_metadata_server") == "true"
    assert services["mooncake-master"]["entrypoint"][0].endswith("/.venv/bin/mooncake_master")
    assert services["mooncake-store"]["entrypoint"][0].endswith("/.venv/bin/mooncake_client")
    assert flag(store, "master_server_address") == rpc and flag(store, "metadata_server") == metadata
    assert re.fullmatch(r"\d+GB", flag(store, "global_segment_size"))
    for cache in CACHE_SERVICES:
        command = services[cache]["command"]
        assert flag(command, "shared-tier") == f"mooncake://{rpc}", cache
        assert flag(command, "shared-tier-metadata") == metadata, cache
        # Not a dependency: the cache starts (and recomputes) while the store is not up yet.
        assert services[cache]["depends_on"]["mooncake-master"]["condition"] == "service_started", cache
    for name in ("mooncake-master", "mooncake-store"):
        assert "ports" not in services[name], name
        assert services[name]["restart"] == "unless-stopped" and services[name]["healthcheck"]["test"], name


def test_vllm_profile_runs_two_engines_on_one_cache_service_with_the_same_model(services):
    cache = services["cache-vllm"]
    cache_flags = dict(arg.split("=", 1) for arg in cache["command"][1:])
    port = cache_flags["--listen"].rsplit(":", 1)[1]
    host_ports = set()
    for name in ("vllm-a", "vllm-b"):
        engine = services[name]
        assert engine["profiles"] == ["vllm"] and cache["profiles"] == ["vllm"]
        assert engine["ipc"] == "service:cache-vllm", (
            "the pool's CUDA IPC handle opens only in its IPC namespace"
        )
        assert engine["environment"]["KVTIER_CACHE_ADDRESS"] == f"tcp://cache-vllm:{port}"
        assert engine["depends_on"]["cache-vllm"]["condition"] == "service_healthy"
        flags = dict(arg.split("=", 1) for arg in engine["command"])
        config = json.loads(flags["--kv-transfer-config"])
        module = ROOT / Path(*config["kv_connector_module_path"].split(".")).with_suffix(".py")
        assert f"class {config['kv_connector']}(" in module.read_text()
        assert config["kv_load_failure_policy"] == "recompute"
        # The pool is refused unless model and block size match (kvtier.vllm.engine_check).
        assert flags["--block-size"] == cache_flags["--block-size"]
        assert flags["--model"] == cache_flags["--model"]
        assert engine["volumes"] == cache["volumes"]
        host_ports.add(engine["ports"][0].split(":")[0])
    assert len(host_ports) == 2
