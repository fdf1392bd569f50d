"""What every layer of one decode step reads, worked out once per step (the torch path).

`plan_decode` turns the step's block tables and lengths (host lists, which the model runner has
anyway) into the tensors `reference.paged_decode_attention_ref` uses in every layer: the blocks
each sequence reads and the mask of the positions it sees among them. Without a plan that function
builds one per call, from the tensors; a plan is only an optimisation and changes no result
beyond float rounding.

Shared prefixes (cascade attention): sequences whose tables begin with the same full blocks (a
prompt prefix the cache service handed to each of them) form a group, and each layer attends
the group's prefix once, with the query heads of all its members as one batch of queries,
then each sequence's own blocks, and merges the two softmaxes by their log-sum-exp. 64
sequences over 8 shared 512-token prompts then gather 8 x 16 prefix blocks a layer instead
of 64 x 16 (bench/README.md, "Compute against vLLM's CPU engine").
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# A group needs at least this many whole blocks in common; the split pays off (an extra SDPA call
# and the merge in every layer) when the groups spare at least MIN_SPARED_BLOCKS block reads.
MIN_SHARED_BLOCKS = 2
MIN_SPARED_BLOCKS = 16


@dataclass(frozen=True)
class SharedPrefixes:
    """Groups of sequences over the same leading blocks, padded to `members` rows of `blocks`.

    ids: [groups * blocks] block ids of each group's prefix (a shorter prefix padded with its
    first block). bias: [groups, 1, 1, blocks * block_size] float32, 0 where a group's prefix
    has a key and -inf on padding; None when every prefix has `blocks` blocks. rows: [groups *
    members] the sequence whose queries fill each row (padding rows repeat a member). real:
    [num_real] the rows that are not padding; seqs: [num_real] their sequences."""

    ids: torch.Tensor
    bias: torch.Tensor | None
    rows: torch.Tensor
    real: torch.Tensor
    seqs: torch.Tensor
    groups: int
    members: int
    blocks: int


@dataclass(frozen=True)
class DecodePlan:
    """The reads of one decode step. lens: each sequence's context length (0: a padding row).
    ids: [num_seqs * n] the blocks each sequence reads itself (after its group's shared prefix,
    if any), sequence-major, padded with block 0. bias: [num_seqs, 1, 1, n * block_size]
    float32, 0 on the positions among them the sequence sees, -inf elsewhere (an additive mask:
    SDPA would turn a boolean one into it in every layer). shared: the groups' prefixes, or
    None. alone_empty: with groups, [num_seqs, 1, 1] bool, the sequences that see none of their
    own blocks (all in the prefix), or None."""

    lens: list[int]
    ids: torch.Tensor
    bias: torch.Tensor
    shared: SharedPrefixes | None
    alone_empty: torch.Tensor | None = None


class DecodePlans:
    """The plans of one decode step, one per window size its layers use, made on first use:
    `tables` / `lens` as `plan_decode` takes them, `num_blocks` the pool's."""

    def __init__(
        self, tables: list[list[int]], lens: list[int], block_size: int, device: torch.device, num_blocks: int
    ):
        self.tables, self.lens, self.block_size = tables, lens, block_size
        self.device, self.num_blocks = device, num_blocks
        self.plans: dict[int | None, DecodePlan] = {}

    def get(self, window: int | None) -> DecodePlan:
        plan = self.plans.get(window)
        if plan is None:
            plan = plan_decode(self.tables, self.lens, self.block_size, self.device, window, self.num_blocks)
            self.plans[window] = plan
        return plan


def plan_decode(
    tables: list[list[int]],
    lens: list[int],
    block_size: int,
    device: torch.device | str = "cpu",
    window: int | None = None,
    num_blocks: int | None = None,
    min_spared_blocks: int = MIN_SPARED_BLOCKS,
) -> DecodePlan:
    """The plan of a decode step: `tables[i]` the block ids of sequence i (entries past its
    length ignored), `lens[i]` its context length with the new token (0: padding row). With a
    sliding `window` (tokens) a sequence reads only its last `window` positions and no group is
    formed. `num_blocks` (the pool's) clamps the placeholder ids a table may hold for blocks
    wholly before a window (any value: they are read, then masked). Shared prefixes are split
    out only when their groups spare at least `min_spared_blocks` block reads."""
    max_len = max(lens, default=0)
    lows = [max(0, n - window) if window else 0 for n in lens]
    shared = None
    if not window and device_has_lse_attention(device):
        shared, starts = _shared_prefixes(tables, lens, block_size, device, min_spared_blocks)
    if shared is None:  # every sequence reads from the block holding the earliest window start
        starts = [min(lows, default=0) // block_size] * len(lens)
    ends = [-(-n // block_size) for n in lens]
    width = max((end - start for start, end in zip(starts, ends, strict=True)), default=0)
    width = max(width, 1) if max_len else 0
    rows = []
    for table, start, end in zip(tables, starts, ends, strict=True):
        row = table[start:end]  # entries past the sequence's length are never read
        rows.append(row + [0] * (width - len(row)))
    # A window's placeholders (ids before a sequence's own window start) are read but masked.
    ids = (
        torch.tensor(rows, dtype=torch.long)
        .reshape(-1)
        .clamp_(0, None if num_blocks is None else num_blocks - 1)
    )
    base = torch.tensor([start * block_size for start in starts], dtype=torch.long)[:, None]
    pos = base + torch.arange(width * block_size)[None, :]
    visible = (pos < torch.tensor(lens, dtype=torch.long)[:, None]) & (pos >= torch.tensor(lows)[:, None])
    bias = additive_mask(visible)[:, None, None, :].to(device)
    if shared is None:
        return DecodePlan(lens, ids.to(device), bias, None)
    empty = ~visible.any(1)
    alone_empty = empty[:, None, None].to(device) if empty.any() else None
    return DecodePlan(lens, ids.to(device), bias, shared, alone_empty)


def additive_mask(visible: torch.Tensor) -> torch.Tensor:
    """A boolean visibility mask as an additive float32 one (0 where visible, -inf elsewhere), on
    its device: SDPA would turn a boolean mask into this on every call."""
    return torch.zeros(visible.shape, device=visible.device).masked_fill_(~visible, float("-inf"))


def device_has_lse_attention(device: torch.device | str) -> bool:
    """Whether the shared-prefix merge can run here: it needs the log-sum-exp that SDPA's CPU
    flash kernel returns (`aten::_scaled_dot_product_flash_attention_for_cpu`)."""
    return torch.device(device).type == "cpu"


def _shared_prefixes(
    tables: list[list[int]], lens: list[int], block_size: int, device: torch.device | str, min_spared: int
) -> tuple[SharedPrefixes | None, list[int]]:
    """Group sequences by their first block; a group keeps the blocks all its members hold
    whole (every member sees all their positions). Returns the groups and, per sequence, how
    many leading blocks its group reads for it (0 outside any group)."""
    by_first: dict[int, list[int]] = {}
    for seq, (table, n) in enumerate(zip(tables, lens, strict=True)):
        if n // block_size >= MIN_SHARED_BLOCKS:
            by_first.setdefault(table[0], []).append(seq)
    groups: list[tuple[list[int], int]] = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        whole = min(lens[seq] // block_size for seq in members)
        common = os.path.commonprefix([tables[seq][:whole] for seq in members])
        if len(common) >= MIN_SHARED_BLOCKS:
            groups.append((members, len(common)))
    skips = [0] * len(lens)
    if not groups or sum((len(members) - 1) * p for members, p in groups) < max(min_spared, 1):
        return None, skips
    blocks = max(p for _, p in groups)  # every group's prefix is padded to the longest
    seats = max(len(members) for members, _ in groups)  # and its rows to the largest group's
    ids, rows, real, seqs, prefix_blocks = [], [], [], [], []
    for g, (members, p) in enumerate(groups):
        prefix = tables[members[0]][:p]
        ids += prefix + [prefix[0]] * (blocks - p)
        prefix_blocks.append(p)
        for slot in range(seats):
            rows.append(members[slot] if slot < len(members) else members[0])
        real += [g * seats + slot for slot in range(len(members))]
        seqs += members
        for seq in members:
            skips[seq] = p
    bias = None
    if min(prefix_blocks) < blocks:
        keys = torch.arange(blocks * block_size)[None, :] < torch.tensor(prefix_blocks)[:, None] * block_size
        bias = additive_mask(keys)[:, None, None, :].to(device)

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    found = SharedPrefixes(
        tensor(ids), bias, tensor(rows), tensor(real), tensor(seqs), len(groups), seats, blocks
    )
    return found, skips
