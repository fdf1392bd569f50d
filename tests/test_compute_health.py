"""A compute replica's gRPC health tells the truth about whether it can serve."""

from __future__ import annotations

import grpc
from servers import local_stack, wait_until

from kvtier.healthcheck import check


def health(address: str) -> str:
    try:
        return check(address, "kvtier.v1.ComputeService", timeout_s=5.0)
    except grpc.RpcError as e:
        return e.code().name


def test_replica_is_not_serving_while_its_cache_service_is_gone_and_serving_once_reattached(tmp_path):
    with local_stack(tmp_path, ["--num-blocks", "64"], replicas=1) as stack:
        replica = stack.replicas[0].address
        assert health(replica) == "SERVING"
        stack.cache.stop()
        wait_until(lambda: health(replica) == "NOT_SERVING", 60, "replica reports NOT_SERVING")
        assert check(replica) == "NOT_SERVING"  # the whole server too, not only the service
        stack.start_cache()
        wait_until(lambda: health(replica) == "SERVING", 120, "replica reports SERVING after re-attaching")
        assert check(replica) == "SERVING"
