"""Drift: each fact that lives in specs/ and in model/ must agree (diagrams, the contract table)."""

from knownstate.chaos import kinds, specs


def test_specs_agree_with_models():
    assert specs.drift() == []


def test_each_diagram_is_the_models_table():
    for (file, name), content in specs.blocks().items():
        text = (specs.SPECS / file).read_text()
        assert f"<!-- generated:{name} -->\n{content}\n<!-- /generated:{name} -->" in text, file


def test_drift_is_detected(tmp_path, monkeypatch):
    """The drift check itself can fail: a spec whose diagram lost a transition is reported."""
    for f in specs.SPECS.glob("*.md"):
        (tmp_path / f.name).write_text(f.read_text())
    broken = tmp_path / "outbox.md"
    broken.write_text(broken.read_text().replace("    processing --> dead: give_up\n", ""))
    monkeypatch.setattr(specs, "SPECS", tmp_path)
    assert any("outbox.md" in p for p in specs.drift())


def test_the_contract_table_is_generated_from_the_descriptions(monkeypatch):
    """A description that changes (the outbox's fence, say) makes specs/contract.md drift."""
    from knownstate.model.describe import Fence

    built_in = kinds.described()
    changed = built_in[0].model_copy(update={"fence": Fence(kind="status")})
    monkeypatch.setattr(kinds, "described", lambda: [changed, *built_in[1:]])
    assert "fence: status" in specs.contract_table()
    assert any("contract.md" in p for p in specs.drift())


def test_every_spec_is_generated_and_a_durable_kind_needs_no_entry_in_chaos_specs():
    """specs/ holds a spec per built-in description, per client protocol and the contract, and
    nothing else (that chaos/specs.py names no durable kind is test_kind_files.py's)."""
    described = {f"{d.name}.md" for d in kinds.described()}
    assert set(specs.diagrams()) == described | set(specs.PROTOCOLS)
    on_disk = {p.name for p in specs.SPECS.glob("*.md")}
    assert on_disk == described | set(specs.PROTOCOLS) | {"contract.md"}


def test_a_new_description_gets_its_diagram(monkeypatch):
    built_in = kinds.described()
    jobs = built_in[0].model_copy(update={"name": "jobs"})
    monkeypatch.setattr(kinds, "described", lambda: [*built_in, jobs])
    assert "jobs.md" in specs.diagrams()
    assert any("specs/jobs.md is missing" in p for p in specs.drift())
