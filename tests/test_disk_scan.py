"""Odd entries in a disk tier's directory (issue 31): a FIFO, a directory, a symlink or a sparse
1 TiB file under a record's name neither hangs nor crashes a start, each is named in one warning,
and the good records beside them still hit, in the tier and in a real cache service."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from servers import cache_service, wait_until
from test_disk_tier import FLUSH_S, key_of, open_tier, payload_of, write
from test_tiered_cache import BS, Client, prompt, record_paths, tier_args

from kvtier.cachesvc.disk_records import file_name
from kvtier.cachesvc.disk_scan import record_sizes

TIB = 1 << 40


def make_odd_entries(disk: Path, names: list[str]) -> dict[str, Path]:
    """A FIFO, a directory, a symlink (to the FIFO: following it would hang) and a sparse 1 TiB
    file, under the record names ``names``; {kind: path}."""
    fifo, directory, symlink, sparse = (disk / n for n in names)
    os.mkfifo(fifo)
    directory.mkdir()
    symlink.symlink_to(fifo)
    with open(sparse, "wb") as f:
        f.truncate(TIB)  # no blocks on disk: reading it whole would allocate 1 TiB
    return {"a FIFO": fifo, "a directory": directory, "a symlink": symlink, "sparse": sparse}


def assert_reported(log: str, odd: dict[str, Path]) -> None:
    """One line per odd entry: the three that are not files skipped and left in place, the sparse
    file dropped for its size, unread."""
    for kind in ("a FIFO", "a directory", "a symlink"):
        line = f"skipped {odd[kind].name}: {kind}, not a record"
        assert log.count(line) == 1, (line, log)
        assert os.path.lexists(odd[kind])
    assert log.count(f"dropped {odd['sparse'].name}: {TIB} bytes") == 1, log
    assert not odd["sparse"].exists()


def test_odd_entries_in_the_tier_directory_are_skipped_and_good_records_still_hit(tmp_path, caplog):
    tier = open_tier(tmp_path)
    write(tier, range(3))
    tier.close()
    odd = make_odd_entries(tmp_path, [file_name(key_of(i)) for i in range(10, 14)])
    with caplog.at_level(logging.WARNING, logger="kvtier.cache"):
        again = open_tier(tmp_path)
    assert_reported(caplog.text, odd)
    assert again.lookup_chain([key_of(0)]) == 1
    assert [bytes(again.load(key_of(i))) for i in range(3)] == [payload_of(i) for i in range(3)]
    assert again.stats()["dropped_at_startup"] == 1  # the sparse file; the others are left as they are
    again.close()


@pytest.mark.parametrize("kind", ["a FIFO", "sparse"])
def test_a_record_replaced_after_it_was_indexed_is_not_opened_or_read_whole(tmp_path, caplog, kind):
    tier = open_tier(tmp_path)
    write(tier, [5, 6])
    path = tmp_path / file_name(key_of(5))
    path.unlink()
    if kind == "a FIFO":
        os.mkfifo(path)
    else:
        with open(path, "wb") as f:
            f.truncate(TIB)
    with caplog.at_level(logging.WARNING, logger="kvtier.cache"):
        assert tier.load(key_of(5)) is None
    reason = "a FIFO" if kind == "a FIFO" else f"{TIB} bytes"
    assert f"dropped {path.name} on read: {reason}" in caplog.text
    assert tier.enabled and not tier.contains(key_of(5)) and not os.path.lexists(path)
    assert bytes(tier.load(key_of(6))) == payload_of(6)
    tier.close()


def test_record_sizes_are_those_the_writer_makes(tmp_path):
    tier = open_tier(tmp_path)
    write(tier, [1])  # a sequence's first block: no parent hash in its header
    later = bytes(32) + key_of(2)[32:]  # a later block: its parent's hash leads its key
    assert tier.offer(later, bytes(32), payload_of(2)) and tier.flush(FLUSH_S)
    sizes = {p.stat().st_size for p in tmp_path.glob("*.kvb")}
    assert sizes == set(record_sizes(tier.layout)) and len(sizes) == 2
    tier.close()


def test_a_cache_service_starts_over_odd_entries_and_serves_its_records(tmp_path):
    """A real service: before the fix the FIFO hung its start (never SERVING) and the sparse
    file made the scan allocate 1 TiB (MemoryError at every start)."""
    disk = tmp_path / "kv-disk"
    a = prompt(1)
    with cache_service(tmp_path / "run", *tier_args(disk)) as svc:
        client = Client(svc)
        fills = client.publish(a, 1.0)
        client.flush_pool()  # the pool's blocks go to the host cache and, written through, to disk
        wait_until(lambda: all(p.exists() for p in record_paths(disk, a)), FLUSH_S, "a's records on disk")
        client.close()
    odd = make_odd_entries(disk, [p.name for seed in (2, 3) for p in record_paths(disk, prompt(seed))][:4])
    with cache_service(tmp_path / "run-again", *tier_args(disk)) as svc:  # SERVING within its deadline
        assert_reported(svc.log(), odd)
        client = Client(svc)
        assert client.hit(a, fills) == 3 * BS
        client.close()
