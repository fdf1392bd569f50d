"""Where the services listen by default, and the shared token both sides present.

The token travels in call metadata as ``authorization: Bearer <token>``. A client finds it in
``$KVTIER_TOKEN``, else in the file named by ``$KVTIER_TOKEN_FILE``, else in the default run
directory, where a cache service started without a token writes a fresh one (mode 0600).

The run directory is trusted only if it is this user's and no one else can write it
(`check_private_dir`): whoever can write it can move a socket aside and take the token from the
next client, or plant a token file. A token file found there is adopted only if it is a regular
file (not a symlink) of ours that no one else can read; a new one is created with
``O_CREAT | O_EXCL | O_NOFOLLOW``, so an existing file or link at its path is never followed.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import secrets
import stat
from pathlib import Path

METADATA_KEY = "authorization"


def run_dir() -> Path:
    """Per-user directory for sockets and the token: $KVTIER_RUN_DIR, $XDG_RUNTIME_DIR/kvtier or /tmp/kvtier-UID."""
    if os.environ.get("KVTIER_RUN_DIR"):
        return Path(os.environ["KVTIER_RUN_DIR"])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "kvtier"
    return Path(f"/tmp/kvtier-{os.getuid()}")


class UntrustedPath(PermissionError, ValueError):
    """A run directory or token file that another user made or can change (the message names the
    path, its owner and mode, and what to do). A ValueError too: the services' `main` reports
    it as "cannot start: ..." with exit status 2, as it does a bad flag."""


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def check_private_dir(path: Path) -> Path:
    """`path` if it is a directory owned by this user that neither group nor others can write;
    UntrustedPath otherwise. A symlink is followed only if it is ours too (another user could
    point it elsewhere). FileNotFoundError if there is nothing at `path`."""
    path = Path(path)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        if st.st_uid != os.getuid():
            raise UntrustedPath(
                f"the directory {path} is a symbolic link owned by {_owner(st.st_uid)}, not by you "
                f"({_owner(os.getuid())}): another user could point it anywhere; remove it, or set "
                "$KVTIER_RUN_DIR to a directory of your own"
            )
        st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UntrustedPath(f"{path} is not a directory; remove it or set $KVTIER_RUN_DIR")
    if st.st_uid != os.getuid():
        raise UntrustedPath(
            f"the directory {path} is owned by {_owner(st.st_uid)}, not by you ({_owner(os.getuid())}), "
            f"mode {stat.S_IMODE(st.st_mode):04o}: its owner could swap the sockets in it and take your token; "
            "remove it (it may be another user's), or set $KVTIER_RUN_DIR to a directory of your own"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UntrustedPath(
            f"the directory {path} (owner {_owner(st.st_uid)}) has mode {stat.S_IMODE(st.st_mode):04o}: "
            f"group or others can write it, swap the sockets in it and take your token; chmod 700 {path}"
        )
    return path


def ensure_run_dir(path: Path | None = None) -> Path:
    """Create the run directory (mode 0700) if it is missing, and check it (`check_private_dir`).

    NOTE: an existing directory is never chmod-ed: one that is not ours or that others can write
    is refused, since fixing its mode would trust whoever made it.
    """
    path = Path(path or run_dir())
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700, parents=True)
    return check_private_dir(path)


def default_cache_address() -> str:
    return f"unix://{run_dir() / 'cache.sock'}"


def default_token_file() -> Path:
    return run_dir() / "token"


def load_token(token_file: str | Path | None = None) -> str | None:
    """The token from $KVTIER_TOKEN, an explicit file, $KVTIER_TOKEN_FILE or the default file; None if none.

    An explicit file (`token_file`, $KVTIER_TOKEN_FILE) is the operator's choice and is read as
    named (a mounted secret is often a symlink owned by root). The default file is read only from a
    trusted run directory and only if it is private to us (`read_private_token`).
    """
    if "KVTIER_TOKEN" in os.environ:
        return _non_blank(os.environ["KVTIER_TOKEN"], "$KVTIER_TOKEN")
    for candidate in (token_file, os.environ.get("KVTIER_TOKEN_FILE")):
        if candidate and Path(candidate).is_file():
            return _non_blank(Path(candidate).read_text(), f"the token file {candidate}")
    path = default_token_file()
    try:
        check_private_dir(path.parent)
    except FileNotFoundError:
        return None
    return read_private_token(path)


def read_private_token(path: Path) -> str | None:
    """The token in `path`, a file in a checked run directory; None if there is none.

    Refused (UntrustedPath): a symlink (opened with O_NOFOLLOW, so it is never followed), anything
    but a regular file, a file owned by another user, or one that group or others can read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        if stat.S_ISLNK(os.lstat(path).st_mode):
            raise UntrustedPath(
                f"the token file {path} is a symbolic link (to {os.readlink(path)}): not followed; "
                "remove it (a fresh cache service writes a new token there)"
            ) from None
        raise UntrustedPath(f"cannot open the token file {path}: {e}") from None
    with os.fdopen(fd, "r") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedPath(f"the token file {path} is not a regular file; remove it")
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise UntrustedPath(
                f"the token file {path} is owned by {_owner(st.st_uid)} with mode {stat.S_IMODE(st.st_mode):04o}; "
                f"a token file must be yours ({_owner(os.getuid())}) and private (0600): someone else may "
                "have planted or read it; remove it (a fresh cache service writes a new one), or pass "
                "the token in $KVTIER_TOKEN"
            )
        text = f.read()
    return _non_blank(text, f"the token file {path}")


def _non_blank(token: str, where: str) -> str:
    """`token` without surrounding whitespace; ValueError if nothing is left (an empty token would
    let `Bearer ` with nothing after it in)."""
    token = token.strip()
    if not token:
        raise ValueError(f"{where} is empty: a token must have characters (or unset it to get a fresh one)")
    return token


def create_token_file(path: Path) -> str:
    """Write a fresh random token to a new file at `path` (mode 0600 from its creation) and return it.

    The run directory is created or checked first. The file is opened with
    O_CREAT | O_EXCL | O_NOFOLLOW: whatever is already at `path` (a file, or a symlink, dangling or
    not) is refused with UntrustedPath naming it, never followed, truncated or adopted.
    """
    ensure_run_dir(path.parent)
    token = secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        kind = "a symbolic link" if stat.S_ISLNK(os.lstat(path).st_mode) else "a file"
        raise UntrustedPath(
            f"cannot write a new token to {path}: {kind} is already there and was not made by a "
            "cache service of yours (it is not a private token file); remove it and start again"
        ) from None
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # the umask may have taken bits; never more than 0600 anyway
        f.write(token + "\n")
    return token


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata that carries `token`."""
    return ((METADATA_KEY, f"Bearer {token}"),)


def token_matches(metadata, token: str) -> bool:
    """True if the call's metadata carries exactly `token` (constant-time comparison).

    The auth scheme is case-insensitive (``Bearer``, ``bearer``), as HTTP's; the token is not.
    """
    for key, value in metadata or ():
        if key == METADATA_KEY and isinstance(value, str) and value[:7].lower() == "bearer ":
            return hmac.compare_digest(value[7:].encode(), token.encode())
    return False


def grpc_target(address: str) -> str:
    """`unix:///p`, `tcp://h:p` or `h:p` -> the target string gRPC understands."""
    if address.startswith("tcp://"):
        return address[len("tcp://") :]
    return address
