"""Security of the running stack: the shared token on every RPC of both services, lease
ownership, tenant isolation by cache_salt seen from compute, and owner-only files.

Builds on tests/test_cache_service.py (token refusal of Attach/GetStats, ownership for
Free/Extend/Commit/SwapOut, salts in the cache API, the cache socket and segment modes); here
every RPC of both services is refused with a fully valid request, and isolation is checked
end to end through compute's Generate.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import grpc
import pytest
from servers import TOKEN, cache_service, child_env, local_stack, stats_without_clock

from kvtier.api import cache_pb2, compute_pb2, compute_pb2_grpc
from kvtier.auth import bearer, grpc_target
from kvtier.cache_client import CacheClient
from kvtier.cache_errors import CacheCallError
from kvtier.compute_client import ComputeClient
from kvtier.model_spec import TINY_LLAMA_CONFIG

BOS = TINY_LLAMA_CONFIG["bos_token_id"]
BS = 16
CACHE_SERVICE = cache_pb2.DESCRIPTOR.services_by_name["CacheService"]
GENERATE = "/kvtier.v1.ComputeService/Generate"

# Metadata a caller without the token might send; each must be refused.
BAD_METADATA = {
    "no-metadata": (),
    "wrong-token": (("authorization", "Bearer wrong-token"),),
    "token-minus-last-char": (("authorization", f"Bearer {TOKEN[:-1]}"),),
    "token-plus-a-char": (("authorization", f"Bearer {TOKEN}x"),),
    "token-without-bearer": (("authorization", TOKEN),),
    "empty-bearer": (("authorization", "Bearer "),),
    "token-under-another-key": (("x-api-key", f"Bearer {TOKEN}"),),
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # A run dir that does not exist yet: the stack creates it (owner-only) as a user's would be.
    run_dir = tmp_path_factory.mktemp("security") / "run"
    with local_stack(run_dir, ["--num-blocks", "128", "--swap-space", "0.01"], replicas=1) as s:
        yield s


@pytest.fixture(scope="module")
def owner(stack):
    """An attached client holding one sequence on the device and one swapped out."""
    c = CacheClient.connect(stack.cache_address, TOKEN, timeout_s=10.0)
    c.attach("owner")
    stop = c.start_heartbeat_thread()
    on_device, swapped = c.allocate([[3] * 20, [4] * 20])
    c.commit([(on_device.sequence_id, [], 20)])
    c.swap_out([swapped.sequence_id])
    c.held = (on_device.sequence_id, swapped.sequence_id)
    yield c
    stop.set()
    c.free(list(c.held))
    c.close()


def valid_cache_requests(owner: CacheClient) -> dict[str, object]:
    """For every CacheService RPC, a request that succeeds when it carries the token."""
    lease, (seq, swapped) = owner.lease_id, owner.held
    return {
        "Attach": cache_pb2.AttachRequest(client_name="intruder"),
        "Heartbeat": cache_pb2.HeartbeatRequest(lease_id=lease),
        "Allocate": cache_pb2.AllocateRequest(
            lease_id=lease, items=[cache_pb2.AllocateItem(token_ids=[1, 2])]
        ),
        "Extend": cache_pb2.ExtendRequest(
            lease_id=lease, items=[cache_pb2.ExtendItem(sequence_id=seq, num_tokens=1)]
        ),
        "Commit": cache_pb2.CommitRequest(
            lease_id=lease, items=[cache_pb2.CommitItem(sequence_id=seq, num_computed_tokens=20)]
        ),
        "Free": cache_pb2.FreeRequest(lease_id=lease, sequence_ids=[seq]),
        "LookupPrefix": cache_pb2.LookupPrefixRequest(items=[cache_pb2.LookupPrefixItem(token_ids=[3] * 20)]),
        "SwapOut": cache_pb2.SwapOutRequest(lease_id=lease, sequence_ids=[seq]),
        "SwapIn": cache_pb2.SwapInRequest(lease_id=lease, sequence_ids=[swapped]),
        "GetStats": cache_pb2.GetStatsRequest(),
        "WatchEvents": cache_pb2.WatchEventsRequest(since_event_id=0),
        "WatchEventBatches": cache_pb2.WatchEventBatchesRequest(since_event_id=0),
    }


def raw_call(address: str, method, request, metadata) -> list:
    """Call `method` (a MethodDescriptor) with raw metadata; the replies as a list."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    with grpc.insecure_channel(grpc_target(address)) as channel:
        if method.server_streaming:
            call = channel.unary_stream(path, request_serializer=type(request).SerializeToString)
            return list(call(request, metadata=metadata, timeout=10))
        call = channel.unary_unary(path, request_serializer=type(request).SerializeToString)
        return [call(request, metadata=metadata, timeout=10)]


AUTHORIZED = bearer(TOKEN)


def generate(address: str, request: compute_pb2.GenerateRequest, metadata=AUTHORIZED):
    """Replies of one Generate stream (sync channel)."""
    with grpc.insecure_channel(grpc_target(address)) as channel:
        stub = compute_pb2_grpc.ComputeServiceStub(channel)
        return list(stub.Generate(request, metadata=metadata, timeout=60))


# ---------------------------------------------------------------- the token


@pytest.mark.parametrize("metadata", BAD_METADATA.values(), ids=BAD_METADATA.keys())
def test_every_cache_rpc_refuses_a_valid_request_without_the_token_and_changes_nothing(
    stack, owner, metadata
):
    requests = valid_cache_requests(owner)
    assert sorted(requests) == sorted(m.name for m in CACHE_SERVICE.methods), "a new RPC is not covered"
    before = stats_without_clock(owner.get_stats())
    for method in CACHE_SERVICE.methods:
        with pytest.raises(grpc.RpcError) as e:
            raw_call(stack.cache_address, method, requests[method.name], metadata)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, f"{method.name}: {e.value.details()}"
        assert "token" in e.value.details(), method.name
        assert TOKEN not in e.value.details(), f"{method.name} echoes the token"
    assert stats_without_clock(owner.get_stats()) == before


def test_the_valid_requests_succeed_with_the_token(stack, owner):
    # The other side of the refusal test: the same requests are accepted with the token, so the
    # refusal above is the token check and not a bad request. Read-only ones only (state stays).
    requests = valid_cache_requests(owner)
    for name in ("Heartbeat", "LookupPrefix", "GetStats"):
        (reply,) = raw_call(
            stack.cache_address, CACHE_SERVICE.methods_by_name[name], requests[name], bearer(TOKEN)
        )
        assert reply


@pytest.mark.parametrize("metadata", BAD_METADATA.values(), ids=BAD_METADATA.keys())
def test_compute_generate_refuses_a_caller_without_the_token_before_touching_the_cache(
    stack, owner, metadata
):
    request = ComputeClient.request(prompt_token_ids=[BOS, 1, 2, 3], max_tokens=2, temperature=0.0)
    queried = owner.get_stats().prefix_query_tokens
    with pytest.raises(grpc.RpcError) as e:
        generate(stack.compute_addresses[0], request, metadata)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value.details()
    assert "token" in e.value.details()
    assert owner.get_stats().prefix_query_tokens == queried, "a refused Generate reached the cache service"


def test_compute_generate_serves_a_caller_with_the_token(stack):
    replies = generate(
        stack.compute_addresses[0], ComputeClient.request(prompt_token_ids=[BOS, 9], max_tokens=2)
    )
    assert replies[-1].finish_reason and replies[-1].usage.completion_tokens == 2


def test_attach_without_the_token_carries_no_pool_spec_anywhere_in_the_reply(stack, owner):
    shm_name = owner.pool.shm_name
    assert shm_name, "the pool spec names its shared-memory segment"
    path = "/kvtier.v1.CacheService/Attach"
    with grpc.insecure_channel(grpc_target(stack.cache_address)) as channel:
        attach = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
        request = cache_pb2.AttachRequest(client_name="intruder").SerializeToString()
        # With the token, the raw reply bytes carry the segment name ...
        reply, _ = attach.with_call(request, metadata=bearer(TOKEN), timeout=10)
        assert shm_name.encode() in reply
        # ... without it, no reply message at all, and neither metadata nor details name the pool.
        with pytest.raises(grpc.RpcError) as e:
            attach.with_call(request, timeout=10)
    error = e.value
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    leaked = repr(
        (error.details(), error.initial_metadata(), error.trailing_metadata(), error.debug_error_string())
    )
    for secret in (shm_name, owner.pool.model_fingerprint, "cpu-shm", "shape"):
        assert secret not in leaked, f"a refused Attach reveals {secret!r}: {leaked}"


def test_a_cache_started_without_a_token_writes_an_owner_only_token_file_and_accepts_only_it(tmp_path):
    env = {k: v for k, v in child_env(tmp_path).items() if k != "KVTIER_TOKEN"}
    with cache_service(tmp_path, "--num-blocks", "4", env=env) as svc:
        token_file = tmp_path / "token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert token_file.stat().st_uid == os.getuid()
        token = token_file.read_text().strip()
        assert len(token) >= 32 and token != TOKEN
        c = CacheClient.connect(svc.address, token)
        c.attach("local")
        c.close()
        intruder = CacheClient.connect(svc.address, TOKEN)
        with pytest.raises(CacheCallError) as e:
            intruder.attach("intruder")
        assert e.value.code == "UNAUTHENTICATED"
        intruder.close()


# ---------------------------------------------------------------- leases


def test_another_lease_cannot_swap_in_a_sequence_and_stats_never_reveal_a_usable_lease_id(stack, owner):
    other = CacheClient.connect(stack.cache_address, TOKEN, timeout_s=10.0)
    other.attach("other")
    try:
        on_device, swapped = owner.held
        before = stats_without_clock(owner.get_stats())
        for name, call in {
            "swap_in": lambda: other.swap_in([swapped]),
            "free a swapped-out sequence": lambda: other.free([swapped]),
            "commit": lambda: other.commit([(on_device, [5], 20)]),
        }.items():
            with pytest.raises(CacheCallError) as e:
                call()
            assert e.value.code == "PERMISSION_DENIED", name
            assert owner.lease_id[:8] not in e.value.details, f"{name}: the refusal names the owner's lease"
        assert stats_without_clock(owner.get_stats()) == before

        # GetStats shows each lease by an 8-hex-digit prefix (32 of its 128 bits): not enough to act.
        shown = [lease.lease_id for lease in owner.get_stats().leases]
        assert owner.lease_id[:8] in shown and owner.lease_id not in shown
        assert all(len(lease_id) == 8 for lease_id in shown)
        shown_lease = CacheClient.connect(stack.cache_address, TOKEN, timeout_s=10.0)
        shown_lease.lease_id = owner.lease_id[:8]  # what GetStats shows of the owner's lease
        try:
            with pytest.raises(CacheCallError) as e:
                shown_lease.free([on_device])
        finally:
            shown_lease.close()
        assert e.value.code == "NOT_FOUND"
        assert stats_without_clock(owner.get_stats()) == before
    finally:
        other.close()


# ---------------------------------------------------------------- tenants


def test_tenants_with_different_cache_salt_never_share_cached_blocks_through_compute(stack, owner):
    prompt = [BOS, *range(100, 139)]  # 40 tokens: two full blocks a hit may cover
    address = stack.compute_addresses[0]

    def cached(salt: str) -> int:
        request = ComputeClient.request(
            prompt_token_ids=prompt, max_tokens=2, temperature=0.0, cache_salt=salt
        )
        return generate(address, request)[-1].usage.cached_prompt_tokens

    def looked_up(salt: str) -> int:
        return owner.lookup_prefix([prompt], tenant_salt=salt)[0].num_cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") == 2 * BS, "the same tenant hits its own prompt"
    assert looked_up("tenant-a") == 2 * BS
    # Another tenant, and the default (no salt) tenant, see nothing of tenant-a's prompt.
    assert looked_up("tenant-b") == 0 and looked_up("") == 0
    assert cached("tenant-b") == 0
    assert cached("") == 0
    assert cached("tenant-b") == 2 * BS, "tenant-b's own blocks are cached for tenant-b"


# ---------------------------------------------------------------- files


def test_both_services_sockets_the_run_dir_and_the_pool_segment_are_owner_only(stack, owner):
    run_dir = Path(stack.run_dir)
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    for address in (stack.cache_address, *stack.compute_addresses):
        sock = Path(address[len("unix://") :])
        assert stat.S_ISSOCK(sock.stat().st_mode), address
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600, f"{address}: {oct(sock.stat().st_mode)}"
        assert sock.stat().st_uid == os.getuid()
    segment = Path("/dev/shm") / owner.pool.shm_name
    assert stat.S_IMODE(segment.stat().st_mode) == 0o600
    assert segment.stat().st_uid == os.getuid()
