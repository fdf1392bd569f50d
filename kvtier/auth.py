"""Where the services listen by default, and the shared token both sides present.

The token travels in call metadata as ``authorization: Bearer <token>``. A client finds it in
``$KVTIER_TOKEN``, else in the file named by ``$KVTIER_TOKEN_FILE``, else in the default run
directory, where a cache service started without a token writes a fresh one (mode 0600).
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

METADATA_KEY = "authorization"


def run_dir() -> Path:
    """Per-user directory for sockets and the token: $KVTIER_RUN_DIR, $XDG_RUNTIME_DIR/kvtier or /tmp/kvtier-UID."""
    if os.environ.get("KVTIER_RUN_DIR"):
        return Path(os.environ["KVTIER_RUN_DIR"])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "kvtier"
    return Path(f"/tmp/kvtier-{os.getuid()}")


def ensure_run_dir(path: Path | None = None) -> Path:
    path = path or run_dir()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def default_cache_address() -> str:
    return f"unix://{run_dir() / 'cache.sock'}"


def default_token_file() -> Path:
    return run_dir() / "token"


def load_token(token_file: str | Path | None = None) -> str | None:
    """The token from $KVTIER_TOKEN, an explicit file, $KVTIER_TOKEN_FILE or the default file; None if none."""
    if "KVTIER_TOKEN" in os.environ:
        return _non_blank(os.environ["KVTIER_TOKEN"], "$KVTIER_TOKEN")
    for candidate in (token_file, os.environ.get("KVTIER_TOKEN_FILE"), default_token_file()):
        if candidate and Path(candidate).is_file():
            return _non_blank(Path(candidate).read_text(), f"the token file {candidate}")
    return None


def _non_blank(token: str, where: str) -> str:
    """`token` without surrounding whitespace; ValueError if nothing is left (an empty token would
    let `Bearer ` with nothing after it in)."""
    token = token.strip()
    if not token:
        raise ValueError(f"{where} is empty: a token must have characters (or unset it to get a fresh one)")
    return token


def create_token_file(path: Path) -> str:
    """Write a fresh random token to `path` (mode 0600) and return it."""
    ensure_run_dir(path.parent)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(path, 0o600)
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
