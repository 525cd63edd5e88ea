"""Memory across runs: every failing example is kept, and replayed first on the next run.

This is Hypothesis's example database, through the engine's ``GateDatabase`` (which saves only
genuine failures). A failure found once — by a nightly ``--profile deep`` run, on another
machine — is replayed before anything new is generated on every later run, until it no longer
fails (then Hypothesis drops it: the bug was fixed).

- The local database is a directory (``.knownstate/examples`` by default; ``.knownstate`` gets
  a ``.gitignore`` of its own, so it is never committed). A CI keeps it between runs as a cached
  directory.
- A GitHub Actions artifact of that directory can be read as well (``--example-db-github``:
  Hypothesis's ``GitHubArtifactDatabase``, read-only, multiplexed with the local one), so a
  developer's machine replays what CI found.

Keys: ``knownstate:<kind>`` for the reference, ``knownstate:<kind>:mutant:<name>`` for
``verify --mutant`` (a mutant's counterexample is of no use to the reference). ``knownstate
mutants`` uses no database at all: it measures what each seed catches on its own, and a stored
counterexample would make every seed after the first catch the mutant at once. For the same
reason ``verify --seeds N`` (N > 1) saves new failures but replays none.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hypothesis.database import (
    DirectoryBasedExampleDatabase,
    ExampleDatabase,
    GitHubArtifactDatabase,
    MultiplexedDatabase,
    ReadOnlyDatabase,
)

from .exampledb import SaveOnly, Wrapped

DEFAULT_DIR = ".knownstate/examples"
ARTIFACT = "knownstate-examples"


class Counted(Wrapped):
    """Passes everything through, and counts the stored failing examples handed out for replay
    (the primary key's, not Hypothesis's secondary or pareto corpora)."""

    def __init__(self, inner: ExampleDatabase):
        super().__init__(inner)
        self.stored = 0

    def fetch(self, key: bytes):
        for value in self.inner.fetch(key):
            if not key.endswith((b".secondary", b".pareto")):
                self.stored += 1
            yield value


def key(kind: str, mutant: str | None = None) -> str:
    return f"knownstate:{kind}" + (f":mutant:{mutant}" if mutant else "")


def dir_problem(path: str) -> str | None:
    """Why the example database cannot live at ``path`` (None: it can)."""
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            return f"the example database {path} is not a directory"
        if not os.access(p, os.W_OK | os.X_OK):
            return f"the example database {path} is not writable"
        return None
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        return f"cannot keep the example database in {path}: directory {parent} does not exist"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot keep the example database in {path}: {parent} is not writable"
    return None


def prepare_default(path: str = DEFAULT_DIR) -> str | None:
    """Create the default database's directory, git-ignored (None: this directory cannot hold
    it; the run then goes on without memory, and says so)."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        ignore = p.parent / ".gitignore"
        if p.parent.name == ".knownstate" and not ignore.exists():
            ignore.write_text("# written by knownstate: the example database is not source\n*\n")
    except OSError as e:
        return f"cannot create the example database {path} ({e.strerror})"
    return None


@dataclass(frozen=True)
class Memory:
    """Where failing examples are kept (``local``) and read from (``github``: owner, repository,
    artifact name)."""

    local: str | None
    github: tuple[str, str, str] | None = None

    def database(self, replay: bool) -> Counted | None:
        """The database of one run: replaying stored examples first (``replay``), or only
        keeping new failures."""
        parts: list[ExampleDatabase] = []
        if self.local:
            parts.append(DirectoryBasedExampleDatabase(self.local))
        if self.github and replay:
            owner, repo, artifact = self.github
            cache = Path(self.local).parent / "github" if self.local else None
            parts.append(
                ReadOnlyDatabase(
                    GitHubArtifactDatabase(
                        owner,
                        repo,
                        artifact_name=artifact,
                        path=cache / artifact if cache else None,
                    )
                )
            )
        if not parts:
            return None
        db = parts[0] if len(parts) == 1 else MultiplexedDatabase(*parts)
        return Counted(db if replay else SaveOnly(db))


def parse_github(spec: str) -> tuple[str, str, str]:
    """``OWNER/REPO[:ARTIFACT]`` -> (owner, repo, artifact); ValueError naming the problem."""
    repo, _, artifact = spec.partition(":")
    owner, _, name = repo.partition("/")
    if not owner or not name or "/" in name:
        raise ValueError(
            f"--example-db-github {spec!r}: give OWNER/REPO[:ARTIFACT], e.g. "
            f"myorg/myrepo:{ARTIFACT}"
        )
    return owner, name, artifact or ARTIFACT
