"""kvtier: a KV-cache tier for LLM inference, run as its own service apart from compute.

Everything installs under this one import name: the design's folders `cachesvc/`, `computesvc/`,
`kernels/` and `gateway/` are the packages `kvtier.cachesvc`, `kvtier.computesvc`,
`kvtier.kernels` and `kvtier.gateway` (pyproject's package-dir), so kvtier installs beside
Hugging Face's `kernels`, transformers and vLLM without shadowing any of them.
"""

import os
import sys

__version__ = "0.1.0"


def _keep_checkout_root_off_sys_path() -> None:
    """NOTE: a process started in a source checkout (`python -m kvtier.cachesvc` or pytest in
    the repository root) has the root on sys.path, where the folder `kernels/` would be found as
    the top-level `kernels` that transformers imports (Hugging Face's). Those folders are ours
    only as `kvtier.*`, so the root leaves sys.path as soon as kvtier is imported. Only a
    checkout's root (it holds pyproject.toml and cachesvc/); never an installed site-packages."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not (
        os.path.isfile(os.path.join(root, "pyproject.toml")) and os.path.isdir(os.path.join(root, "cachesvc"))
    ):
        return
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]


_keep_checkout_root_off_sys_path()
