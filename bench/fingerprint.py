"""What the model fingerprint over every byte (issue 31) costs a start: the hashing rate and the
startup cost of ``ModelShape.from_model_dir`` on a real checkpoint file, cold (every byte hashed)
and cached (digests read from the digest cache by file identity), against the I/O floor.

The checkpoint is a real safetensors file of ``--size-gib`` GiB of random bytes (one U8 tensor)
beside a config.json, written to ``--dir`` (a temporary directory by default; put it on the disk
your models live on). Measured in the same run, ``--repeats`` rounds of all four in turn, medians:

- the floor: ``cat`` of the same file to /dev/null (what reading the bytes costs at all);
- the same bytes through hashlib's sha256 (what a user would reach for first);
- a cold fingerprint: a fresh, empty digest cache, so every byte is hashed (blake3);
- a cached fingerprint: the digest cache written by the cold run (a restart of an unchanged model).

The file was just written, so the reads come from the page cache: the figures are the hash's
and the page cache's, not a disk's (a cold disk reads slower than both; then the floor is the
disk's and hashing hides behind it). The 16 GiB figures are extrapolated from the cold rate (the
cached cost is a stat per file, not per byte).

    python bench/fingerprint.py             # a 1 GiB checkpoint
    python bench/fingerprint.py --quick     # 256 MiB

The last line is the headline.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from kvtier.model_spec import TINY_LLAMA_CONFIG, ModelShape

GIB = 2**30
CHUNK = 64 * 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0, help="checkpoint size (GiB)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each measurement (medians reported)")
    ap.add_argument("--dir", type=Path, help="where to write the checkpoint (default: a temporary directory)")
    ap.add_argument("--quick", action="store_true", help="a 256 MiB checkpoint")
    args = ap.parse_args(argv)
    if args.quick:
        args.size_gib = 0.25
    return args


def write_checkpoint(model_dir: Path, size: int) -> Path:
    """config.json and a model.safetensors holding one U8 tensor of ``size`` random bytes."""
    (model_dir / "config.json").write_text(json.dumps({"model_type": "llama", **TINY_LLAMA_CONFIG}))
    header = json.dumps({"weight": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}}).encode()
    header += b" " * (-len(header) % 8)
    path = model_dir / "model.safetensors"
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        for start in range(0, size, CHUNK):
            f.write(os.urandom(min(CHUNK, size - start)))
    return path


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def cat(path: Path) -> None:
    subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)


def sha256_file(path: Path) -> None:
    with open(path, "rb") as f:
        hashlib.file_digest(f, "sha256")


def fingerprint(model_dir: Path, cache_home: Path) -> None:
    os.environ["XDG_CACHE_HOME"] = str(cache_home)
    ModelShape.from_model_dir(model_dir)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        model_dir, size = Path(tmp), int(args.size_gib * GIB)
        weights = write_checkpoint(model_dir, size)
        total = sum(p.stat().st_size for p in model_dir.iterdir())
        print(f"checkpoint: {model_dir} ({total / GIB:.2f} GiB), {args.repeats} interleaved repeats, medians")
        runs: dict[str, list[float]] = {"floor": [], "sha256": [], "cold": [], "cached": []}
        for i in range(args.repeats):  # interleaved: a change in the machine's load hits every one alike
            runs["floor"].append(timed(cat, weights))
            runs["sha256"].append(timed(sha256_file, weights))
            cache_home = Path(tmp) / f"cache-{i}"  # fresh and empty: every byte hashed
            runs["cold"].append(timed(fingerprint, model_dir, cache_home))
            runs["cached"].append(timed(fingerprint, model_dir, cache_home))  # what the cold run stored
        floor, sha256, cold, cached = (
            statistics.median(runs[k]) for k in ("floor", "sha256", "cold", "cached")
        )
    rate, floor_rate, sha_rate = total / GIB / cold, total / GIB / floor, total / GIB / sha256
    print(f"floor (cat to /dev/null):        {floor:7.3f} s  {floor_rate:6.2f} GiB/s")
    print(f"sha256 (hashlib, same bytes):    {sha256:7.3f} s  {sha_rate:6.2f} GiB/s")
    print(
        f"fingerprint, cold (blake3):      {cold:7.3f} s  {rate:6.2f} GiB/s  ({rate / floor_rate:.2f} of the floor)"
    )
    print(f"fingerprint, cached:             {cached * 1e3:7.1f} ms")
    print(f"16 GiB checkpoint (extrapolated): cold {16 / rate:.1f} s, cached {cached * 1e3:.1f} ms")
    print(
        f"headline: fingerprint over every byte {rate:.2f} GiB/s ({rate / floor_rate:.2f}x the cat floor "
        f"{floor_rate:.2f} GiB/s, {rate / sha_rate:.1f}x sha256); startup {args.size_gib:g} GiB cold "
        f"{cold:.2f} s, 16 GiB cold ~{16 / rate:.1f} s (extrapolated), cached {cached * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
