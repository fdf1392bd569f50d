"""What CI and the next person rely on: the README's commands, lint, and the two import traps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    lines = (REPO / "README.md").read_text().splitlines()
    return [line.strip() for line in lines[:2]]


def test_readme_starts_with_the_main_job_and_the_test_command():
    main_job, tests = readme_commands()
    assert main_job.startswith("bash scripts/setup.sh && ") and "kvtier demo" in main_job
    assert tests.startswith("bash scripts/setup.sh && ") and "pytest" in tests


def test_ci_runs_the_readme_test_command():
    _, tests = readme_commands()
    ci = (REPO / ".ci/run").read_text().splitlines()
    assert tests in [line.strip() for line in ci], f".ci/run does not run the README's test command {tests!r}"


def test_ruff_lint_and_format_are_clean():
    ruff = Path(sys.executable).parent / "ruff"
    lint = subprocess.run([ruff, "check", "."], cwd=REPO, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = subprocess.run([ruff, "format", "--check", "."], cwd=REPO, capture_output=True, text=True)
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_the_proto_folder_never_shadows_the_proto_plus_package():
    # proto/ holds .proto files, not a Python package: from the repo root, `import proto` must
    # find the PyPI package proto-plus (a dev dependency), never our folder as a namespace package.
    code = "import proto, sys; print(getattr(proto, '__file__', None)); print(list(getattr(proto, '__path__', [])))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert str(REPO / "proto") not in out.stdout, out.stdout
    assert "site-packages" in out.stdout


# --- sizes: what one reader can hold at once ---------------------------------------------------

SIZED = ("kvtier", "cachesvc", "computesvc", "kernels", "gateway", "bench")  # kvtier/ holds cli/
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 80  # from the `def` line to the last line of the body; decorators not counted


def sized_sources() -> list[Path]:
    """Every .py file of the packages and bench/, less the generated protobuf modules."""
    files = [path for folder in SIZED for path in sorted((REPO / folder).rglob("*.py"))]
    return [path for path in files if "_pb2" not in path.name]


def test_no_source_file_over_450_lines_and_no_function_over_80():
    """argparse builders (functions named build_parser) are exempt: one line per option is their
    clearest form. The message names each offender and its size."""
    import ast

    offenders = []
    for path in sized_sources():
        source = path.read_text()
        where = path.relative_to(REPO)
        if (lines := len(source.splitlines())) > MAX_FILE_LINES:
            offenders.append(f"{where}: {lines} lines (limit {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(source, str(path))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.name == "build_parser":
                continue
            if (length := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                offenders.append(
                    f"{where}:{node.lineno} {node.name}: {length} lines (limit {MAX_FUNCTION_LINES})"
                )
    assert len(sized_sources()) > 100, "the size check found almost no sources: wrong folders?"
    assert not offenders, "over the size limits:\n" + "\n".join(offenders)
