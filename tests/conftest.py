"""Shared pytest fixtures."""

from __future__ import annotations

import os
from pathlib import Path

# NOTE: before grpc is imported (gRPC reads it once): this process forks children that exec at
# once (subprocess.Popen, one with a preexec_fn), and gRPC's fork handlers, with its poller
# threads running, once aborted such a child between fork and exec (SIGABRT, "epoll_wait error:
# Bad file descriptor" in a fresh-clone CI run). No test process uses gRPC across a fork.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

# NOTE: imported here, before any test starts server or heartbeat threads. Twice a run died with
# CPython 3.11.7's "AST constructor recursion depth mismatch" (gh-106905: the AST constructor's
# depth counter is shared state, and threads can upset it) while hypothesis was being loaded
# mid-run; loading it first, single-threaded, takes that window away.
import hypothesis.stateful  # noqa: F401
import hypothesis.strategies  # noqa: F401
import pytest

# NOTE: before any test module imports transformers: `python -m pytest` in the repository root
# puts the root on sys.path, where our `kernels/` folder would shadow Hugging Face's `kernels`
# (transformers imports it). Importing kvtier takes the checkout root off (kvtier/__init__.py).
import kvtier  # noqa: F401


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local Hugging Face model directory holding the built-in tiny Llama (seed 0) and its
    byte tokenizer: config.json, model.safetensors, tokenizer.json, as a downloaded model has."""
    from kvtier.computesvc.model import build_tiny_model
    from kvtier.tokenizer import build_byte_tokenizer

    path = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_model(seed=0).save_pretrained(path)
    build_byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def edge_gateway(tmp_path_factory: pytest.TempPathFactory):
    """A cache service (512 blocks), one compute replica and the gateway (`--api-key
    EDGE_API_KEY`, the default tool-call parser), shared by the tests of the gateway's edge and of
    structured outputs: they only send requests, and none depends on what another cached."""
    from servers import EDGE_API_KEY, child_env

    from kvtier.cli.stack import LocalStack

    run_dir = tmp_path_factory.mktemp("edge-gateway")
    with LocalStack(
        run_dir,
        cache_args=["--num-blocks", "512"],  # the defaults otherwise: the host cache auto
        num_replicas=1,
        env=child_env(run_dir),
        gateway_args=["--api-key", EDGE_API_KEY],
        gateway_port=0,
    ) as stack:
        yield stack


@pytest.fixture(scope="module", autouse=True)
def _close_module_loop(request: pytest.FixtureRequest):
    """Close the module's `LOOP` (a tests/servers.py ModuleLoop) after its last test, if it has one."""
    yield
    loop = getattr(request.module, "LOOP", None)
    if loop is not None:
        loop.close()
