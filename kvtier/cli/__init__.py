"""The `kvtier` command: start and stop a local stack (`kvtier up` / `down`, several nodes with
`--nodes`), run the demo workload, generate, read stats, and pass `cache` / `compute` / `serve`
through to the services.

Apart from `kvtier/` on purpose: `kvtier/` holds what the services and their clients share (the
wire contract, the clients, server plumbing, the block-hash chain, the pool); this package is a
user of all of it, as an operator's tool, and nothing in the services imports it but the
gateway, which reads a running stack's `stack.json` (`kvtier.cli.stack_file`) to find its
replicas.
"""
