"""Mooncake Store beside a local stack: its master and one store server holding the memory.

`kvtier up --nodes N --shared-tier`, the shared tier's tests and bench/shared_tier.py start the
store with ``StoreMaster``: ``mooncake_master`` (metadata, leases, eviction; its built-in HTTP
metadata server stands in for etcd) and ``mooncake_client``, Mooncake's standalone store server,
which lends the store ``store_gib`` of memory. The nodes lend none by default
(``--shared-tier-segment-gib 0``), so a node that dies takes no object with it. Both binaries
come from the ``mooncake-transfer-engine-non-cuda`` wheel (``kvtier[mooncake]``). Everything
listens on ``host`` (127.0.0.1 here: the store's RPC, metadata server and transfer engine have no
authentication; on a cluster keep them on a private network).

With ``api_keys`` (the stack's api-keys file) the master runs Mooncake's strict multi-tenant
mode: ``tenant_policy`` writes its policy (``mooncake-tenants.yaml`` in ``run_dir``, mode 0600),
one tenant per api-keys tenant plus the default tenant (``kvtier.api_keys.store_tenant``'s
names), each tenant's quota its ``shared_gib``, the rest of the store split evenly among those
without one. A tenant's objects then count against its quota (a put over it first evicts the
tenant's own objects, and is refused while they are all in use) and live in its own namespace.
Without ``api_keys``: one tenant, as Mooncake runs by default. ``python -m kvtier.cli.store_master
--api-keys FILE --store-gib GIB --policy PATH`` writes the same policy for a master started
elsewhere (deploy/k8s/25-mooncake.yaml's init container, from the api-keys Secret).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.api_keys import ApiKeys, ApiKeysError, store_tenant
from kvtier.cli.stack import Process

POLICY_FILE = "mooncake-tenants.yaml"
MIN_QUOTA_BYTES = 1 << 20  # a tenant's quota when the explicit ones leave nothing to share


def binary(name: str) -> str:
    """The path of Mooncake's ``name`` (mooncake_master, mooncake_client): the wheel's copy, else
    one on PATH; FileNotFoundError saying how to install it otherwise."""
    spec = importlib.util.find_spec("mooncake")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / name
        if path.is_file():
            return str(path)
    found = shutil.which(name)
    if found:
        return found
    raise FileNotFoundError(
        f"{name} not found: install kvtier[mooncake] (the mooncake-transfer-engine-non-cuda wheel; "
        "scripts/setup.sh does) and the Debian packages libibverbs1 librdmacm1"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def tenant_policy(keys: ApiKeys, store_bytes: int) -> str:
    """Mooncake's tenant policy (YAML, schema 1) for the tenants of ``keys`` and the default tenant
    in a store of ``store_bytes``: a tenant's ``shared_gib``, else an even share of the rest."""
    explicit = {
        store_tenant(t.name): int(t.shared_gib * 2**30) for t in keys.tenants.values() if t.shared_gib
    }
    others = [store_tenant(name) for name in ("", *keys.tenants) if store_tenant(name) not in explicit]
    share = max(MIN_QUOTA_BYTES, (store_bytes - sum(explicit.values())) // max(1, len(others)))
    quotas = {**explicit, **dict.fromkeys(others, share)}
    lines = ["version: 1", "tenants:"]
    for name, quota in quotas.items():  # names are [A-Za-z0-9._-]: plain YAML scalars
        lines += [f"  - name: {name}", f"    quota: {quota}"]
    return "\n".join(lines) + "\n"


def write_policy(path: str | Path, api_keys: str | Path, store_gib: float) -> None:
    """``tenant_policy`` of the api-keys file ``api_keys`` for a store of ``store_gib``, to ``path`` (0600)."""
    text = tenant_policy(ApiKeys.load(api_keys), int(store_gib * 2**30))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an older file kept its mode through O_CREAT
    with os.fdopen(fd, "w") as f:
        f.write(text)


@dataclass
class StoreMaster:
    """A mooncake_master and a store server of ``store_gib`` GiB, logs in ``run_dir``; with
    ``api_keys`` (a path) in strict multi-tenant mode (module docstring)."""

    run_dir: Path
    store_gib: float = 1.0
    host: str = "127.0.0.1"
    rpc_port: int = 0  # 0: a free port, chosen once (a restart keeps it: the nodes' URL stays right)
    metadata_port: int = 0
    env: dict[str, str] | None = None
    api_keys: str | None = None
    master: Process | None = None
    store: Process | None = None
    _ports: dict[str, int] = field(default_factory=dict)

    @property
    def url(self) -> str:
        """What the nodes' ``--shared-tier`` takes."""
        return f"mooncake://{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        """What the nodes' ``--shared-tier-metadata`` takes."""
        return f"http://{self.host}:{self.metadata_port}/metadata"

    def node_flags(self) -> list[str]:
        return ["--shared-tier", self.url, "--shared-tier-metadata", self.metadata_url]

    def up(self, deadline_s: float = 60.0) -> StoreMaster:
        self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.rpc_port = self.rpc_port or free_port(self.host)
        self.metadata_port = self.metadata_port or free_port(self.host)
        self._ports = {"metrics": free_port(self.host), "store": free_port(self.host)}
        self.start_master(deadline_s)
        command = [
            binary("mooncake_client"),
            f"--host={self.host}",
            f"--port={self._ports['store']}",
            f"--global_segment_size={int(self.store_gib * 2**30)}",
            f"--master_server_address={self.host}:{self.rpc_port}",
            f"--metadata_server={self.metadata_url}",
            "--protocol=tcp",
        ]
        self.store = self._spawn("mooncake-store", command, f"{self.host}:{self._ports['store']}")
        _wait_listening(self.store, self.host, self._ports["store"], deadline_s)
        return self

    def start_master(self, deadline_s: float = 60.0) -> None:
        """Start (or start again, on the same ports) the master; wait until it answers."""
        command = [
            binary("mooncake_master"),
            f"--rpc_port={self.rpc_port}",
            f"--rpc_address={self.host}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={self.host}",
            f"--http_metadata_server_port={self.metadata_port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self._ports['metrics']}",
            *self._tenant_flags(),
        ]
        self.master = self._spawn("mooncake-master", command, f"{self.host}:{self.rpc_port}")
        _wait_listening(self.master, self.host, self.rpc_port, deadline_s)
        _wait_metadata(self.master, self.metadata_url, deadline_s)

    @property
    def metrics_url(self) -> str:
        """The master's metrics port: also its tenant quota admin API (/api/v1/tenant_quotas)."""
        return f"http://{self.host}:{self._ports['metrics']}"

    def _tenant_flags(self) -> list[str]:
        """Strict multi-tenant mode's flags with the policy written for ``api_keys``; none without."""
        if not self.api_keys:
            return []
        policy = self.run_dir / POLICY_FILE
        write_policy(policy, self.api_keys, self.store_gib)
        return [
            "--enable_multi_tenants=true",
            "--tenant_quota_connector_type=file",
            f"--tenant_quota_connector_uri={policy}",
        ]

    def _spawn(self, name: str, command: list[str], address: str) -> Process:
        log_path = self.run_dir / f"{name}.log"
        env = dict(self.env if self.env is not None else os.environ)
        env.setdefault("GLOG_minloglevel", "1")  # its INFO lines would fill the log
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        return Process(name, proc, address, log_path, command, env)

    def kill_master(self) -> None:
        """SIGKILL the master (tests: the store gone mid-run)."""
        self.master.stop(signal.SIGKILL)

    @property
    def processes(self) -> list[Process]:
        return [p for p in (self.store, self.master) if p is not None]

    def down(self) -> None:
        for p in self.processes:
            p.stop(timeout_s=10.0)

    def __enter__(self) -> StoreMaster:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()


def _wait_listening(p: Process, host: str, port: int, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        _check(p, deadline, deadline_s)
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            time.sleep(0.05)


def _wait_metadata(p: Process, url: str, deadline_s: float) -> None:
    """Until the metadata server answers (a 404 for a key no one wrote is an answer)."""
    deadline = time.monotonic() + deadline_s
    while True:
        _check(p, deadline, deadline_s)
        try:
            urllib.request.urlopen(f"{url}?key=kvtier-probe", timeout=1.0).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.05)


def _check(p: Process, deadline: float, deadline_s: float) -> None:
    if not p.alive():
        raise RuntimeError(f"{p.name} exited with {p.proc.returncode}:\n{p.log()[-4000:]}")
    if time.monotonic() > deadline:
        p.stop(signal.SIGKILL)
        raise TimeoutError(
            f"{p.name} not answering at {p.address} after {deadline_s:.0f}s:\n{p.log()[-4000:]}"
        )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m kvtier.cli.store_master",
        description="Write Mooncake Store's tenant policy (strict multi-tenant mode) from an api-keys file.",
    )
    ap.add_argument("--api-keys", required=True, help="the api-keys file (kvtier/api_keys.py)")
    ap.add_argument(
        "--store-gib", type=float, required=True, help="the memory every store server lends, in all"
    )
    ap.add_argument(
        "--policy",
        required=True,
        help="where to write the policy (the master's --tenant_quota_connector_uri)",
    )
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        write_policy(args.policy, args.api_keys, args.store_gib)
    except (ApiKeysError, OSError) as e:
        raise SystemExit(f"cannot write the store's tenant policy: {e}") from None


if __name__ == "__main__":
    main()
