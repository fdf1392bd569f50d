"""The disk tier on real files and a real writer thread: exact round trips, LRU within the budget,
warm restart that indexes only whole verified records of this pool, a SIGKILLed writer, a full
write queue, refused directories and a tier that fails after it started."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from kvtier.auth import UntrustedPath
from kvtier.block_hash import pack_token_ids
from kvtier.cachesvc.disk_files import DiskPathError
from kvtier.cachesvc.disk_records import RecordLayout, file_name, record_bytes
from kvtier.cachesvc.disk_tier import DiskTier

LAYOUT = RecordLayout("model-a", 16, "float32", (2, 2, 16, 2, 8), 4096)  # 2 layers, 2 KV heads, head_dim 8
FLUSH_S = 60.0  # a deadline for the writer's progress, not a speed target


def key_of(i: int, layout: RecordLayout = LAYOUT) -> bytes:
    """A first block's index key: a 32-byte root (an extra key) and ``block_size`` token ids."""
    return hashlib.sha256(b"root %d" % i).digest() + pack_token_ids([i % 50_000] * layout.block_size)


def payload_of(i: int, layout: RecordLayout = LAYOUT) -> bytes:
    """Bytes that differ for every ``i``: its 4-byte index repeated over one block."""
    return i.to_bytes(4, "little") * (layout.block_bytes // 4)


def open_tier(path: Path, blocks: int = 64, layout: RecordLayout = LAYOUT, **kwargs) -> DiskTier:
    return DiskTier(path, blocks * record_bytes(layout, len(key_of(0, layout))), layout, **kwargs)


def write(tier: DiskTier, indices) -> None:
    for i in indices:
        assert tier.offer(key_of(i, tier.layout), None, payload_of(i, tier.layout))
        assert tier.flush(FLUSH_S)


def test_round_trip_is_byte_exact_and_survives_a_restart(tmp_path):
    layout = RecordLayout("model-a", 16, "bfloat16", (2, 2, 16, 2, 8), 2048)
    block = torch.randn((2, 2, 16, 2, 8)).to(torch.bfloat16)
    tier = open_tier(tmp_path / "disk", layout=layout)
    assert tier.offer(key_of(7, layout), None, block)  # a tensor: copied before offer returns
    expected = block.view(torch.uint8).flatten().clone()
    block.zero_()
    assert tier.flush(FLUSH_S)
    got = tier.load(key_of(7, layout))
    assert torch.equal(torch.frombuffer(bytearray(got), dtype=torch.uint8), expected)
    assert tier.stats()["writes"] == 1 and tier.stats()["hits"] == 1
    tier.close()
    assert oct((tmp_path / "disk").stat().st_mode & 0o777) == "0o700"

    again = open_tier(tmp_path / "disk", layout=layout)
    assert again.lookup_chain([key_of(7, layout), key_of(8, layout)]) == 1
    assert torch.equal(
        torch.frombuffer(bytearray(again.load(key_of(7, layout))), dtype=torch.uint8), expected
    )
    again.close()


def test_lru_within_the_budget_deletes_the_least_recently_used_records(tmp_path):
    tier = open_tier(tmp_path, blocks=3)
    write(tier, range(3))
    assert tier.load(key_of(0)) is not None  # 0 is now the most recently used
    write(tier, [3, 4])  # evicts 1, then 2
    assert [tier.contains(key_of(i)) for i in range(5)] == [True, False, False, True, True]
    assert not (tmp_path / file_name(key_of(1))).exists()
    stats = tier.stats()
    assert (stats["blocks"], stats["evictions"], stats["writes"]) == (3, 2, 5)
    assert stats["bytes"] <= stats["budget_bytes"]
    assert bytes(tier.load(key_of(4))) == payload_of(4)
    tier.close()


def written_then_damaged(path: Path, num_records: int, cut: int) -> tuple[Path, Path]:
    """Write records 0..num_records-1 and close; flip a payload bit of record 1 and cut ``cut``
    bytes off record 2. Returns their paths."""
    tier = open_tier(path)
    write(tier, range(num_records))
    tier.close()
    corrupt, truncated = path / file_name(key_of(1)), path / file_name(key_of(2))
    data = bytearray(corrupt.read_bytes())
    data[len(data) // 2] ^= 0x01
    corrupt.write_bytes(data)
    truncated.write_bytes(truncated.read_bytes()[:-cut])
    return corrupt, truncated


def test_a_restart_drops_corrupt_truncated_and_temporary_files_with_a_log_line_each(tmp_path, caplog):
    corrupt, truncated = written_then_damaged(tmp_path, 4, cut=100)
    temp = tmp_path / f".{file_name(key_of(9))}.1234.tmp"
    temp.write_bytes(b"half a record")

    with caplog.at_level(logging.WARNING, logger="kvtier.cache"):
        again = open_tier(tmp_path)
    assert again.lookup_chain([key_of(0)]) == 1 and again.contains(key_of(3))
    assert not again.contains(key_of(1)) and not again.contains(key_of(2))
    assert again.load(key_of(1)) is None and again.load(key_of(2)) is None
    assert bytes(again.load(key_of(3))) == payload_of(3)
    assert again.stats()["dropped_at_startup"] == 3
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert f"dropped {corrupt.name}: checksum mismatch" in logged
    assert f"dropped {truncated.name}:" in logged and "truncated" in logged
    assert f"dropped {temp.name}: a temporary file" in logged
    assert not corrupt.exists() and not truncated.exists() and not temp.exists()
    again.close()


def test_a_scan_past_its_verify_time_checks_heads_and_leaves_checksums_to_the_first_read(tmp_path, caplog):
    corrupt, _ = written_then_damaged(tmp_path, 3, cut=1)
    with caplog.at_level(logging.WARNING, logger="kvtier.cache"):
        again = open_tier(tmp_path, verify_s=0)  # heads only, from the first file
        assert again.stats()["dropped_at_startup"] == 1 and "truncated" in caplog.text
        assert again.contains(key_of(1))  # its head is whole: indexed, not yet checksummed
        assert again.load(key_of(1)) is None
    assert f"dropped {corrupt.name} on read: checksum mismatch" in caplog.text
    assert bytes(again.load(key_of(0))) == payload_of(0) and not again.contains(key_of(1))
    again.close()


def test_a_record_corrupted_after_it_was_indexed_is_not_served(tmp_path, caplog):
    tier = open_tier(tmp_path)
    write(tier, [5])
    path = tmp_path / file_name(key_of(5))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="kvtier.cache"):
        assert tier.load(key_of(5)) is None
    assert f"dropped {path.name} on read: checksum mismatch" in caplog.text
    assert not tier.contains(key_of(5)) and tier.stats()["dropped_on_read"] == 1 and tier.enabled
    tier.close()


@pytest.mark.parametrize(
    "other",
    [
        RecordLayout("model-b", 16, "float32", (2, 2, 16, 2, 8), 4096),
        RecordLayout("model-a", 16, "float16", (2, 2, 16, 2, 16), 4096),  # same bytes per block
        RecordLayout("model-a", 16, "float32", (4, 2, 16, 1, 8), 4096),  # same bytes, another shape
        RecordLayout("model-a", 32, "float32", (2, 2, 32, 1, 8), 4096),
    ],
    ids=["fingerprint", "dtype", "shape", "block_size"],
)
def test_another_pools_records_never_hit(tmp_path, caplog, other):
    tier = open_tier(tmp_path)
    write(tier, range(3))
    tier.close()
    with caplog.at_level(logging.WARNING, logger="kvtier.cache"):
        theirs = open_tier(tmp_path, layout=other)
    assert theirs.stats()["blocks"] == 0 and theirs.stats()["dropped_at_startup"] == 3
    assert theirs.lookup_chain([key_of(i, other) for i in range(3)]) == 0
    assert "written for another pool" in caplog.text
    theirs.close()


def test_a_full_queue_skips_blocks_instead_of_blocking(tmp_path):
    tier = open_tier(tmp_path, queue_blocks=4, group_blocks=1)  # the writer takes one block at a time
    results: list[bool] = []
    with tier.lock:  # the writer cannot index what it wrote: it stalls, as on a slow disk
        offers = threading.Thread(
            target=lambda: results.extend(tier.offer(key_of(i), None, payload_of(i)) for i in range(10))
        )
        offers.start()
        offers.join(FLUSH_S)
        assert not offers.is_alive(), "offer blocked on a stalled writer"
        # every accepted block is queued or in the stalled writer's hands: none is written yet
        assert tier.stats()["queue_depth"] == sum(results) <= 5
    assert tier.flush(FLUSH_S)
    accepted = sum(results)
    assert accepted in (4, 5)  # the queue's 4, plus the one the writer may have taken first
    assert tier.stats()["skipped_writes"] == 10 - accepted and tier.stats()["writes"] == accepted
    tier.close()


def test_a_burst_is_written_in_groups_every_record_whole_none_skipped(tmp_path):
    """Issue 31: 200 blocks offered back to back into a 256-block queue are all written, in a few
    groups (one syncfs and one directory fsync each, not an fsync per record), each record whole
    and checked on read; nothing is skipped and no temporary file is left."""
    tier = open_tier(tmp_path, blocks=256, queue_blocks=256)
    assert all(tier.offer(key_of(i), None, payload_of(i)) for i in range(200))
    assert tier.flush(FLUSH_S)
    stats = tier.stats()
    assert (stats["writes"], stats["skipped_writes"], stats["blocks"]) == (200, 0, 200)
    assert stats["write_groups"] <= 50, stats  # one per record was the writer before groups
    assert all(bytes(tier.load(key_of(i))) == payload_of(i) for i in range(200))
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    tier.close()
    reopened = open_tier(tmp_path, blocks=256)  # a restart indexes all of them
    assert reopened.lookup_chain([key_of(i) for i in range(200)]) == 200
    reopened.close()


def test_refused_directories(tmp_path):
    for mode in (0o777, 0o770, 0o722):
        path = tmp_path / f"mode-{mode:o}"
        path.mkdir()
        path.chmod(mode)
        with pytest.raises(UntrustedPath, match=f"--disk-path refused: .*{path}.*mode {mode:04o}"):
            open_tier(path)
    if os.getuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(UntrustedPath, match="owned by .*uid 65534"):
            open_tier(theirs)
    else:
        with pytest.raises(UntrustedPath):
            open_tier(Path("/tmp"))  # root's, and everyone's to write
    (tmp_path / "a-file").write_text("")
    with pytest.raises(DiskPathError, match=f"--disk-path {tmp_path / 'a-file' / 'disk'} cannot be created"):
        open_tier(tmp_path / "a-file" / "disk")
    first = open_tier(tmp_path / "shared")
    with pytest.raises(DiskPathError, match="in use by another cache service"):
        open_tier(tmp_path / "shared")
    first.close()
    with pytest.raises(ValueError, match="below one record"):
        DiskTier(tmp_path / "small", 100, LAYOUT)


def test_an_unwritable_directory_is_a_startup_error(tmp_path):
    path = tmp_path / "ro"
    path.mkdir(mode=0o700)
    if os.getuid() == 0:  # root writes anywhere: ask as another user, in a child process
        base = Path(tempfile.mkdtemp())  # pytest's tmp_path is under a directory only root can enter
        base.chmod(0o711)
        path = base / "ro"
        path.mkdir(mode=0o700)
        os.chown(path, 65534, 65534)
        path.chmod(0o500)
        code = f"""
import os, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_disk_tier import open_tier
from kvtier.cachesvc.disk_files import DiskPathError
os.setgid(65534); os.setuid(65534)  # after the imports: the interpreter is under root's home
try:
    open_tier({str(path)!r})
except DiskPathError as e:
    print(e)
"""
        try:
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        finally:
            shutil.rmtree(base)
        if "Permission denied" in out.stderr and "DiskPathError" not in out.stderr and not out.stdout:
            pytest.skip(f"uid 65534 cannot run this interpreter here: {out.stderr.strip()[-200:]}")
        assert f"--disk-path {path} is not writable" in out.stdout, out.stderr
    else:
        path.chmod(0o500)
        with pytest.raises(DiskPathError, match=f"--disk-path {path} is not writable"):
            open_tier(path)


def test_a_directory_that_fails_later_disables_the_tier_without_a_crash(tmp_path, caplog):
    tier = open_tier(tmp_path / "disk")
    write(tier, [1])
    shutil.rmtree(tmp_path / "disk")  # the disk went away under a running service
    with caplog.at_level(logging.WARNING, logger="kvtier.cache"):
        tier.offer(key_of(2), None, payload_of(2))
        assert tier.flush(FLUSH_S)
    assert "disabled" in caplog.text and not tier.enabled
    assert tier.lookup_chain([key_of(1)]) == 0 and tier.load(key_of(1)) is None
    assert not tier.offer(key_of(3), None, payload_of(3))
    tier.close()


WRITER = """
import sys
sys.path.insert(0, {root!r})
from test_disk_tier import key_of, open_tier, payload_of
tier = open_tier({path!r}, blocks=100_000, queue_blocks=8)
i = 0
while True:
    if tier.offer(key_of(i), None, payload_of(i)):
        i += 1
    else:
        tier.flush(60)
        print(tier.stats()["writes"], flush=True)
"""


def test_a_writer_killed_mid_write_leaves_only_whole_verified_records(tmp_path):
    root = str(Path(__file__).parent)  # tests/: the child imports this module by name
    child = subprocess.Popen(
        [sys.executable, "-c", WRITER.format(root=root, path=str(tmp_path))],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        for line in child.stdout:
            if int(line) >= 200:
                break
        os.kill(child.pid, signal.SIGKILL)  # the writer thread is busy: the queue was just refilled
    finally:
        child.kill()
        child.wait(60)
    assert child.returncode == -signal.SIGKILL
    tier = open_tier(tmp_path, blocks=100_000)
    stats = tier.stats()
    assert stats["blocks"] >= 200
    n = max(i for i in range(stats["blocks"] + 64) if tier.contains(key_of(i))) + 1
    assert tier.lookup_chain([key_of(i) for i in range(n)]) == stats["blocks"] == n  # written in order
    for i in range(n):
        assert bytes(tier.load(key_of(i))) == payload_of(i)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    tier.close()


def test_reads_racing_the_writer_see_whole_blocks_or_nothing(tmp_path):
    tier = open_tier(tmp_path, blocks=400, queue_blocks=400)
    wrong: list[int] = []
    seen: set[int] = set()
    done = threading.Event()

    def reader() -> None:
        while not done.is_set() or len(seen) < 300:
            for i in range(300):
                payload = tier.load(key_of(i)) if i not in seen else None
                if payload is not None:
                    seen.add(i)
                    if bytes(payload) != payload_of(i):
                        wrong.append(i)

    thread = threading.Thread(target=reader)
    thread.start()
    for i in range(300):
        assert tier.offer(key_of(i), None, payload_of(i))
    assert tier.flush(FLUSH_S)
    done.set()
    thread.join(FLUSH_S)
    assert not thread.is_alive() and not wrong and len(seen) == 300
    tier.close()


@pytest.fixture
def small_filesystem(tmp_path):
    """A 256 KiB tmpfs at ``tmp_path / "fs"`` (needs root and mount rights; skipped otherwise)."""
    mount_point = tmp_path / "fs"
    mount_point.mkdir(mode=0o700)
    out = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root and mount rights): {out.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def test_a_full_filesystem_is_a_startup_error_and_filling_up_later_disables_the_tier(
    small_filesystem, caplog
):
    filler = small_filesystem / "filler"
    with open(filler, "wb") as f, contextlib.suppress(OSError):  # ENOSPC: the filesystem is full
        f.write(b"\0" * 512 * 1024)
    with pytest.raises(DiskPathError, match=f"--disk-path {small_filesystem} is full: .* bytes free"):
        open_tier(small_filesystem)
    filler.unlink()

    tier = open_tier(small_filesystem, blocks=1000)  # a budget the filesystem cannot hold
    assert "writes will fail" in caplog.text
    with caplog.at_level(logging.WARNING, logger="kvtier.cache"):
        for i in range(100):
            if not tier.offer(key_of(i), None, payload_of(i)):
                break
            assert tier.flush(FLUSH_S)
    assert not tier.enabled and "disabled: writing" in caplog.text and "No space left" in caplog.text
    assert tier.lookup_chain([key_of(0)]) == 0 and tier.load(key_of(0)) is None
    assert not [p for p in os.listdir(small_filesystem) if p.endswith(".tmp")]  # the torn write was removed
    tier.close()


def test_a_records_tenant_survives_a_restart_and_goes_down_with_its_evicted_block(tmp_path):
    """Each record carries its block's tenant (any name the service takes, up to 256 UTF-8 bytes,
    in a field of fixed size: every record of a layout is one of two sizes); after a restart the
    blocks the tier evicts go down to the tier below (``pass_down``) as their tenants'."""
    tenants = {0: "acme", 1: "", 2: "é" * 128}
    tier = open_tier(tmp_path / "disk", blocks=3)
    for i, tenant in tenants.items():
        assert tier.offer(key_of(i), None, payload_of(i), tenant)
    with pytest.raises(ValueError, match="tenant name of 257 bytes"):
        tier.offer(key_of(9), None, payload_of(9), "x" * 257)
    assert tier.flush(FLUSH_S)
    tier.close()
    assert len({(tmp_path / "disk" / file_name(key_of(i))).stat().st_size for i in tenants}) == 1
    again = open_tier(tmp_path / "disk", blocks=3)
    try:
        assert again.submit_store(blocks_of([]), pass_down=True) is None  # a tier below from now on
        first = again.submit_store(blocks_of([3, 4, 5]), pass_down=True)  # the writer evicts behind it
        assert again.flush(FLUSH_S)
        got = handed_down(first, again.submit_store(blocks_of([]), pass_down=True))
        assert got == {key_of(i): (tenant, payload_of(i)) for i, tenant in tenants.items()}
        assert again.submit_store(blocks_of([]), pass_down=True) is None  # each handed down once
    finally:
        again.close()


def handed_down(*downs) -> dict:
    """key -> (tenant, bytes) of what ``submit_store`` calls returned for the tier below."""
    return {
        k: (t, bytes(d.rows[i].numpy()))
        for d in downs
        if d is not None
        for k, t, i in zip(d.keys, d.tenants, d.row_ids, strict=True)
    }


def blocks_of(indices: list[int]):
    """``Blocks`` of ``indices``' keys and payloads, default tenant."""
    from kvtier.cachesvc.tiers import Blocks

    rows = torch.tensor([list(payload_of(i)) for i in indices], dtype=torch.uint8).reshape(
        -1, LAYOUT.block_bytes
    )
    return Blocks([key_of(i) for i in indices], rows, range(len(indices)))


def test_an_earlier_formats_record_or_a_bad_tenant_field_is_dropped_at_start(tmp_path, caplog):
    """A KVTBLK02 record (no tenant) is dropped at the first start, the line naming an earlier
    format; a record whose tenant field is not a length, a name and zeros is dropped though its
    checksum matches."""
    from kvtier.cachesvc.disk_records import checksum, tenant_field

    tier = open_tier(tmp_path / "disk")
    write(tier, [0, 1])
    tier.close()
    old, bad = (tmp_path / "disk" / file_name(key_of(i)) for i in (0, 1))
    old.write_bytes(b"KVTBLK02" + old.read_bytes()[8:])
    data = bytearray(bad.read_bytes())
    at = data.index(tenant_field(""))
    data[at : at + 2] = (300).to_bytes(2, "little")
    data[-32:] = checksum(bytes(data[:-32])).digest()
    bad.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="kvtier.cache"):
        again = open_tier(tmp_path / "disk")
    again.close()
    assert again.stats()["dropped_at_startup"] == 2 and not old.exists() and not bad.exists()
    assert (
        f"dropped {old.name}: magic b'KVTBLK02' is not b'KVTBLK03' (an earlier kvtier's format)"
        in caplog.text
    )
    assert f"dropped {bad.name}: unreadable header: tenant field is not a length" in caplog.text
