"""bench/ scripts imported by tests, without bench/ on the test process's sys.path.

A script imports its siblings by plain module name (run as a script, its folder is sys.path[0]).
A test that put bench/ on sys.path for good let every later import in the session find
bench's `router`, `tiers`, `swap`, `models`, ... first: one module name would shadow another.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent / "bench"
PREFIX = "bench_"  # bench/x.py is module bench_x here


def bench_script(name: str) -> ModuleType:
    """bench/``name``.py as module ``bench_<name>``, loaded once (also when a script loaded
    earlier imported it). bench/ is on sys.path, and bench's modules are in sys.modules under
    their plain names, only while it loads."""
    key = PREFIX + name
    if key in sys.modules:
        return sys.modules[key]
    path = sys.path[:]
    for k in _bench_modules():  # what earlier loads brought in, for the script's own imports
        sys.modules.setdefault(k.removeprefix(PREFIX), sys.modules[k])
    spec = importlib.util.spec_from_file_location(key, BENCH / f"{name}.py")
    module = sys.modules[key] = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[key]
        raise
    finally:
        sys.path[:] = path  # also what a script put there itself
        for k in _bench_modules():
            if not k.startswith(PREFIX):
                sys.modules[PREFIX + k] = sys.modules.pop(k)
    return module


def _bench_modules() -> list[str]:
    """The names in sys.modules of modules loaded from bench/."""
    return [
        k for k, m in list(sys.modules.items()) if Path(getattr(m, "__file__", None) or "/").parent == BENCH
    ]
