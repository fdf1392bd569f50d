"""kvtier as vLLM's KV cache tier: a vLLM KV connector over the cache service.

vLLM loads ``kvtier.vllm.connector.KvtierConnector`` by module path (``--kv-transfer-config
'{"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.vllm.connector", ...}'``).
Nothing here imports vLLM until the connector module is imported, so the rest of kvtier never
pays for it. The path of one request is described in docs/architecture.md ("vLLM's KV connector").

- ``config``        the connector's settings: ``kv_connector_extra_config``, then the environment
- ``cache_link``    one lease on the cache service: attach, heartbeat, re-attach after an outage
- ``engine_check``  the engine against the pool (model, layers, heads, head size, dtype, block size)
- ``block_layout``  vLLM's KV block layout, learned from its own attention write; batched copies
- ``transfers``     a load (hit -> vLLM blocks) and a save (vLLM blocks -> pool), plain data
- ``plan``          the per-step metadata the scheduler side hands the workers (loads, saves)
- ``lookups``       scheduler side: which leading blocks the cache holds, off the scheduler's thread
- ``block_index``   the cache's block events followed (on by default): sure misses answered without a call
- ``worker``        worker side: hits copied in; new full blocks staged out, written and committed
- ``connector``     the ``KVConnectorBase_V1`` itself, routing vLLM's calls to the two sides
"""

# NOTE: a child of vLLM's "vllm" logger, the one logger vLLM's processes give a handler (it does
# not propagate to the root): so the connector's INFO and WARNING lines land in vLLM's own log.
LOGGER = "vllm.kvtier"
