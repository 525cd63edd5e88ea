"""The files a hand-written kind touches are the ones README's "Validating your own run kind"
lists: the shared modules it no longer touches name no kind in their code (docstrings may
mention one as an example). Fast: reads source only."""

from __future__ import annotations

import ast
import subprocess
import sys
import types
from pathlib import Path

import pytest

from knownstate.chaos import kinds
from knownstate.impl import loops

ROOT = Path(loops.__file__).resolve().parents[1]
SHARED = (
    "impl/loops.py",
    "chaos/specs.py",
    "chaos/races.py",
    "chaos/race_mutants.py",
    "chaos/soakkinds.py",
    "chaos/kinds/__init__.py",
)
"""Modules every kind uses and no kind edits."""


def kind_words() -> set[str]:
    """What names a built-in durable kind: its name, its modules' names, its tables (a client
    protocol is not a durable kind: ``chaos/specs.py`` lists its spec by name)."""
    words: set[str] = set()
    for d in kinds.described():
        words |= {d.name, d.name.replace("-", "_"), kinds.built_in()[d.name].module}
    words |= {"agent_proposal", "branch_reset", "outbox"}
    return words


def code_strings_and_names(path: Path) -> list[str]:
    """Every string constant, name and imported module in ``path`` but its docstrings."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in docstrings:
                out.append(node.value)
        elif isinstance(node, ast.Name):
            out.append(node.id)
        elif isinstance(node, ast.Attribute):
            out.append(node.attr)
        elif isinstance(node, ast.ImportFrom):
            out += [node.module or "", *(a.name for a in node.names)]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return out


@pytest.mark.parametrize("module", SHARED)
def test_a_shared_module_names_no_kind(module):
    words = kind_words()
    found = sorted(
        {w for text in code_strings_and_names(ROOT / module) for w in words if w in text}
    )
    assert not found, f"{module} names kinds by hand: {found}"


OWN_FILES = (
    "model/{m}.py",
    "impl/{m}.py",
    "impl/sql/{m}.sql",
    "impl/sql/{m}_schema.sql",
    "chaos/kinds/{m}.py",
    "chaos/kinds/{m}_mutants.py",
)
"""README's "files a hand-written kind touches", but its spec and its tests."""


def test_a_hand_written_kind_is_its_own_files_only():
    """README's count holds for the approved plan: of the product's modules, those whose code
    names it (its name, its modules, its tables) are its own six; beside them only its spec and
    its tests. Its check module is found by its ``CHECK``, its soak binding is its ``SOAK``."""
    entry = kinds.built_in()["approved-plan"]
    own = {f.format(m=entry.module) for f in OWN_FILES}
    assert all((ROOT / f).is_file() for f in own) and (ROOT / "specs/approved-plan.md").is_file()
    words = {"approved-plan", "approved_plan", "agent_proposal"}
    naming = {
        str(path.relative_to(ROOT))
        for sub in ("model", "impl", "chaos")
        for path in (ROOT / sub).rglob("*.py")
        if any(w in text for text in code_strings_and_names(path) for w in words)
    }
    assert naming <= own, f"modules that name the approved plan but are not its own: {naming - own}"
    assert entry.check is kinds.check("approved-plan") and kinds.soak("approved-plan").name


def test_every_sql_file_is_one_kinds_and_each_loop_reads_its_kinds():
    """No shared query file a new kind would add its reads to (there was ``loops.sql``)."""
    owners = {kinds.built_in()[d.name].module for d in kinds.described()} | {"documents"}
    for path in (ROOT / "impl" / "sql").glob("*.sql"):
        assert path.stem.removesuffix("_schema") in owners, f"impl/sql/{path.name} is no kind's"
    from knownstate.impl import approved_plan, branch_reset

    assert approved_plan.PlanExecutor.queries is approved_plan.QUERIES
    assert branch_reset.ResetPoller.queries is branch_reset.QUERIES


def test_the_check_finds_a_kind_named_in_a_shared_module(tmp_path):
    """The check itself can fail: a module that reads a kind's table by hand is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text('"""Mentions the outbox in prose only."""\nQ = "SELECT id FROM outbox"\n')
    assert any("outbox" in s for s in code_strings_and_names(bad))
    ok = tmp_path / "ok.py"
    ok.write_text('"""Mentions the outbox in prose only."""\nQ = "SELECT 1"\n')
    assert not any("outbox" in s for s in code_strings_and_names(ok))


def test_built_in_kinds_are_found_without_importing_them():
    """A command imports only the kinds it runs: the built-in kinds are found in their modules'
    source, named after their modules; what the source says is what each module sets."""
    listed = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from knownstate.chaos import kinds; names = kinds.names(); "
            "print(names, [m for m in sys.modules if m.startswith('knownstate.chaos.kinds.')])",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert listed.strip().endswith("[]"), listed  # no kind's module was imported to name it
    for name, entry in kinds.built_in().items():
        assert entry.check.kind == name and entry.module == name.replace("-", "_")
        assert entry.soaks == (entry.soak is not None), name
    assert "document-session" in kinds.built_in() and not kinds.built_in()["document-session"].soaks


def test_a_built_in_kinds_module_named_otherwise_is_one_line_saying_so(monkeypatch):
    fake = types.ModuleType("knownstate.chaos.kinds.my_kind")
    fake.CHECK = type("Check", (), {"kind": "another-kind"})
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    with pytest.raises(
        kinds.KindNotFound, match=r"my_kind.py holds kind 'another-kind'.*'my-kind'"
    ):
        kinds.Entry("my_kind").check
