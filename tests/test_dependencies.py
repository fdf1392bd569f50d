"""The dependency rule of docs/architecture.md (section 2), checked on the imports themselves.

Every import statement of every module of kvtier's six packages is parsed with ``ast`` (lazy imports
inside functions and type-only ones under ``TYPE_CHECKING`` included: both are dependencies a
reader has to follow), never grepped. The cache service's order is read from the document's own
list, so the document and the code cannot drift apart silently.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Package -> its folder. Everything installs under `kvtier.` (pyproject's package-dir); the
# design's folders keep their places. `kvtier` is the shared core: kvtier/ less cli/, vllm/ and api/.
FOLDERS = {
    "kvtier": "kvtier",
    "kvtier.cachesvc": "cachesvc",
    "kvtier.computesvc": "computesvc",
    "kvtier.kernels": "kernels",
    "kvtier.gateway": "gateway",
    "kvtier.cli": "kvtier/cli",
    "kvtier.vllm": "kvtier/vllm",
}
PACKAGES = tuple(FOLDERS)
# Package -> the packages of ours it may import (itself always allowed).
ALLOWED = {
    "kvtier": set(),
    "kvtier.cachesvc": {"kvtier"},
    "kvtier.computesvc": {"kvtier", "kvtier.kernels"},
    "kvtier.kernels": {"kvtier"},  # the dtype table (kvtier.kv_dtypes) alone; see below
    "kvtier.gateway": {"kvtier", "kvtier.cli"},
    "kvtier.cli": {"kvtier"},
    "kvtier.vllm": {"kvtier"},  # vLLM's connector is a client of the core; nothing of ours imports it
}
# Modules that may import gRPC / protobuf / the generated stubs, per service.
WIRE = {
    "kvtier.cachesvc": {"servicer", "__main__", "wire_limits"},
    "kvtier.computesvc": {"servicer", "__main__"},
}
# gRPC (but not the stubs) is also imported by a replica's clients of the cache service.
GRPC = {
    "kvtier.cachesvc": WIRE["kvtier.cachesvc"],
    "kvtier.computesvc": WIRE["kvtier.computesvc"] | {"remote_cache", "replica"},
}


def package_of(name: str) -> str | None:
    """The package of ours a dotted module name belongs to (the longest prefix), or None."""
    hits = [p for p in PACKAGES if name == p or name.startswith(p + ".")]
    return max(hits, key=len) if hits else None


def dotted_package(path: Path, root: Path = ROOT) -> str:
    """The dotted package a file under ``root`` is imported as (its folder mapped by FOLDERS)."""
    folder = path.relative_to(root).parent.as_posix()
    for package, where in sorted(FOLDERS.items(), key=lambda kv: -len(kv[1])):
        if folder == where or folder.startswith(where + "/"):
            rest = folder[len(where) :].strip("/")
            return ".".join([package, *rest.split("/")]) if rest else package
    return folder.replace("/", ".")


def imported(path: Path, root: Path = ROOT) -> set[str]:
    """Every module name ``path`` imports: ``import a.b`` -> a.b; ``from a import b`` -> a and
    a.b (b may be a module). Relative imports are resolved against the file's package."""
    names: set[str] = set()
    package = dotted_package(path, root)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def modules(package: str) -> list[Path]:
    folder = ROOT / FOLDERS[package]
    if package == "kvtier":  # the core: its own modules, not the cli, the connector or the generated stubs
        return sorted(folder.glob("*.py"))
    return sorted(folder.rglob("*.py"))


def in_package(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_packages_import_only_the_packages_below_them():
    wrong = []
    for package in PACKAGES:
        for path in modules(package):
            for name in imported(path):
                owner = package_of(name)
                if owner and owner != package and owner not in ALLOWED[package]:
                    wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not wrong, "imports against the dependency rule:\n" + "\n".join(sorted(wrong))


def offending(package: str, bad) -> list[str]:
    """ "path imports name" for each import of ``package``'s modules that ``bad(name)`` refuses."""
    return [
        f"{p.relative_to(ROOT)} imports {n}" for p in modules(package) for n in sorted(imported(p)) if bad(n)
    ]


def test_kernels_take_only_the_dtype_table_from_kvtier():
    wrong = offending(
        "kvtier.kernels",
        lambda n: (
            package_of(n) not in (None, "kvtier.kernels")
            and n != "kvtier"
            and not in_package(n, "kvtier.kv_dtypes")
        ),
    )
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("service", ["kvtier.cachesvc", "kvtier.computesvc"])
def test_only_a_service_s_wire_modules_import_grpc_protobuf_and_the_stubs(service):
    wrong = []
    for path in modules(service):
        for name in imported(path):
            if (
                in_package(name, "kvtier.api") or in_package(name, "google.protobuf")
            ) and path.stem not in WIRE[service]:
                wrong.append(f"{path.relative_to(ROOT)} imports {name}")
            if in_package(name, "grpc") and path.stem not in GRPC[service]:
                wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not wrong, f"{service}'s domain must work on plain Python types:\n" + "\n".join(sorted(wrong))


def documented_cache_order() -> list[str]:
    """The module names of docs/architecture.md's "Inside the cache service" list, bottom up."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"Inside the cache service, bottom up.*?```\n(.*?)```", doc, re.S)
    assert block, "docs/architecture.md lost its list of the cache service's modules"
    order = []
    for line in block.group(1).splitlines():
        # "cachesvc/x.py   what it is", or "cachesvc/config.py, __main__.py   ...": names up to the text
        head = re.match(r"((?:cachesvc/)?[\w]+\.py(?:, (?:cachesvc/)?[\w]+\.py)*)", line)
        if head:
            order += [re.sub(r"^cachesvc/|\.py$", "", name) for name in head.group(1).split(", ")]
    return order


def test_each_cache_service_module_imports_only_those_above_it_in_the_document():
    order = documented_cache_order()
    present = {p.stem for p in modules("kvtier.cachesvc")} - {"__init__"}
    assert present <= set(order), (
        f"cachesvc modules missing from docs/architecture.md's list: {sorted(present - set(order))}"
    )
    rank = {name: i for i, name in enumerate(order)}
    wrong = []
    for path in modules("kvtier.cachesvc"):
        if path.stem == "__init__":
            continue
        for name in imported(path):
            parts = name.split(".")
            if (
                parts[:2] == ["kvtier", "cachesvc"]
                and len(parts) > 2
                and rank.get(parts[2], -1) >= rank[path.stem]
            ):
                wrong.append(
                    f"cachesvc/{path.stem}.py imports kvtier.cachesvc.{parts[2]}, listed at or below it"
                )
    assert not wrong, "\n".join(sorted(set(wrong)))


def test_cache_and_compute_services_never_import_each_other():
    wrong = offending("kvtier.cachesvc", lambda n: in_package(n, "kvtier.computesvc"))
    wrong += offending("kvtier.computesvc", lambda n: in_package(n, "kvtier.cachesvc"))
    assert not wrong, "\n".join(wrong)


def test_the_gateway_imports_nothing_from_computesvc():
    wrong = offending("kvtier.gateway", lambda n: in_package(n, "kvtier.computesvc"))
    assert not wrong, "\n".join(wrong)


def test_the_vllm_connector_is_a_client_and_only_it_imports_vllm():
    # The connector reaches the cache service through kvtier.cache_client and the pool through
    # kvtier.pool, never the wire stubs (kvtier.api) or a service's internals; vLLM is imported by
    # kvtier.vllm alone, so no other process of ours pays for (or breaks on) vLLM's import.
    wrong = offending("kvtier.vllm", lambda n: in_package(n, "kvtier.api"))
    for package in PACKAGES:
        if package != "kvtier.vllm":
            wrong += offending(package, lambda n: in_package(n, "vllm"))
    assert not wrong, "\n".join(wrong)


def test_the_parser_sees_every_kind_of_import(tmp_path):
    # The checks above are only as good as `imported`: lazy, type-only and relative imports count.
    path = tmp_path / "cachesvc" / "probe.py"
    path.parent.mkdir()
    path.write_text(
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "import grpc.aio\n"
        "from . import errors\n"
        "from .records import Sequence\n"
        "if TYPE_CHECKING:\n    from kvtier.cachesvc.sequences import SequenceTable\n"
        "def f():\n    from kvtier.api import cache_pb2\n"
    )
    names = imported(path, tmp_path)
    assert {
        "grpc.aio",
        "kvtier.cachesvc.errors",
        "kvtier.cachesvc.records",
        "kvtier.cachesvc.sequences",
        "kvtier.api.cache_pb2",
    } <= names
