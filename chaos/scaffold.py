"""``knownstate init-kind NAME``: a new run kind's package — a description, an adapter, a queue
to replace with your own system, and a test that passes.

The scaffold is a working claim/lease/fence/retry queue on psycopg 3 (``queue.py``), its
description and adapter (``binding.py``, what you keep and edit), and a test through the
pytest plugin (``tests/``) that runs the gate on it and checks that the gate catches a write
without its fence. Replace the queue's calls in the adapter by your system's; run the test.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path
from string import Template

NAME = re.compile(r"^[a-z][a-z0-9-]*$")

PYPROJECT = Template("""\
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "$name-kind"
version = "0.1.0"
description = "The $name run kind, checked by knownstate"
requires-python = ">=3.11"
dependencies = ["knownstate", "psycopg[binary]>=3.2"]

# `knownstate verify $name` finds the kind once this package is installed (pip install -e .).
[project.entry-points."knownstate.kinds"]
$name = "$package.binding:$title"

[tool.setuptools]
packages = ["$package"]

[tool.pytest.ini_options]
pythonpath = ["."]
""")

INIT = Template('''\
"""The $name run kind: ``queue`` is the system under check, ``binding`` puts it under
knownstate's gate."""
''')

QUEUE = Template('''\
"""A queue on PostgreSQL (psycopg 3): the system under check. Replace it with your own: keep
the adapter in binding.py and make each of its methods call your system instead.

A job waits ('pending') until a worker claims it ('running', attempts + 1, a lease stamped with
the database's now()); the worker marks it 'done', 'failed' for good, or fails it for now (a
retry after an exponential backoff, 'dead' after max_attempts). Every write a worker makes
matches the attempt it claimed (the fence); a reaper takes back jobs whose lease lapsed.
"""

from dataclasses import dataclass

import psycopg

SCHEMA = """
CREATE TABLE ${table} (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key         text        NOT NULL UNIQUE,
    status      text        NOT NULL DEFAULT 'pending',
    attempts    integer     NOT NULL DEFAULT 0,
    due         timestamptz NOT NULL DEFAULT now(),
    lease_until timestamptz
);
"""

QUERIES = {
    "add": "INSERT INTO ${table} (key) VALUES (%(key)s) ON CONFLICT (key) DO NOTHING",
    "claim": """
        WITH next AS (SELECT id FROM ${table} WHERE status = 'pending' AND due <= now()
                      ORDER BY id LIMIT %(batch)s FOR UPDATE SKIP LOCKED)
        UPDATE ${table} j SET status = 'running', attempts = j.attempts + 1,
            lease_until = now() + make_interval(secs => %(lease)s)
        FROM next WHERE j.id = next.id RETURNING j.id, j.key, j.attempts""",
    "heartbeat": """
        UPDATE ${table} SET lease_until = now() + make_interval(secs => %(lease)s)
        WHERE id = %(id)s AND status = 'running' AND attempts = %(attempt)s""",
    "done": """
        UPDATE ${table} SET status = 'done', lease_until = NULL
        WHERE id = %(id)s AND status = 'running' AND attempts = %(attempt)s""",
    "failed": """
        UPDATE ${table} SET lease_until = NULL,
            status = CASE WHEN %(permanent)s THEN 'failed'
                          WHEN attempts >= %(max_attempts)s THEN 'dead' ELSE 'pending' END,
            due = CASE WHEN %(permanent)s OR attempts >= %(max_attempts)s THEN due
                       ELSE now() + make_interval(secs => least(%(cap)s,
                                                  %(base)s * 2 ^ (attempts - 1))) END
        WHERE id = %(id)s AND status = 'running' AND attempts = %(attempt)s""",
    "reap": """
        UPDATE ${table} SET lease_until = NULL, due = now(),
            status = CASE WHEN attempts >= %(max_attempts)s THEN 'dead' ELSE 'pending' END
        WHERE status = 'running' AND lease_until <= now() RETURNING key""",
}


@dataclass(frozen=True)
class Config:
    lease: int = 300
    max_attempts: int = 3
    backoff_base: int = 60
    backoff_cap: int = 3600


@dataclass(frozen=True)
class Job:
    id: int
    key: str
    attempt: int


class Jobs:
    """Each operation is one transaction on the caller's connection."""

    def __init__(self, conn: psycopg.Connection, config: Config = Config(), queries=QUERIES):
        self.conn, self.config, self.q = conn, config, queries

    def _run(self, name: str, **params):
        with self.conn.transaction():
            cur = self.conn.execute(self.q[name], params)
            return cur.fetchall() if cur.description else cur.rowcount

    def add(self, key: str) -> int:
        return self._run("add", key=key)

    def claim(self, batch: int) -> list[Job]:
        return [Job(*r) for r in self._run("claim", batch=batch, lease=self.config.lease)]

    def heartbeat(self, job: Job) -> int:
        return self._run("heartbeat", id=job.id, attempt=job.attempt, lease=self.config.lease)

    def done(self, job: Job) -> int:
        return self._run("done", id=job.id, attempt=job.attempt)

    def failed(self, job: Job, permanent: bool) -> int:
        c = self.config
        return self._run("failed", id=job.id, attempt=job.attempt, permanent=permanent,
                         max_attempts=c.max_attempts, base=c.backoff_base, cap=c.backoff_cap)

    def reap(self) -> list[str]:
        return [r[0] for r in self._run("reap", max_attempts=self.config.max_attempts)]
''')

BINDING = Template('''\
"""The $name kind under knownstate's gate: its description, and the adapter binding each
operation to the system (queue.py; make the methods call yours).

    knownstate verify --kind $package.binding:$title      # or, installed: knownstate verify $name
"""

from knownstate.chaos.adapter import Adapter, Claimed
from knownstate.chaos.generic import kind
from knownstate.model.describe import Claim, Fence, Lease, Retry, RunKind

from . import queue

DESCRIPTION = RunKind(
    name="$name",
    statuses=("pending", "running", "done", "failed", "dead"),
    initial="pending",
    owned=("running",),
    terminal=("done", "failed", "dead"),
    transitions=(
        "(new) -enqueue-> pending",
        "pending -claim-> running",
        "running -extend_lease-> running",
        "running -complete-> done",
        "running -fail_permanent-> failed",
        "running -retry-> pending",
        "running -give_up-> dead",
        "running -reclaim-> pending",
        "running -reclaim_dead-> dead",
    ),
    claim=Claim(how="FOR UPDATE SKIP LOCKED over due jobs, bumping attempts"),
    lease=Lease(seconds="5m", heartbeat="1m", taken_back_by=("reclaim", "reclaim_dead")),
    fence=Fence(kind="attempt", how="every write by a worker matches its claimed attempt"),
    receipts="the job row itself",
    retry=Retry(max_attempts=3, base="1m", cap="1h"),
    idempotency_key="key, unique: adding a job twice is one job",
)


class ${base}Adapter(Adapter):
    schema = queue.SCHEMA
    queries = queue.QUERIES  # the gate derives mutants from the guards below
    guards = {"fence": "AND attempts = %(attempt)s", "lease": "AND lease_until <= now()",
              "skip_locked": "SKIP LOCKED"}
    read_query = "SELECT key, status, attempts, due, lease_until FROM ${table}"

    def jobs(self, conn) -> queue.Jobs:
        t = self.timing  # the description's durations, as the gate runs them
        config = queue.Config(t.lease, t.max_attempts, t.backoff_base, t.backoff_cap)
        return queue.Jobs(conn, config, self.queries)

    def enqueue(self, conn, key):
        return self.jobs(conn).add(key)

    def claim(self, conn, batch):
        return [Claimed(j.key, j.attempt, j) for j in self.jobs(conn).claim(batch)]

    def extend_lease(self, conn, job):
        return self.jobs(conn).heartbeat(job.handle)

    def complete(self, conn, job):
        return self.jobs(conn).done(job.handle)

    def fail(self, conn, job, permanent):
        return self.jobs(conn).failed(job.handle, permanent)

    def reclaim_stale(self, conn):
        return self.jobs(conn).reap()


$title = kind(DESCRIPTION, ${base}Adapter)
''')

TEST = Template('''\
"""The $name kind against the contract, under real faults (knownstate's pytest plugin:
``pytest --knownstate-seed N`` replays a seed).

The quick profile: every transition and required event observed once, with no invariant
broken — under a minute, for the loop of changing the adapter and running the tests. The gate,
for CI, is ``knownstate verify $name``: each observed three times, mutants caught.
"""

import pytest

from $package.binding import $title

FENCE = [m.name for m in $title.mutants if m.invariant == "lease-fence"]


def test_the_queue_meets_the_contract(check_run_kind):
    check_run_kind($title, profile="quick")


def test_the_gate_catches_a_write_without_the_fence(check_run_kind):
    if not FENCE:
        pytest.skip(
            "no mutant of the fence: the gate derives them from the SQL the adapter names "
            "(Adapter.queries with Adapter.guards), and one of its own behind a fence on a "
            "claim's token (attempt, claim) that a lapsed run is claimed again under; give "
            "one with kind(..., mutants=[...])"
        )
    # caught (the failure names lease-fence) is all this test asks: no shrinking
    check_run_kind($title, mutant=FENCE[0], profile="quick", shrinks=0)
''')

README = Template("""\
# $name

A run kind checked by knownstate from its description.

- `$package/queue.py` — the system under check (a stand-in: replace it with yours);
- `$package/binding.py` — the description and the adapter (what you keep);
- `tests/test_$package.py` — the quick check as a test, under a minute: `python -m pytest`
  with the Python knownstate is installed in (needs knownstate's real parts: PostgreSQL 15
  binaries, libfaketime, Toxiproxy; see knownstate's README).

```sh
python -m pytest                      # the quick check, and a mutant the gate must catch
pip install -e .                      # registers the kind: `knownstate verify $name`
knownstate verify $name               # the gate, as CI runs it
knownstate mutants $name              # every mutant derived from the adapter's guards
```
""")


class ScaffoldError(ValueError):
    """The scaffold cannot be written (the message says why and what to do)."""


def write(name: str, where: Path) -> list[Path]:
    """Write the package of kind ``name`` into ``where/name``; the files written."""
    if not NAME.match(name):
        raise ScaffoldError(
            f"kind name {name!r}: lower-case letters, digits and dashes, "
            "starting with a letter (e.g. invoice-sync)"
        )
    root = where / name
    if root.exists():
        raise ScaffoldError(f"{root} already exists: choose another name or --dir")
    package = name.replace("-", "_") + "_kind"
    base = "".join(p.capitalize() for p in name.split("-"))
    values = {
        "name": name,
        "package": package,
        "title": base + "Kind",
        "base": base,
        "table": name.replace("-", "_") + "_job",
    }
    files = {
        root / "pyproject.toml": PYPROJECT,
        root / "README.md": README,
        root / package / "__init__.py": INIT,
        root / package / "queue.py": QUEUE,
        root / package / "binding.py": BINDING,
        root / "tests" / f"test_{package}.py": TEST,
    }
    for path, template in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(template.substitute(values))
    return list(files)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "init-kind",
        help="scaffold a run kind of your own: a description, an adapter and a test that passes",
    )
    p.add_argument("name", metavar="NAME", help="the kind's name (lower case, dashes)")
    p.add_argument("--dir", default=".", help="where to create NAME/ (default: here)")
    p.set_defaults(func=cmd_init_kind)


def cmd_init_kind(args) -> int:
    from .cli import UsageError

    try:
        files = write(args.name, Path(args.dir))
    except ScaffoldError as e:
        raise UsageError(str(e)) from None
    root = files[0].parent
    print(f"knownstate init-kind: wrote {root}/")
    for f in files:
        print(f"  {f.relative_to(root.parent)}")
    # The interpreter knownstate runs in has the plugin: a `pytest` first on PATH may not.
    python = shlex.quote(sys.executable)
    print(
        f"next: cd {shlex.quote(str(root))} && {python} -m pytest    (the quick check of the "
        "scaffolded queue, under a minute; then bind yours)"
    )
    return 0
