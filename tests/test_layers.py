"""The layers import downwards only: ``model/`` imports neither ``impl/`` nor ``chaos/``, and
``impl/`` (the reference implementation, which runs without the gate) imports nothing from
``chaos/``. Read from the sources with ``ast``: every import, also one inside a function, with
relative imports resolved.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {"model": ("impl", "chaos"), "impl": ("chaos",)}
"""Each folder (a subpackage of ``knownstate``) and the subpackages it must not import."""


def imports(path: Path, package: str) -> list[tuple[int, str]]:
    """``(line, module)`` for every module the source at ``path``, in ``package``, imports; for
    ``from M import n`` both ``M`` and ``M.n`` (``n`` may be a module)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0]
                base = f"{parent}.{base}" if base else parent
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return out


def violations(root: Path, folder: str, forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in sorted((root / folder).rglob("*.py")):
        package = ".".join(("knownstate", *path.relative_to(root).parent.parts))
        for line, module in sorted(imports(path, package)):
            for other in forbidden:
                name = f"knownstate.{other}"
                if module == name or module.startswith(f"{name}."):
                    found.append(f"{path.relative_to(root)}:{line} imports {module}")
    return found


@pytest.mark.parametrize("folder", FORBIDDEN)
def test_a_layer_imports_nothing_from_the_layers_above_it(folder):
    assert violations(ROOT, folder, FORBIDDEN[folder]) == []


def test_every_way_of_importing_is_seen(tmp_path):
    (tmp_path / "impl" / "documents").mkdir(parents=True)
    (tmp_path / "impl" / "ok.py").write_text("from . import errors\nimport knownstate.model\n")
    (tmp_path / "impl" / "documents" / "bad.py").write_text(
        "import knownstate.chaos.tools\n"
        "from knownstate import chaos\n"
        "def f():\n"
        "    from ...chaos.cluster import free_port\n"
        "from ... import chaos\n"
    )
    assert violations(tmp_path, "impl", ("chaos",)) == [
        "impl/documents/bad.py:1 imports knownstate.chaos.tools",
        "impl/documents/bad.py:2 imports knownstate.chaos",
        "impl/documents/bad.py:4 imports knownstate.chaos.cluster",
        "impl/documents/bad.py:4 imports knownstate.chaos.cluster.free_port",
        "impl/documents/bad.py:5 imports knownstate.chaos",
    ]
