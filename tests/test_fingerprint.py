"""The model fingerprint sees every byte of the weights and the tokenizer (issue 31), its digests
are cached by file identity, and a restart over the same disk tier after one byte of one tensor
changed serves nothing the old weights wrote: 0 cached tokens, the greedy tokens of a fresh compute."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from servers import ModuleLoop, cache_stats, child_env, disk_drained, greedy_request, local_stack, wait_until
from test_tiered_cache import BS, record_paths

from kvtier.file_digests import CACHE_FILE_NAME, file_digests
from kvtier.model_spec import TINY_LLAMA_CONFIG, ModelShape

MIB = 1 << 20
TENSOR = "model.layers.0.mlp.gate_proj.weight"  # layer 0's MLP: the K and V of every later layer depend on it
LOOP = ModuleLoop()


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama (seed 0) with a 4096-wide MLP and the byte tokenizer: a 6.2 MiB checkpoint,
    so the middle of its tensors lies past the first and last MiB (all the old fingerprint read)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvtier.computesvc.model import seed_weights
    from kvtier.tokenizer import build_byte_tokenizer

    config = LlamaConfig(**{**TINY_LLAMA_CONFIG, "intermediate_size": 4096}, attn_implementation="eager")
    path = tmp_path_factory.mktemp("wide-llama")
    seed_weights(LlamaForCausalLM(config), 0).save_pretrained(path)
    build_byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def model(wide_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the wide model to change, and a digest cache of this test's own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return Path(shutil.copytree(wide_model_dir, tmp_path / "model"))


def poke_middle(model_dir: Path, value: int = 0x42) -> int:
    """Set one byte in the middle of ``TENSOR`` in ``model_dir``'s safetensors file: the high byte
    (sign and exponent) of its middle float32, so that weight becomes 32..128. Size, mtime and
    the first and last MiB stay as they were. Returns the byte it replaced."""
    file = model_dir / "model.safetensors"
    before = file.stat()
    with open(file, "r+b") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        begin, end = json.loads(f.read(header_len))[TENSOR]["data_offsets"]
        offset = 8 + header_len + (begin + end) // 2 // 4 * 4 + 3
        assert MIB < offset < before.st_size - MIB
        f.seek(offset)
        (old,) = f.read(1)
        f.seek(offset)
        f.write(bytes([value]))
    os.utime(file, ns=(before.st_atime_ns, before.st_mtime_ns))  # the same size and mtime
    assert old != value
    return old


def test_one_byte_changed_in_the_middle_of_a_tensor_changes_the_fingerprint(model):
    original = ModelShape.from_model_dir(model).fingerprint
    old = poke_middle(model)
    assert ModelShape.from_model_dir(model).fingerprint != original
    poke_middle(model, old)  # the same bytes again: the same fingerprint
    assert ModelShape.from_model_dir(model).fingerprint == original


def test_tokenizer_files_count_and_volatile_config_keys_do_not(model):
    original = ModelShape.from_model_dir(model).fingerprint
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "transformers_version": "0.0.1"}))
    assert ModelShape.from_model_dir(model).fingerprint == original
    tokenizer = model / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text() + "\n")  # one byte more
    assert ModelShape.from_model_dir(model).fingerprint != original


def model_files(model: Path) -> list[Path]:
    return sorted(p for p in model.iterdir() if p.suffix == ".safetensors" or p.name.startswith("tokenizer"))


def test_a_restart_of_an_unchanged_model_reads_every_digest_from_the_cache(model, caplog):
    files = model_files(model)
    with caplog.at_level(logging.INFO, logger="kvtier.model"):
        first = ModelShape.from_model_dir(model)
        again = ModelShape.from_model_dir(model)
    lines = [r.getMessage() for r in caplog.records if "fingerprinted" in r.getMessage()]
    assert f"{len(files)} hashed" in lines[0] and "GiB/s" in lines[0], lines
    assert f": {len(files)} from the digest cache" in lines[1], lines
    assert again == first
    digests, report = file_digests(files)
    assert report.hashed_files == 0 and report.files == len(files)
    os.utime(files[0])  # a new mtime and ctime: that file alone is hashed again
    again_digests, report = file_digests(files)
    assert again_digests == digests and report.hashed_files == 1


def cache_file(tmp_path: Path) -> Path:
    return tmp_path / "xdg" / "kvtier" / CACHE_FILE_NAME


@pytest.mark.parametrize("damage", ["garbage", "tampered digest", "truncated"])
def test_a_corrupt_digest_cache_is_ignored_and_rewritten(model, tmp_path, caplog, damage):
    files = model_files(model)
    digests, _ = file_digests(files)
    path = cache_file(tmp_path)
    if damage == "garbage":
        path.write_bytes(os.urandom(200))
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:-40])
    else:  # another digest under a file's identity, the checksum left as it was
        data = json.loads(path.read_text())
        next(iter(data["entries"].values()))["blake3"] = "0" * 64
        path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="kvtier.model"):
        again, report = file_digests(files)
    assert again == digests and report.hashed_files == len(files)
    assert f"digest cache {path} ignored" in caplog.text
    assert file_digests(files)[1].hashed_files == 0  # rewritten whole


def test_an_unusable_cache_directory_still_fingerprints(model, tmp_path, monkeypatch):
    expected = ModelShape.from_model_dir(model).fingerprint
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # kvtier/ cannot be made under a file
    assert ModelShape.from_model_dir(model).fingerprint == expected
    _, report = file_digests(model_files(model))
    assert report.hashed_files == len(model_files(model)) and report.cache_note.startswith("not used")


COUNT_HASHED = """
import sys
from pathlib import Path
from kvtier.file_digests import file_digests
print(file_digests([Path(p) for p in sys.argv[1:]])[1].hashed_files)
"""


def test_processes_started_together_hash_each_file_once(model, tmp_path):
    """A stack's three processes fingerprint the same model at once: one hashes, the others wait
    on the cache's lock and read its digests."""
    files = [str(p) for p in model_files(model)]
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", COUNT_HASHED, *files], env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    counts = [int(p.communicate(timeout=120)[0]) for p in procs]
    assert sorted(counts) == [0, 0, len(files)]


def test_a_lock_held_for_good_slows_a_start_but_never_hangs_it(model, tmp_path, monkeypatch):
    """A process stopped while it holds the digest cache's lock: the next one hashes on its own."""
    files = model_files(model)
    expected, _ = file_digests(files)
    monkeypatch.setattr("kvtier.file_digests.LOCK_WAIT_S", 0.5)
    with open(cache_file(tmp_path).with_suffix(".lock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        digests, report = file_digests(files)
    assert digests == expected and "lock was held" in report.cache_note


def test_a_restart_after_one_byte_of_a_tensor_changed_serves_nothing_the_old_weights_wrote(model, tmp_path):
    """Before the fix, the stack over the changed weights served the prompt's 6 blocks from the
    old records (same size, same first and last MiB: the same fingerprint)."""
    rng = random.Random(7)
    long_prompt = [rng.randrange(256) for _ in range(6 * BS + 4)]
    fillers = [[rng.randrange(256) for _ in range(14 * BS)] for _ in range(3)]
    disk = tmp_path / "kv-disk"
    # The host cache is on (the default): "through" writes each block it takes to disk at once.
    cache_args = ["--model", str(model), "--num-blocks", "24", "--disk-path", str(disk)]
    cache_args += ["--disk-write-policy", "through"]

    def stack(name: str):
        run_dir = tmp_path / name
        env = child_env(run_dir, XDG_CACHE_HOME=str(tmp_path / "xdg"))
        return local_stack(run_dir, cache_args, ["--model", str(model)], replicas=1, env=env)

    with stack("old") as old:
        (first,) = LOOP.complete(old.compute_addresses, [greedy_request(long_prompt, 8)])
        LOOP.complete(old.compute_addresses, [greedy_request(f, 1) for f in fillers])  # evict it to disk
        records = record_paths(disk, long_prompt, ModelShape.from_model_dir(model).fingerprint)
        wait_until(
            lambda: all(p.exists() for p in records) and disk_drained(cache_stats(old).tiers),
            60.0,
            "records indexed",
        )
        (again,) = LOOP.complete(old.compute_addresses, [greedy_request(long_prompt, 8)])
        assert again.cached_prompt_tokens == 6 * BS and again.token_ids == first.token_ids  # served from disk
    poke_middle(model)
    with stack("new") as new:
        stale, fresh = LOOP.complete(
            new.compute_addresses,
            [greedy_request(long_prompt, 8), greedy_request(long_prompt, 8, cache_salt="fresh")],
        )
        disk_tier = {t.medium: t for t in cache_stats(new).tiers}["disk"]
        log = new.cache.log()
    assert stale.cached_prompt_tokens == 0 and disk_tier.num_hit_blocks == 0
    assert fresh.cached_prompt_tokens == 0 and stale.token_ids == fresh.token_ids
    assert fresh.token_ids != first.token_ids  # the byte changed what the model computes
    assert log.count("written for another pool (model_fingerprint") >= 6, log[-3000:]
