"""Process lifecycle of a service: where it may listen, and how it says no."""

from __future__ import annotations

import socket
import subprocess
import sys

from servers import REPO, cache_service, child_env

from kvtier.healthcheck import check


def start_cache(run_dir, listen: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    """Run a cache service that is expected to refuse to start; it must exit by itself."""
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cachesvc", "--listen", listen, "--num-blocks", "8"],
        cwd=REPO,
        env=child_env(run_dir),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_a_second_service_refuses_a_socket_where_a_live_one_answers(tmp_path):
    with cache_service(tmp_path) as first:
        refused = start_cache(tmp_path, first.address)
        assert refused.returncode == 2, refused.stderr[-2000:]
        assert "a live server already listens on" in refused.stderr
        assert "Traceback" not in refused.stderr
        # The first service still owns its address.
        assert check(first.address) == "SERVING"


def test_a_stale_socket_file_is_removed_and_the_service_starts(tmp_path):
    path = tmp_path / "cache.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))  # a socket file nobody listens on, as a killed server leaves it
    stale.close()
    assert path.is_socket()
    with cache_service(tmp_path) as service:  # its address is that path
        assert check(service.address) == "SERVING"


def test_a_clean_stop_logs_no_traceback(tmp_path):
    # The host tier keeps a view of the pool; closing the pool must not print a BufferError.
    with cache_service(tmp_path, "--swap-space", "0.01") as service:
        assert check(service.address) == "SERVING"
    assert service.proc.returncode == 0, service.log()[-2000:]
    assert "pool released" in service.log()
    assert "Traceback" not in service.log(), service.log()[-2000:]


def test_a_regular_file_at_the_socket_path_is_never_deleted(tmp_path):
    path = tmp_path / "cache.sock"
    path.write_text("not a socket")
    refused = start_cache(tmp_path, f"unix://{path}")
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "exists and is not a socket" in refused.stderr
    assert path.read_text() == "not a socket"


def test_a_tcp_port_in_use_is_a_one_line_error(tmp_path):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        port = holder.getsockname()[1]
        refused = start_cache(tmp_path, f"tcp://127.0.0.1:{port}")
    finally:
        holder.close()
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert f"cannot listen on tcp://127.0.0.1:{port}" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_a_blank_token_is_refused_at_start(tmp_path):
    env = child_env(tmp_path)
    env["KVTIER_TOKEN"] = "   "
    refused = subprocess.run(
        [sys.executable, "-m", "kvtier.cachesvc", "--num-blocks", "8"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "$KVTIER_TOKEN is empty" in refused.stderr
    assert "Traceback" not in refused.stderr
