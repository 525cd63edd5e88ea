"""knownstate's pytest plugin: the gate's real parts as fixtures, and a kind's check as a test.

Installed with knownstate (entry point ``pytest11``), so a test suite of your own gets these
fixtures without a conftest. Documented in ``docs/pytest.md``. Every fixture starts real
parts — a PostgreSQL cluster under libfaketime, the Toxiproxy server — once per session, on
loopback, and stops them when the session ends. Nothing is imported from knownstate until a
fixture is used, so the plugin costs nothing to suites that do not use it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import itertools
import secrets
import types

import pytest

_databases = itertools.count()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("knownstate", "knownstate: durable work checked under real faults")
    group.addoption(
        "--knownstate-seed",
        type=int,
        default=None,
        help="seed of every check_run_kind (default: a random one, in the report)",
    )
    group.addoption(
        "--knownstate-profile",
        default="ci",
        choices=("quick", "ci", "deep"),
        help="how long check_run_kind runs: quick (every requirement once, under a minute), "
        "ci (default: 3 times each) or deep (nightly)",
    )
    group.addoption(
        "--knownstate-examples",
        type=int,
        default=None,
        help="a fixed number of examples per check (default: the profile's coverage-directed run)",
    )
    group.addoption(
        "--knownstate-dsn",
        default=None,
        help="an external PostgreSQL for knownstate_cluster (default: a throwaway "
        "cluster; never $DATABASE_URL implicitly)",
    )


def pytest_configure(config: pytest.Config) -> None:
    """A ``--knownstate-dsn`` that does not parse is a usage error (pytest's exit 4), named in
    one line without its password, before any test runs."""
    value = config.getoption("knownstate_dsn", None)
    if value:
        from knownstate.chaos import dsn as dsns

        try:
            config.option.knownstate_dsn = dsns.resolve(value)
        except ValueError as e:
            raise pytest.UsageError(f"--knownstate-dsn: {e}") from None


@pytest.fixture(scope="session")
def knownstate_cluster(request):
    """The PostgreSQL server: a throwaway cluster (run under libfaketime, so its clock can
    jump, and crashable), or the server of ``--knownstate-dsn``."""
    from knownstate.chaos.cluster import ExternalDatabase, PostgresCluster

    dsn = request.config.getoption("knownstate_dsn")
    with ExternalDatabase(dsn) if dsn else PostgresCluster() as db:
        yield db


@pytest.fixture(scope="session")
def knownstate_toxiproxy():
    """The real Toxiproxy server (Shopify's, v2.12.0); ``.client()`` gives its API."""
    from knownstate.chaos.toxi import ToxiproxyServer

    with ToxiproxyServer() as server:
        yield server


@pytest.fixture(scope="session")
def knownstate_env(knownstate_cluster, knownstate_toxiproxy):
    """The real parts of a verify run (``knownstate.chaos.check.Env``) on the two above: what
    ``check_run_kind`` runs checks in. Each check works in a schema of its own."""
    from knownstate.chaos.check import Env

    env = Env(knownstate_cluster, knownstate_toxiproxy)
    yield env
    env.close()


@pytest.fixture
def knownstate_db(knownstate_cluster):
    """A factory of empty databases: ``knownstate_db(schema_sql=None) -> dsn``; each dropped
    after the test. On the throwaway cluster each is a database of its own; on a server of
    ``--knownstate-dsn`` — whose user need not create databases, as ``--dsn`` needs only
    CONNECT and CREATE on the database it names — each is a schema of its own in that
    database, which the DSN reaches through its search_path."""
    import psycopg

    from knownstate.chaos import dsn as dsns

    created: list[str] = []
    own_server = knownstate_cluster.owns_server

    def make(schema_sql: str | None = None) -> str:
        name = f"ks_test_{next(_databases)}_{secrets.token_hex(2)}"
        with psycopg.connect(knownstate_cluster.dsn(), autocommit=True) as admin:
            admin.execute(f'create {"database" if own_server else "schema"} "{name}"')
        created.append(name)
        if own_server:
            dsn = knownstate_cluster.dsn(name)
        else:
            dsn = dsns.with_options(knownstate_cluster.dsn(), f"search_path={name}")
        if schema_sql:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(schema_sql)
        return dsn

    yield make
    if knownstate_cluster.running:
        with psycopg.connect(knownstate_cluster.dsn(), autocommit=True) as admin:
            for name in created:
                if own_server:
                    admin.execute(f'drop database if exists "{name}" with (force)')
                else:
                    admin.execute(f'drop schema if exists "{name}" cascade')


@pytest.fixture
def knownstate_db_clock(knownstate_cluster):
    """The database server's clock: ``jump(seconds)`` moves every backend's ``now()`` at once
    (libfaketime), ``offset`` says by how much. At true time and running when the test starts,
    whatever a check before it left (a check holds the clock after its last step, a week back),
    and back to true time after it. Skips when the server is not one the harness owns."""
    clock = getattr(knownstate_cluster, "clock", None)
    if clock is None:
        pytest.skip("the database clock can move only on the throwaway cluster with libfaketime")
    clock.reset()
    yield clock
    clock.reset()


class AppClock:
    """An application clock a test controls: give ``clock.now`` to your code instead of
    ``datetime.now`` (a lease in application time is judged by it)."""

    def __init__(self, start: dt.datetime | None = None):
        self._now = start or dt.datetime.now(dt.timezone.utc)

    def now(self) -> dt.datetime:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += dt.timedelta(seconds=seconds)

    def set(self, when: dt.datetime) -> None:
        self._now = when


@pytest.fixture
def knownstate_app_clock():
    """An :class:`AppClock` starting at the true time."""
    return AppClock()


@pytest.fixture
def check_run_kind(request, knownstate_env):
    """Run a kind's check — a check class, ``"package.module:Thing"`` or a registered kind's
    name — and fail the test with the same report ``knownstate verify`` prints::

        def test_my_queue(check_run_kind):
            check_run_kind(MyQueueKind)                      # passes, or fails with the report
            check_run_kind(MyQueueKind, mutant="no-fence-in-complete")  # must be caught

    With ``mutant=NAME`` the test passes only when the gate catches that mutant naming its
    invariant. With ``timings=True`` the result's ``timings`` and the printed report say where
    the run's time went (``--timings``). Returns the
    :class:`~knownstate.chaos.check.CheckResult`."""
    from knownstate.chaos import kinds
    from knownstate.chaos.check import SHRINKS, run_check
    from knownstate.chaos.report import Replay, Unit, finished_record, run_lines

    from knownstate.chaos.cli import Progress

    config = request.config
    stream = _TerminalLines(config)

    def run(
        kind,
        *,
        seed: int | None = None,
        profile: str | None = None,
        examples: int | None = None,
        steps: int | None = None,
        mutant: str | None = None,
        shrinks: int = SHRINKS,
        timings: bool = False,
    ):
        check = _resolve(kinds, kind)
        seed = seed if seed is not None else config.getoption("knownstate_seed")
        seed = seed if seed is not None else secrets.randbelow(2**32)
        examples = examples or config.getoption("knownstate_examples")
        machine, found = check, []
        if mutant is not None:
            catalogue = kinds.mutants_of(check)
            found = [m for m in catalogue if m.name == mutant]
            if not found:
                pytest.fail(
                    f"{check.kind} has no mutant {mutant!r}: choose from "
                    + ", ".join(m.name for m in catalogue),
                    pytrace=False,
                )
            machine = found[0].machine(check)
        profile = profile or config.getoption("knownstate_profile")
        if profile == "quick":
            # A batch of the quick profile is a batch of ci with its longer examples: that is
            # what the replay command runs (knownstate verify has no quick profile).
            steps, replay_profile, profile = steps or QUICK_STEPS, "ci", quick_profile()
        else:
            replay_profile = profile
        unit = Unit(0, check.kind, seed, found[0] if found else None)
        progress = Progress(unit.label, types.SimpleNamespace(state=None), stream)
        try:
            result = run_check(
                machine,
                knownstate_env,
                seed=seed,
                profile=profile,
                examples=examples,
                steps=steps,
                require_all=mutant is None,
                shrinks=shrinks,
                progress=progress,
                timings=timings,
            )
        finally:
            progress.done()
        replay = Replay(
            profile=replay_profile,
            examples=examples,
            steps=steps,
            shrinks=shrinks,
            no_example_db=True,
        )
        record = finished_record(unit, result, replay)
        report = "\n".join(run_lines(record))
        if mutant is None and not result.passed:
            pytest.fail(report, pytrace=False)
        if mutant is not None and not record["caught"]:
            pytest.fail(report, pytrace=False)
        return result

    return run


QUICK_STEPS = 60
"""Steps per example of the quick profile: a stale owner's write on a run claimed again takes a
claim, a stall past the lease, a reclaim, a second claim and the write; longer examples reach it
in far fewer examples than ci's 30 steps do."""


def quick_profile():
    """The plugin's ``quick`` profile: every required transition and event observed once, in
    examples of :data:`QUICK_STEPS` steps — a test suite's inner loop (the scaffold's tests, under
    a minute). The gate is ``knownstate verify`` (``ci``: three times each)."""
    from knownstate.chaos.check import PROFILES, Profile

    ci = PROFILES["ci"]
    return Profile(
        name="quick",
        min_examples=10,
        max_examples=ci.max_examples,
        steps=QUICK_STEPS,
        times_each=1,
        too_slow_s=ci.too_slow_s,
        description="every required transition and event observed once (10 examples at least, "
        f"of {QUICK_STEPS} steps)",
    )


class _TerminalLines:
    """A stream for the gate's progress lines that reaches the terminal while pytest captures
    a test's output: a line every few seconds, so a check of a minute is not a silent one."""

    def __init__(self, config: pytest.Config):
        self.config, self._buffer = config, ""

    def isatty(self) -> bool:
        return False

    def write(self, text: str) -> None:
        self._buffer += text
        *lines, self._buffer = self._buffer.split("\n")
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        capture = self.config.pluginmanager.get_plugin("capturemanager")
        if reporter is None:
            return
        hold = capture.global_and_fixture_disabled() if capture else contextlib.nullcontext()
        with hold:
            for line in lines:
                reporter.write_line(line)

    def flush(self) -> None:
        pass


def _resolve(kinds, kind):
    """A check class from a class, ``"package.module:Thing"`` or a kind's name."""
    from knownstate.chaos.engine import Engine

    if isinstance(kind, type) and issubclass(kind, Engine):
        kinds.register(kind)
        return kind
    try:
        return kinds.check(kinds.load(kind) if ":" in kind else kind)
    except kinds.KindNotFound as e:
        pytest.fail(str(e), pytrace=False)
