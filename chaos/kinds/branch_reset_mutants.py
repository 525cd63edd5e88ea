"""The branch reset's mutant catalogue: realistic bugs, each caught by its check
(:mod:`.branch_reset`; see `knownstate mutants branch-reset`)."""

from __future__ import annotations

import itertools
from datetime import datetime, timezone
from typing import Any

import psycopg

from knownstate.impl import branch_reset as impl
from knownstate.impl.errors import boundary, commit, rollback_quietly
from knownstate.model.branch_reset import KEY_REUSED, BranchResetModel, Status
from knownstate.model.contract import Rejected, Won

from ..mutants import CatalogueDrift, Mutant, sql_edit, with_attrs
from ..opsapi import OpsApi
from ..races import Call, RaceMutant, Scenario, Variant, schema_edit

# ---------------------------------------------------------------------------------------
# Mutants: realistic bugs, each caught by this check (see `knownstate mutants branch-reset`).
# ---------------------------------------------------------------------------------------


_Q = impl.queries.load(impl.QUERIES_FILE)


def _edit(name: str, old: str, new: str):
    return with_attrs(queries=sql_edit(_Q, name, old, new))


def _schema_edit(old: str, new: str):
    if old not in impl.SCHEMA:
        raise CatalogueDrift(f"mutant edit of the branch-reset schema: {old!r} not found")
    return with_attrs(schema=impl.SCHEMA.replace(old, new))


class _FreshKeyClient(impl.OpsApiClient):
    """Sends a fresh idempotency key with every create (a uuid per call, here a counter so a seed
    replays): the API cannot tell a retry from a new operation."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._serial = itertools.count(1)

    def create(self, run_id, branch, idempotency_key):
        return super().create(run_id, branch, f"{idempotency_key}/{next(self._serial)}")


class _StartFreshKey(impl.BranchResetStore):
    """start's create carries no stable idempotency key, so a retried start re-issues the
    operation."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.api = _FreshKeyClient(self.api.base_url, timeout=self.api.timeout)


class _PollReissues(impl.BranchResetStore):
    """A poll of a running run re-submits the create (with a fresh key) before reading the
    status."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fresh = _FreshKeyClient(self.api.base_url, timeout=self.api.timeout)

    def poll(self, conn, run_id):
        with boundary("branch-reset.poll"):  # a lost connection is the reference's error
            row = conn.execute(self.q["poll_target"], {"run_id": run_id}).fetchone()
            conn.rollback()
        if row is not None and row[0] == Status.RUNNING:
            self.fresh.create(run_id, run_id.rsplit("#", 1)[0], run_id)
        return super().poll(conn, run_id)


class _CreateOutsideClaim(impl.BranchResetStore):
    """start commits the claim first, then creates the operation and records it in a second
    transaction: a failure in between leaves a running run with no operation on its row."""

    def start(self, conn, run_id):
        where = "branch-reset.start"
        try:
            with boundary(where):
                row = conn.execute(
                    self.q["claim"],
                    {
                        "run_id": run_id,
                        "worker": self.worker,
                        "lease_until": self.app_clock() + self.lease,
                    },
                ).fetchone()
                if row is None:
                    outcome = self._miss(conn, run_id)
                    conn.rollback()
                    return outcome
            commit(conn, where)
            with boundary(where):
                op_id, op_status = self.api.create(run_id, row[0], idempotency_key=run_id)
                conn.execute(
                    self.q["record_operation"],
                    {"run_id": run_id, "op_id": op_id, "op_status": op_status.value},
                )
            commit(conn, where)
            return Won(op_id)
        except BaseException:
            rollback_quietly(conn)
            raise


_POLL_IGNORES_LEASE = {
    **sql_edit(
        _Q,
        "poll_target",
        "SELECT status, lease_until, external_op_id",
        "SELECT status, '9999-12-31'::timestamptz AS lease_until, external_op_id",
    ),
    "record_poll": sql_edit(_Q, "record_poll", "AND lease_until > %(app_now)s", "")["record_poll"],
}

MUTANTS = [
    Mutant(
        "poll-reissues-operation",
        "branch-reset",
        "external-effect-semantics",
        "a poll re-submits the create without the idempotency key: a second operation at the API",
        with_attrs(store_class=_PollReissues),
    ),
    Mutant(
        "start-retry-fresh-key",
        "branch-reset",
        "external-effect-semantics",
        "start sends a fresh idempotency key per attempt: a start retried after its create was "
        "acted on creates a second operation",
        with_attrs(store_class=_StartFreshKey),
    ),
    Mutant(
        "create-outside-claim",
        "branch-reset",
        "receipt-with-effect",
        "start commits the claim, "
        "then creates the operation and records it in a second transaction",
        with_attrs(store_class=_CreateOutsideClaim),
    ),
    Mutant(
        "cancel-unguarded",
        "branch-reset",
        "conditional-transition",
        "cancel is not guarded on status = 'running': it overwrites queued and terminal runs",
        _edit("cancel", "WHERE id = %(run_id)s AND status = 'running'", "WHERE id = %(run_id)s"),
    ),
    # A request claims its key for one run (its guarantee is the claim): every way this bug
    # shows breaks that, a repeat of a finished run's key also the terminal-answers invariant.
    Mutant(
        "idempotency-key-not-unique",
        "branch-reset",
        "claim",
        "the idempotency key has an index but not a unique one: "
        "a repeated or reused key makes a new run",
        _schema_edit(
            "CREATE UNIQUE INDEX branch_reset_idempotency_key",
            "CREATE INDEX branch_reset_idempotency_key",
        ),
    ),
    Mutant(
        "one-in-flight-missing",
        "branch-reset",
        "claim",
        "no one-in-flight guard: a second run of a branch is queued while one is in flight",
        _schema_edit(
            "CREATE UNIQUE INDEX branch_reset_one_in_flight ON branch_reset (branch)\n"
            "    WHERE status IN ('queued', 'running');",
            "",
        ),
    ),
    Mutant(
        "reaper-ignores-lease",
        "branch-reset",
        "lease",
        "the reaper fails every running run, live leases included",
        _edit("reap", " AND lease_until <= %(app_now)s", ""),
    ),
    Mutant(
        "poll-ignores-lease",
        "branch-reset",
        "lease-fence",
        "a poll does not check the lease: a poller that stalled past it extends it and goes on",
        with_attrs(queries=_POLL_IGNORES_LEASE),
    ),
]

# ---------------------------------------------------------------------------------------
# Race mutants: read-then-write bugs only a concurrent block reaches (:mod:`..races`).
# ---------------------------------------------------------------------------------------


class RequestSelectThenInsert(impl.BranchResetStore):
    """The idempotency check is a SELECT by key before the INSERT, and the key has no unique
    index (:data:`KEY_NOT_UNIQUE_SCHEMA`): two requests with one key both find nothing."""

    def request(self, conn: psycopg.Connection, branch: str, idempotency_key: str) -> Any:
        try:
            with boundary("branch-reset.request"):
                found = conn.execute(
                    self.q["find_by_key"], {"idempotency_key": idempotency_key}
                ).fetchone()
            if found is not None:
                conn.rollback()
                same = found[1] == branch
                return Won(found[0]) if same else Rejected(KEY_REUSED)
            return super().request(conn, branch, idempotency_key)
        except BaseException:
            rollback_quietly(conn)
            raise


class StartReadsStatusFirst(impl.BranchResetStore):
    """start reads the run's status in one statement and, seeing it queued, claims it by id in
    the next (the claim no longer guarded on status): two starts that both read 'queued' both
    win, the second after waiting for the first one's row lock."""

    READ = "SELECT status FROM branch_reset WHERE id = %(run_id)s"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.q = sql_edit(self.q, "claim", " AND status = 'queued'", "")

    def start(self, conn: psycopg.Connection, run_id: str) -> Any:
        try:
            with boundary("branch-reset.start"):
                row = conn.execute(self.READ, {"run_id": run_id}).fetchone()
                if row is None or row[0] != Status.QUEUED:
                    outcome = self._miss(conn, run_id)
                    conn.rollback()
                    return outcome
        except BaseException:
            rollback_quietly(conn)
            raise
        return super().start(conn, run_id)


KEY_NOT_UNIQUE_SCHEMA = schema_edit(
    impl.SCHEMA,
    "CREATE UNIQUE INDEX branch_reset_idempotency_key",
    "CREATE INDEX branch_reset_idempotency_key",
)

RACE_EPOCH = datetime(2030, 1, 1, tzinfo=timezone.utc)
"""The stores' application clock in a race scenario: model time zero, standing still."""


def _store(cls: type, worker: str, api: Any) -> Any:
    # without a stand-in (requests only) nothing listens on port 9
    url = api.url if api is not None else "http://127.0.0.1:9"
    return cls(worker, url, lambda: RACE_EPOCH)


def _project(conn: psycopg.Connection, _to_model_time: Any) -> Any:
    """The rows, their lease stamps (application time) as model seconds from RACE_EPOCH."""
    return impl.project(conn, lambda ts: int((ts - RACE_EPOCH).total_seconds()))


def _scenario(name: str, block: tuple[Call, ...], setup: tuple[Call, ...] = ()) -> Scenario:
    return Scenario(
        name,
        "branch-reset",
        impl.SCHEMA,
        impl.TABLES,
        new_model=BranchResetModel,
        new_store=_store,
        project=_project,
        project_model=lambda m: m.rows(),
        block=block,
        setup=setup,
        reference_store=impl.BranchResetStore,
        stand_in=OpsApi,
    )


def _request(worker: str, branch: str) -> Call:
    return Call.alike(worker, f"request({branch}, key=k)", "request", branch, "k")


def _start(worker: str) -> Call:
    return Call(
        worker, "start(a#1)", lambda m: m.start("a#1", worker), lambda s, c: s.start(c, "a#1")
    )


RACES = (
    RaceMutant(
        "start-reads-status-first",
        "branch-reset",
        "conditional-transition",
        "start reads the run's status, then claims it by id in a second statement: two starts "
        "that both read 'queued' both win",
        Variant("start-reads-status-first", StartReadsStatusFirst),
        _scenario(
            "branch-reset: two starts of one queued run",
            setup=(_request("w0", "a"),),
            block=(_start("w0"), _start("w1")),
        ),
        "run one after the other, the second start reads 'running' and loses. Only both reads "
        "before the first claim commits let both claim the run.",
    ),
    RaceMutant(
        "idempotency-select-then-insert",
        "branch-reset",
        "claim",
        "the idempotency check is SELECT-by-key then INSERT, with no unique index on the key: two "
        "requests with one key for two branches both make a run",
        Variant("idempotency-select-then-insert", RequestSelectThenInsert, KEY_NOT_UNIQUE_SCHEMA),
        _scenario(
            "branch-reset: one idempotency key for two branches at once",
            block=(_request("w0", "b1"), _request("w1", "b2")),
        ),
        "the second request, run after the first committed, finds the key by its SELECT and "
        "refuses it as reused. Only both SELECTs before either INSERT commits find nothing.",
    ),
)

MUTANTS += [r.mutant() for r in RACES]
