"""A cache-service client run as its own process (spawned, never forked) by the tests.

It attaches, maps the pool, allocates one sequence, writes `--fill` into every element of its
blocks (all layers, K and V), commits, prints one JSON line, then (with --hold) keeps its lease
alive until stdin closes or it is killed.
"""

import argparse
import json
import sys

import torch  # noqa: F401  (imported before attaching: it is slow, and the lease TTL is short)

from kvtier.cache_client import AllocateItem, CacheClient
from kvtier.pool import attach_pool


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--prompt", required=True, help="comma-separated token ids")
    p.add_argument("--fill", type=float, required=True)
    p.add_argument("--salt", default="")
    p.add_argument("--hold", action="store_true", help="heartbeat until stdin closes")
    args = p.parse_args()
    prompt = [int(t) for t in args.prompt.split(",")]

    client = CacheClient.connect(args.address)
    client.attach("writer")
    stop = client.start_heartbeat_thread()
    pool = attach_pool(client.pool)
    seq = client.allocate([AllocateItem(prompt, tenant_salt=args.salt)])[0]
    for block_id in seq.block_table:
        pool.tensor[block_id].fill_(args.fill)
    client.commit([(seq.sequence_id, [], len(prompt))])
    print(
        json.dumps(
            {
                "sequence_id": seq.sequence_id,
                "block_table": list(seq.block_table),
                "lease_id": client.lease_id,
            }
        ),
        flush=True,
    )
    if args.hold:
        sys.stdin.read()
    stop.set()


if __name__ == "__main__":
    main()
