"""The block-manager lifecycle of two trees in ONE process: a git revision against the working tree.

``bench/block_manager.py`` measures one tree. Comparing two trees by running it twice, one
after the other, compares two machines as much as two trees here: the speed of this shared VM
drifts by 2x within a minute. This benchmark imports both trees' ``cachesvc`` and ``kvtier``
into one process (each under its own package name: ``before_cachesvc``, ``after_cachesvc``, ...)
and runs the same trace through both, taking turns every ``--chunk`` lifecycles, each with its
own table; every lifecycle's best of ``--repeats`` runs counts, as in ``block_manager.py``.

The lifecycle and trace are ``block_manager.py``'s "prefix caching" mode (1k-token prompts,
half of them a Zipf-popular shared prefix, 64 one-token extends, one commit, one free, events
drained). Hashing is the same code in both trees and is not subtracted: the totals differ by
what the trees do differently.

    python bench/block_manager_ab.py --before 24f705e          # vs the tree before the redesign
    python bench/block_manager_ab.py --before HEAD~1 --quick
    python bench/block_manager_ab.py --before a015991 --quick --tiers   # after with a host cache
    python bench/block_manager_ab.py --before 5c4e68f --tiers   # issue 32's base: top-level cachesvc
    python bench/block_manager_ab.py --before 5c4e68f --tiers both   # both trees with a host cache

``--tiers`` builds the after tree's lower tiers (issue 22: a host cache of ``--host-slots`` slots
of 64 bytes under a pool of 64-byte rows, no disk): every eviction copies the block down, every
miss past the device's hit asks the host cache, and the host tier's events are drained with the
device's, as the node does. The run reports how many blocks were promoted from the host (the
tiers' cost with no lower-tier hit is the target: 0 promoted, or the count says otherwise).
That is the host cache's whole cost against a tree without one. ``--tiers both`` gives the before
tree its own host cache too (its ``LowerTiers`` over a ``HostBlockCache`` before issue 32, its
``TierStack`` after): the after tree's cost with tiers on, against the before tree's, doing the
same work (the same blocks stored, evicted and promoted: both counts are printed).

The last line is the headline: after vs before, µs per lifecycle.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent

from block_manager import FINGERPRINT, VOCAB, Runner, Trace, make_trace, parse_args, salts  # noqa: E402

PACKAGES = ("cachesvc", "kvtier")
PHASES = ("allocate", "extend", "commit", "free", "events")


def export_tree(rev: str | None, prefix: str, dest: Path) -> None:
    """Write ``rev``'s packages (None: the working tree's) under ``dest`` as ``{prefix}_{pkg}``,
    their imports of each other renamed to match. Both layouts: a tree before the namespace move
    imports ``cachesvc`` and ``kvtier`` at the top level; one after it imports ``kvtier.cachesvc``
    (the folder ``cachesvc/`` installed as a subpackage): either way ``cachesvc/`` becomes
    ``{prefix}_cachesvc`` and ``kvtier/`` ``{prefix}_kvtier``."""
    for pkg in PACKAGES:
        target = dest / f"{prefix}_{pkg}"
        if rev is None:
            shutil.copytree(REPO / pkg, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            target.mkdir()
            archive = subprocess.run(
                ["git", "-C", str(REPO), "archive", "--format=tar", rev, pkg], check=True, capture_output=True
            ).stdout
            subprocess.run(
                ["tar", "-x", "--strip-components=1", "-C", str(target)], input=archive, check=True
            )
    namespaced = re.compile(r"\bkvtier\.cachesvc\b")  # after the move: kvtier.cachesvc is cachesvc/
    imports = re.compile(rf"\b(from|import) ({'|'.join(PACKAGES)})\b")
    for path in dest.glob(f"{prefix}_*/**/*.py"):
        text = namespaced.sub(f"{prefix}_cachesvc", path.read_text())
        path.write_text(imports.sub(rf"\1 {prefix}_\2", text))


def _item_type(prefix: str, sequences):
    """A tree's allocate item type: kvtier.sequence_types.AllocateItem since issue 21,
    cachesvc.records.AllocateItem since the redesign, sequences.AllocateSpec before it."""
    for module in (f"{prefix}_kvtier.sequence_types", f"{prefix}_cachesvc.records"):
        try:
            return importlib.import_module(module).AllocateItem
        except (ImportError, AttributeError):
            pass
    return sequences.AllocateSpec


class Tree(Runner):
    """One tree's table, stepped one lifecycle at a time: ``Runner.lifecycle`` (the same calls,
    clock reads and event drain as block_manager.py) over this tree's classes."""

    def __init__(
        self, prefix: str, args: argparse.Namespace, trace: Trace, no_hits: bool, host_slots: int = 0
    ) -> None:
        self.name = prefix
        self.args = args
        self.trace = trace
        bm = importlib.import_module(f"{prefix}_cachesvc.block_manager")
        sequences = importlib.import_module(f"{prefix}_cachesvc.sequences")
        self.event_log = importlib.import_module(f"{prefix}_cachesvc.events").EventLog
        item = _item_type(prefix, sequences)
        # --no-hits: a salt per request, block_manager.py's "baseline (no hits)" mode. The salt is
        # the second field in every tree (cache_salt, later tenant_salt): passed by position.
        self.items = [item(p, s) for p, s in zip(trace.prompts, salts(args, no_hits), strict=True)]
        self.host_slots = host_slots
        self.lower = None
        if host_slots:  # imported now: the exported trees are deleted once the trees are built
            self.lower_tiers = importlib.import_module(f"{prefix}_cachesvc.lower_tiers")
            self.host_cache = importlib.import_module(f"{prefix}_cachesvc.host_cache")
        self.new_table = lambda lower: sequences.SequenceTable(
            bm.BlockManager(args.num_blocks, args.block_size),
            None,
            model_fingerprint=FINGERPRINT,
            vocab_size=VOCAB,
            max_model_len=args.prompt_len + args.decode + 64,
            **({"lower_tiers": lower} if lower is not None else {}),
        )

    def reset(self) -> None:
        self.lower = self.new_lower_tiers() if self.host_slots else None
        self.table = self.new_table(self.lower)
        self.events = self.event_log(self.args.block_size)
        if self.lower is not None:  # drain the host tier's events with the device's, as the node does
            bm, lower = self.table.block_manager, self.lower
            device_records = bm.take_event_records
            bm.take_event_records = lambda: device_records() + lower.take_event_records()

    def new_lower_tiers(self):
        """A host cache of ``host_slots`` 64-byte slots under a pool of 64-byte rows (no disk): the
        tier stack (issue 32) or, in a tree before it, LowerTiers over a HostBlockCache."""
        import torch

        rows = torch.zeros((self.args.num_blocks, 64), dtype=torch.uint8)
        if hasattr(self.lower_tiers, "TierStack"):
            return self.lower_tiers.TierStack(rows, [self.host_cache.HostCache(self.host_slots, 64)])
        return self.lower_tiers.LowerTiers(rows, self.host_cache.HostBlockCache(self.host_slots, 64), None)

    def host_figures(self) -> tuple[int, int, int]:
        """The last run's host cache: blocks stored, evicted, promoted (lower-tier hits)."""
        if hasattr(self.lower, "tiers"):
            c = self.lower.tiers[0].counts()
            return c.stored, c.evictions, c.promotions
        host = self.lower.host.stats()
        return host["stored"], host["evictions"], self.lower.promoted["host"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="git revision of the 'before' tree (e.g. 24f705e)")
    ap.add_argument("--after", help="git revision of the 'after' tree (default: the working tree)")
    ap.add_argument("--repeats", type=int, default=10, help="runs; each lifecycle's best counts")
    ap.add_argument("--chunk", type=int, default=20, help="lifecycles per turn")
    ap.add_argument("--quick", action="store_true", help="300 sequences (default 2000)")
    ap.add_argument("--no-hits", action="store_true", help="a cache_salt per request: nothing hits")
    ap.add_argument(
        "--tiers", nargs="?", const="after", choices=("after", "both"),
        help="the after tree with a host cache; 'both': both trees, each its own (module docstring)",
    )  # fmt: skip
    ap.add_argument("--host-slots", type=int, default=4096, help="--tiers: the host cache's slots (blocks)")
    ours = ap.parse_args(argv)
    args = parse_args(["--quick"] if ours.quick else [])
    trace = make_trace(args)
    with tempfile.TemporaryDirectory() as tmp:
        export_tree(ours.before, "before", Path(tmp))
        export_tree(ours.after, "after", Path(tmp))
        sys.path.insert(0, tmp)
        host_slots = {"before": ours.host_slots if ours.tiers == "both" else 0}
        host_slots["after"] = ours.host_slots if ours.tiers else 0
        trees = [Tree(name, args, trace, ours.no_hits, host_slots[name]) for name in ("before", "after")]
    n = args.sequences
    print(
        f"before = {ours.before}, after = {ours.after or 'working tree'}; {n} lifecycles of "
        f"{args.prompt_len}-token prompts ({'no prefix hits' if ours.no_hits else 'about half a shared prefix'}), "
        f"{args.decode} extends; turns of {ours.chunk}, best of {ours.repeats}"
        + (f"; {ours.tiers} with a host cache of {ours.host_slots} blocks" if ours.tiers else "")
    )
    best = {t.name: np.full((n, len(PHASES)), np.iinfo(np.int64).max, np.int64) for t in trees}
    for rep in range(ours.repeats):
        for t in trees:
            t.reset()
        order = trees if rep % 2 == 0 else trees[::-1]
        gc.collect()
        gc.freeze()
        for first in range(0, n, ours.chunk):
            for t in order:
                b = best[t.name]
                for k in range(first, min(first + ours.chunk, n)):
                    b[k] = np.minimum(b[k], t.lifecycle(k)[0])
        gc.unfreeze()
    clock_ns = min(-time.perf_counter_ns() + time.perf_counter_ns() for _ in range(2000))
    totals = {}
    print(f"{'tree':<7} {'µs/life':>8} {'alloc':>7} {'extend':>7} {'commit':>7} {'free':>6} {'events':>6}")
    for t in trees:
        parts = (best[t.name] - clock_ns).clip(min=0).sum(axis=0) / n / 1e3
        totals[t.name] = parts.sum()
        print(
            f"{t.name:<7} {parts.sum():>8.1f} {parts[0]:>7.1f} {parts[1] / args.decode:>7.3f} "
            f"{parts[2]:>7.1f} {parts[3]:>6.1f} {parts[4]:>6.1f}"
        )
    print("(extend: µs per call; the rest µs per lifecycle; hashing included, the same code in both)")
    for t in trees:
        if t.lower is not None:  # the last repeat's table
            stored, evicted, promoted = t.host_figures()
            print(
                f"{t.name}'s host cache, last run: {stored} blocks stored, {evicted} evicted, "
                f"{promoted} promoted (lower-tier hits)"
            )
    after, before = totals["after"], totals["before"]
    print(
        f"headline: after {after:.1f} vs before {before:.1f} µs per lifecycle, after/before {after / before:.3f}"
    )


if __name__ == "__main__":
    main()
