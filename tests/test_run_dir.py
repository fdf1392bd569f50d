"""The run directory and its files are not trusted blindly (issue 16, item 6).

Whoever can write the run directory can move a socket aside and take the token from the next
client, or plant a token file for the service to adopt. Checked here, through the real service
process (`python -m kvtier.cachesvc`) and the real client code:

- a run directory owned by another user (`nobody`), or writable by group or others, is refused
  by the service (exit 2, a message naming the path, owner, mode and the fix) and by a client
  that would read the token from it;
- a dangling symlink at the token path is not followed (its target is never created), and the
  service refuses to start, naming it;
- a planted token file (another user's, or one others can read) is not adopted;
- a token file the service writes is created 0600 with O_EXCL; a Unix socket is 0600 from its
  creation (before the server starts), whatever the umask.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from servers import child_env

from kvtier import auth
from kvtier.cache_client import CacheClient
from kvtier.cli.stack_file import running_stack, stop_stack
from kvtier.compute_client import ComputeClient
from kvtier.grpc_server import bind

NOBODY = pwd.getpwnam("nobody").pw_uid
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another user needs root")


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty run directory of ours (0700) that this process's clients use by default."""
    path = tmp_path / "run"
    path.mkdir(mode=0o700)
    for name in ("KVTIER_TOKEN", "KVTIER_TOKEN_FILE", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KVTIER_RUN_DIR", str(path))
    return path


def start_cache(run_dir: Path, with_token: bool) -> subprocess.CompletedProcess:
    """`python -m kvtier.cachesvc` on a socket in `run_dir`, to completion (these all refuse to start)."""
    env = child_env(run_dir)
    if not with_token:
        del env["KVTIER_TOKEN"]
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.cachesvc",
            "--listen",
            f"unix://{run_dir}/cache.sock",
            "--num-blocks",
            "4",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_refused(result: subprocess.CompletedProcess, *phrases: str) -> None:
    assert result.returncode == 2, f"exit {result.returncode}:\n{result.stderr[-3000:]}"
    assert "cannot start" in result.stderr, result.stderr[-3000:]
    for phrase in phrases:
        assert phrase in result.stderr, f"{phrase!r} not in:\n{result.stderr[-3000:]}"


# ---------------------------------------------------------------- the run directory


@needs_root
def test_a_run_directory_owned_by_another_user_is_refused_by_the_service(run_dir):
    # The token is in the environment: the service refuses the directory itself, not only the
    # token file in it (the test below refuses it on reading the token).
    os.chown(run_dir, NOBODY, -1)
    result = start_cache(run_dir, with_token=True)
    assert_refused(result, str(run_dir), "owned by nobody", "0700", "KVTIER_RUN_DIR")
    assert not (run_dir / "cache.sock").exists()
    assert not (run_dir / "token").exists(), "the service wrote its token into another user's directory"


@needs_root
def test_a_client_refuses_the_token_of_a_run_directory_owned_by_another_user(run_dir):
    (run_dir / "token").write_text("planted-by-the-directory-owner\n")
    os.chmod(run_dir / "token", 0o600)
    os.chown(run_dir, NOBODY, -1)
    with pytest.raises(auth.UntrustedPath, match=f"{run_dir} is owned by nobody"):
        auth.load_token()
    with pytest.raises(auth.UntrustedPath, match="owned by nobody"):
        ComputeClient([f"unix://{run_dir}/compute-0.sock"])
    with pytest.raises(auth.UntrustedPath, match="owned by nobody"):
        CacheClient.connect()  # the default address and token: both in that directory


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777])
def test_a_run_directory_others_can_write_is_refused_and_never_chmod_ed(run_dir, mode):
    (run_dir / "token").write_text("a-token-of-ours\n")
    os.chmod(run_dir / "token", 0o600)
    os.chmod(run_dir, mode)
    with pytest.raises(auth.UntrustedPath, match=f"mode {mode:04o}.*chmod 700 {run_dir}"):
        auth.load_token()
    with pytest.raises(auth.UntrustedPath, match="group or others can write it"):
        auth.ensure_run_dir(run_dir)
    assert stat.S_IMODE(run_dir.stat().st_mode) == mode  # reported, not silently "fixed"


def test_a_group_writable_run_directory_is_refused_by_the_service(run_dir):
    os.chmod(run_dir, 0o775)
    assert_refused(start_cache(run_dir, with_token=False), str(run_dir), "mode 0775", "chmod 700")
    assert not (run_dir / "cache.sock").exists() and not (run_dir / "token").exists()


@needs_root
def test_a_symlinked_run_directory_is_followed_only_when_the_link_is_ours(tmp_path, run_dir):
    link = tmp_path / "link"
    link.symlink_to(run_dir)
    assert auth.ensure_run_dir(link) == link  # our link to our directory
    os.lchown(link, NOBODY, -1)
    with pytest.raises(auth.UntrustedPath, match="symbolic link owned by nobody"):
        auth.ensure_run_dir(link)


def test_a_missing_run_directory_is_created_owner_only_and_an_empty_one_gives_no_token(run_dir):
    fresh = run_dir / "a" / "b"
    old = os.umask(0)
    try:
        assert auth.ensure_run_dir(fresh) == fresh
    finally:
        os.umask(old)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
    assert auth.load_token() is None  # nothing there yet: the service writes a fresh one


@needs_root
def test_a_stack_file_in_another_users_run_directory_is_not_followed(run_dir):
    # It would send our token to sockets of its author's choosing, and `kvtier down` would signal
    # pids of their choosing.
    (run_dir / "stack.json").write_text(
        json.dumps({"cache": f"unix://{run_dir}/cache.sock", "compute": [], "pids": {"x": os.getpid()}})
    )
    os.chown(run_dir, NOBODY, -1)
    with pytest.raises(auth.UntrustedPath, match="owned by nobody"):
        running_stack(run_dir)
    with pytest.raises(auth.UntrustedPath, match="owned by nobody"):
        stop_stack(run_dir)


# ---------------------------------------------------------------- the token file


def test_a_dangling_symlink_at_the_token_path_is_not_followed_and_the_service_refuses_it(tmp_path, run_dir):
    target = tmp_path / "target-the-link-names"
    (run_dir / "token").symlink_to(target)
    result = start_cache(run_dir, with_token=False)
    assert_refused(result, f"{run_dir}/token", "symbolic link", "remove it")
    assert not target.exists(), "the service followed the symlink and created its target"
    assert (run_dir / "token").is_symlink()
    # The same in-process: neither reading nor creating follows it.
    with pytest.raises(auth.UntrustedPath, match="symbolic link"):
        auth.load_token()
    with pytest.raises(auth.UntrustedPath, match="symbolic link is already there"):
        auth.create_token_file(run_dir / "token")
    assert not target.exists()


@needs_root
def test_a_token_file_planted_by_another_user_is_not_adopted(run_dir):
    planted = run_dir / "token"
    planted.write_text("the-planters-token\n")
    os.chmod(planted, 0o600)
    os.chown(planted, NOBODY, -1)
    result = start_cache(run_dir, with_token=False)
    assert_refused(result, str(planted), "owned by nobody", "remove it")
    with pytest.raises(auth.UntrustedPath, match="owned by nobody"):
        auth.load_token()
    assert planted.read_text() == "the-planters-token\n"  # left for the user to look at


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644])
def test_a_token_file_others_can_read_is_not_adopted(run_dir, mode):
    token = run_dir / "token"
    token.write_text("readable-by-others\n")
    os.chmod(token, mode)
    with pytest.raises(auth.UntrustedPath, match=f"mode {mode:04o}"):
        auth.load_token()


def test_a_private_token_file_of_ours_is_read_and_a_new_one_is_never_written_over_another(run_dir):
    assert auth.create_token_file(run_dir / "token") == auth.load_token()
    st = (run_dir / "token").lstat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
    before = (run_dir / "token").read_text()
    with pytest.raises(auth.UntrustedPath, match="a file is already there"):
        auth.create_token_file(run_dir / "token")
    assert (run_dir / "token").read_text() == before
    (run_dir / "token").write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        auth.load_token()


# ---------------------------------------------------------------- sockets


async def _bound(address: str) -> str:
    """`bind` on a fresh grpc.aio server, on an event loop of its own (grpc.aio needs one; an
    earlier test module may have closed the main thread's)."""
    return bind(grpc.aio.server(), address)


def test_a_unix_socket_is_owner_only_from_its_creation_whatever_the_umask(run_dir):
    old = os.umask(0)  # the most permissive: a socket would be 0777 without our own umask
    try:
        address = asyncio.run(_bound(f"unix://{run_dir}/svc.sock"))
    finally:
        os.umask(old)
    # grpc creates the socket in bind, before the server starts (and before any chmod could run).
    st = (run_dir / "svc.sock").lstat()
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
    assert address == f"unix://{run_dir}/svc.sock"
    assert os.umask(old) == old  # the process's umask is back as it was


@needs_root
def test_a_socket_is_never_bound_in_another_users_directory(run_dir):
    os.chown(run_dir, NOBODY, -1)
    with pytest.raises(auth.UntrustedPath, match="owned by nobody"):
        asyncio.run(_bound(f"unix://{run_dir}/svc.sock"))
    assert not (run_dir / "svc.sock").exists()
