"""dsv4's packages import one way only (DESIGN decision 10).

    utils, assets, tasks -> config -> kernels -> cache -> model -> checkpoint | distributed
        -> engine -> server | train | rl -> cli

Every `import` / `from ... import` in `src/dsv4` (at any depth: inside functions too) is an edge
from the importing package to the imported one; an edge to a higher layer, or between the sibling
top layers (server, train, rl), fails. `TYPE_CHECKING` blocks are not allowed either: they exist to
hide cycles.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "dsv4"

LAYERS: dict[str, int] = {
    "utils": 0, "assets": 0, "tasks": 0,
    "config": 1,
    "kernels": 2,
    "cache": 3,
    "model": 4,
    "checkpoint": 5, "distributed": 5,
    "engine": 6,
    "server": 7, "train": 7, "rl": 7,
    "cli": 8,
}
SIBLINGS_MAY_IMPORT = {"utils", "assets", "tasks"}   # base-layer packages may use each other


def package_of(module: str) -> str | None:
    """The top-level dsv4 package of a dotted module name ('dsv4.model.moe' -> 'model').

    None outside dsv4 or for the package root itself (its public-API re-exports).
    """
    parts = module.split(".")
    if parts[0] != "dsv4" or len(parts) < 2:
        return None
    return parts[1]


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file, relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_name(path, root).split(".")
    is_pkg = path.name == "__init__.py"
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here if is_pkg else here[:-1]
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.append((node.lineno, mod))
    return found


def violations(root: Path = SRC) -> list[str]:
    bad: list[str] = []
    for path in sorted(root.rglob("*.py")):
        if path.parent == root:
            # dsv4/__init__.py (the public API) and __main__.py sit above every layer
            continue
        src_pkg = package_of(module_name(path, root))
        if src_pkg is None:
            continue
        if src_pkg not in LAYERS:
            bad.append(f"{path}: package {src_pkg!r} has no layer in tests/test_layers.py")
            continue
        if "TYPE_CHECKING" in path.read_text():
            bad.append(f"{path}: uses TYPE_CHECKING (a cycle work-around)")
        for line, mod in imported_modules(path, root):
            dst_pkg = package_of(mod)
            if dst_pkg is None or dst_pkg == src_pkg:
                continue
            upward = LAYERS.get(dst_pkg, 99) > LAYERS[src_pkg]
            sideways = (LAYERS.get(dst_pkg) == LAYERS[src_pkg]
                        and not {src_pkg, dst_pkg} <= SIBLINGS_MAY_IMPORT)
            if upward or sideways:
                bad.append(f"{path}:{line}: {src_pkg} (layer {LAYERS[src_pkg]}) imports {mod} "
                           f"(layer {LAYERS.get(dst_pkg, '?')})")
    return bad


def test_layers_import_one_way() -> None:
    bad = violations()
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_every_package_has_a_layer() -> None:
    packages = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages <= set(LAYERS), sorted(packages - set(LAYERS))


@pytest.mark.parametrize("source, expected", [
    ("from dsv4.model.moe import MoE\n", "imports dsv4.model.moe"),
    ("def f():\n    from dsv4.engine import llm\n", "imports dsv4.engine"),
    ("from ...server import api\n", "imports dsv4.server"),
    ("from typing import TYPE_CHECKING\n", "TYPE_CHECKING"),
])
def test_checker_catches_upward_edges(tmp_path: Path, source: str, expected: str) -> None:
    """The checker fails on an upward edge (absolute, nested or relative) and on TYPE_CHECKING."""
    pkg = tmp_path / "dsv4" / "kernels" / "ref"
    pkg.mkdir(parents=True)
    (tmp_path / "dsv4" / "__init__.py").write_text("")
    (tmp_path / "dsv4" / "kernels" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "bad.py").write_text(source)
    bad = violations(tmp_path / "dsv4")
    assert any(expected in b for b in bad), bad


def test_engine_and_server_import_no_triton_kernels() -> None:
    """Importing the engine, the LLM entry point and the server defines no Triton kernel: the
    Triton modules load lazily (kernels/registry.py), so a CPU process that sets TRITON_INTERPRET
    later (the kernel tests' conftest) still gets interpreted kernels."""
    import subprocess
    import sys

    code = ("import sys; import dsv4.engine.engine, dsv4.engine.llm, dsv4.model.decode_gemv; "
            "bad = sorted(m for m in sys.modules if m.startswith('dsv4.kernels.triton')); "
            "assert not bad, bad")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
