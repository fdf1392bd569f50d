"""The wire contract (proto/) is v1: `buf lint` passes and `buf breaking` finds nothing against the
committed baseline image (proto/baseline.binpb); a renamed or renumbered field fails, naming it.

buf is npm's @bufbuild/buf, installed under .buf/ by scripts/setup.sh (or any `buf` on PATH).
How to update the baseline on purpose: proto/buf.yaml.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from kvtier.api import cache_pb2
from kvtier.sequence_types import (
    AllocateItem,
    BlockRemoved,
    BlockStored,
    CacheSnapshot,
    CommitItem,
    ExtendItem,
    LeaseGrant,
    LeaseSnapshot,
    PrefixQuery,
    ReleaseItem,
    SequenceBlocks,
    SwapResult,
    TenantSnapshot,
    TierSnapshot,
)

REPO = Path(__file__).resolve().parent.parent
PROTO = REPO / "proto"
BASELINE = PROTO / "baseline.binpb"


@pytest.fixture(scope="module")
def buf() -> str:
    local = REPO / ".buf" / "node_modules" / ".bin" / "buf"
    found = str(local) if local.exists() else shutil.which("buf")
    if found is None:
        pytest.fail(
            "buf is not installed: run scripts/setup.sh (it installs npm's @bufbuild/buf under .buf/)"
        )
    return found


def run_buf(buf: str, *args: str, cwd: Path = PROTO) -> subprocess.CompletedProcess:
    return subprocess.run([buf, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def breaking(buf: str, module: Path) -> subprocess.CompletedProcess:
    return run_buf(buf, "breaking", str(module), "--against", str(BASELINE), cwd=module)


def test_buf_lint_passes(buf) -> None:
    lint = run_buf(buf, "lint")
    assert lint.returncode == 0, f"buf lint (rules in proto/buf.yaml):\n{lint.stdout}{lint.stderr}"


def test_proto_keeps_the_v1_contract_of_the_baseline(buf) -> None:
    check = breaking(buf, PROTO)
    assert check.returncode == 0, (
        "proto/ breaks the v1 contract (proto/baseline.binpb). Keep field numbers and names; to "
        'rename, keep the number and add `reserved "old_name";` with a comment (proto/buf.yaml '
        f"says how to update the baseline on purpose):\n{check.stdout}{check.stderr}"
    )


@pytest.mark.parametrize(
    ("old", "new", "says"),
    [
        ("string tenant_salt = 2;", "string salt = 2;", 'changed name from "tenant_salt" to "salt"'),
        ("string tenant_salt = 2;", "string tenant_salt = 12;", 'field "2" with name "tenant_salt"'),
    ],
    ids=["renamed", "renumbered"],
)
def test_a_renamed_or_renumbered_field_breaks_the_contract_check(buf, tmp_path, old, new, says) -> None:
    module = tmp_path / "proto"
    shutil.copytree(PROTO, module)
    proto = module / "kvtier" / "v1" / "cache.proto"
    text = proto.read_text()
    assert old in text
    proto.write_text(text.replace(old, new))
    check = breaking(buf, module)
    assert check.returncode != 0, "buf breaking passed a changed field"
    assert says.lower() in check.stdout.lower(), check.stdout + check.stderr


def test_the_renamed_salts_old_name_stays_reserved() -> None:
    """Field 2 of AllocateItem and LookupPrefixItem was `cache_salt`: the name is reserved, so it
    can never come back with another meaning, and the proto says so beside the field."""
    text = (PROTO / "kvtier" / "v1" / "cache.proto").read_text()
    for message in (cache_pb2.AllocateItem, cache_pb2.LookupPrefixItem):
        proto = descriptor_pb2.DescriptorProto()
        message.DESCRIPTOR.CopyToProto(proto)
        assert "cache_salt" in proto.reserved_name, message.DESCRIPTOR.name
        assert message.DESCRIPTOR.fields_by_name["tenant_salt"].number == 2
        body = text.split(f"message {message.DESCRIPTOR.name} {{", 1)[1].split("\n}", 1)[0]
        assert "RENAMED from `cache_salt`" in body or "was `cache_salt`" in body, body


# The client's plain types (kvtier.sequence_types) and the messages they mirror: a field added to
# one and not the other would be dropped silently at the client or the servicer.
MIRRORS = {
    "AllocateItem": AllocateItem,
    "SequenceBlocks": SequenceBlocks,
    "ExtendItem": ExtendItem,
    "CommitItem": CommitItem,
    "ReleaseItem": ReleaseItem,
    "LookupPrefixItem": PrefixQuery,
    "AttachResponse": LeaseGrant,
    "SwapInResponse": SwapResult,
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "LeaseStats": LeaseSnapshot,
    "TenantStats": TenantSnapshot,
    "TierStats": TierSnapshot,
    "GetStatsResponse": CacheSnapshot,
}


def _field_names(kind) -> set[str]:
    return set(kind._fields) if hasattr(kind, "_fields") else {f.name for f in dataclasses.fields(kind)}


@pytest.mark.parametrize("message", sorted(MIRRORS))
def test_each_shared_type_has_its_messages_fields(message: str) -> None:
    proto = {f.name for f in cache_pb2.DESCRIPTOR.message_types_by_name[message].fields}
    assert _field_names(MIRRORS[message]) == proto, message
