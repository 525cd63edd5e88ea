"""What a description and an adapter must give each other to make a check.

:func:`adapter_problems` says what an adapter lacks for a description, :func:`derived_mutants`
derives a mutant from each SQL guard the adapter names, and :func:`required_events` lists what
a run of the check must observe to count (a verdict that reached nothing is VACUOUS).
:func:`knownstate.chaos.generic.kind` puts them together.
"""

from __future__ import annotations

import inspect

from knownstate.model import generic
from knownstate.model.describe import RunKind

from .adapter import Adapter, edit_sql
from .blocks import IN_A_BLOCK, frozen_retaken, raced
from .check import needs
from .genericfaults import FaultAnswers
from .mutants import Mutant, sql_edit, with_attrs
from .runner import Requirement

GUARDS = {
    "fence": "lease-fence",
    "status": "lease-fence",
    "lease": "lease",
    "skip_locked": "claim",
    "lock": "claim",
}
"""A guard the adapter names -> the invariant a query without it must be caught breaking.
Without its ``lock`` (``FOR UPDATE SKIP LOCKED``) a claim is a read and then a write, which two
claims racing each other can both make: a race mutant, caught where claims overlap."""


class KindError(ValueError):
    """A description and an adapter that cannot make a check (the message says what to do)."""


def _names_worker(d: RunKind, adapter: type[Adapter]) -> bool:
    """Whether the adapter's claim is told its worker when the lease is per worker: the gate
    passes ``worker=`` (``'w0'``, ``'w1'``), the id under which the library keeps the beat."""
    if d.lease is None or d.lease.per != "worker":
        return True
    return "worker" in inspect.signature(adapter.claim).parameters


def adapter_problems(d: RunKind, adapter: type[Adapter]) -> list[str]:
    """What the adapter lacks for this description (empty: nothing), with hints."""
    out = []
    name = adapter.__name__
    events = d.events()
    need = {
        "enqueue": "(conn, key)",
        "claim": "(conn, batch) -> [Claimed]",
        "complete": "(conn, job)",
    }
    if d.retry is not None or generic.FAIL in events:
        need["fail"] = "(conn, job, permanent)"
    if generic.EXTEND in events:
        need["extend_lease"] = "(conn, job)"
    if d.lease is not None and d.lease.taken_back_by:
        need["reclaim_stale"] = "(conn) -> keys taken back"
    if d.external != "none":
        need["send"] = "(job, url) -> OK | RETRY | PERMANENT"
    if d.lease is not None and d.lease.per == "worker":  # its worker's id keeps the lease
        need["claim"] = "(conn, batch, worker) -> [Claimed], worker: 'w0', 'w1'"
    for op, sig in need.items():
        if not adapter.implements(op) or (op == "claim" and not _names_worker(d, adapter)):
            out.append(f"{name} has no {op}{sig}, which the description needs: implement it")
    if not adapter.schema.strip():
        out.append(f"{name}.schema is empty: give the SQL that creates the tables")
    if not adapter.read_query and adapter.read is Adapter.read:
        out.append(
            f"{name} has neither read_query nor read(conn): give the query that reads "
            "every run back (key, status, attempts, due, lease_until)"
        )
    for guard, text in adapter.guards.items():
        if guard not in GUARDS:
            out.append(f"{name}.guards names {guard!r}: choose from {', '.join(GUARDS)}")
        elif not any(text in q for q in adapter.queries.values()):
            out.append(
                f"{name}.guards[{guard!r}] = {text!r} appears in none of its queries: "
                "copy the guard's text exactly as the SQL has it"
            )
    try:
        adapter.mode()
    except TypeError as e:
        out.append(str(e))
    return out


def claimed_again(d: RunKind) -> bool:
    """Whether a run a lease lapsed on is claimed again (by a retry, by a claim that takes
    lapsed runs, or back in the waiting status): where a stale holder meets a new owner."""
    requeues = any(e == generic.RECLAIM and t in d.waiting for _, e, t in d.transitions)
    return d.lease is not None and (d.retry is not None or d.claim.reclaims or requeues)


WIRE_GUARDS = (
    (
        "claim-waits-on-locks",
        (r"\s+SKIP\s+LOCKED", ""),
        "SKIP LOCKED taken out of the SQL the claim sends and of the schema: a claim waits on "
        "the rows another claim holds",
    ),
    (
        "claim-takes-no-lock",
        (r"\s+FOR\s+(NO\s+KEY\s+)?UPDATE(\s+OF\s+[\w\".,\s]+?)?\s+SKIP\s+LOCKED", ""),
        "FOR UPDATE ... SKIP LOCKED taken out of the SQL the claim sends and of the schema: a "
        "claim reads due runs, then writes them",
    ),
)
"""The guards of a claim that any SKIP LOCKED queue has, found in the SQL a library sends (and
its schema: a claim may be a function) when it names none: a mutant of each, caught where two
claims meet in a transaction (in autocommit a claim of one statement is one step of a block,
inside which no other runs: not derived)."""


def wire_mutant(d: RunKind, adapter: type[Adapter], name: str, edit, why: str) -> Mutant:
    schema = edit_sql(adapter.schema, [edit])
    return Mutant(
        name, d.name, "claim", why, with_attrs(schema=schema, sql_edits={"claim": (edit,)})
    )


def derived_mutants(d: RunKind, adapter: type[Adapter]) -> list[Mutant]:
    """For each guard the adapter names, a mutant of each query containing it, without it;
    and, behind a fence on a claim's token, a stale write carrying the newest claim's token
    (made by the check, so derived for a library that names no SQL as well)."""
    out = []
    for guard, text in adapter.guards.items():
        for query, sql in adapter.queries.items():
            if guard in GUARDS and text in sql:
                edited = sql_edit(adapter.queries, query, text, "")
                out.append(
                    Mutant(
                        f"no-{guard.replace('_', '-')}-in-{query.replace('_', '-')}",
                        d.name,
                        GUARDS[guard],
                        f"query {query!r} without its {guard} guard ({text.strip()!r})",
                        with_attrs(queries=edited),
                    )
                )
    if not adapter.queries and d.claim.skip_locked and d.commits == "transaction":
        out += [wire_mutant(d, adapter, name, edit, why) for name, edit, why in WIRE_GUARDS]
    if claimed_again(d) and d.fence.kinds() & {"attempt", "claim"}:
        out.append(
            Mutant(
                "stale-write-takes-current-token",
                d.name,
                "lease-fence",
                "a stale holder's write carries the token of the run's newest claim, as a write "
                "that reads its fence token back from the row instead of carrying its own",
                with_attrs(current_token=True),
            )
        )
    return out


def required_events(
    d: RunKind, mode: str, owners_only: bool | str = False
) -> tuple[str | Requirement, ...]:
    """What a run must observe to count. A fence whose writes say nothing (``answers=False``)
    shows no refusal, and an owners-only control makes no stale write: neither is required (nor,
    behind an ``unless-terminal`` fence, a refusal in a control: only a stale write meets one)."""
    out: list[str | Requirement] = ["connection lost"]
    again = claimed_again(d)
    events = d.events()  # an owner's writes: its outcome, a failure when it has one, its beat
    writes = ["complete"] + (["fail"] if d.retry is not None or generic.FAIL in events else [])
    writes += ["extend_lease"] if generic.EXTEND in events else []
    guards = {d.fence.of(w) for w in writes}
    if guards != {"none"} and d.fence.answers:
        out.append("lost race")
        if not (owners_only and guards <= {"unless-terminal", "none"}):  # it refuses a write
            out.append("fence rejection")  # only on an ended run: a stale holder's
    if d.lease is not None:
        out.append("reclaim")
        if d.reaps_apart:  # a reaper that failed after some of its writes
            out.append("landed part-way")
        if again and not owners_only:  # a run taken back is claimed again: each write meets it
            out += [f"stale {w} on a re-claimed run" for w in writes]
    fenced = [w for w in writes if d.fence.of(w) in ("attempt", "claim", "row-lock")]
    if d.lease is not None and d.fence.answers and not owners_only:
        # each fenced write refused both on a run nobody holds now and on one another holds
        # (a library whose writes say nothing shows no refusal: its stale writes, counted
        # above, are judged by the rows read back)
        whys = ["no longer claimed"] + (["re-claimed"] if d.retry is not None else [])
        out += [f"fence refusal: {w} ({why})" for w in fenced for why in whys]
    if d.retry is not None and d.retry.backoff != "none":
        out.append("backoff")
    if mode != "own":
        # in autocommit the COMMIT faults meet the next statement (each commits on its own); no
        # claim races another's open COMMIT, and a statement's locks last only as long as it
        commits = d.commits == "transaction"
        out += [
            "worker died before commit",
            "indeterminate commit",
            "indeterminate resolved: committed",
            "indeterminate resolved: not committed",
        ]
        if d.claim.skip_locked and commits:
            out.append("skip locked")
        # a block schedules psycopg's connections (a driver of its own runs none)
        out.append(needs("concurrent block", "concurrency"))
        if d.lease is not None and commits:  # the take-back and a holder's write meet on a row
            out.append(needs("lock wait in a block", "concurrency"))
            if again and not owners_only:  # a holder's completion frozen as its run changes hands
                out.append(needs(frozen_retaken(FaultAnswers.frozen_aim), "concurrency"))
        # each pair that can meet on a row, raced on one; in autocommit an operation of one
        # statement is one step, inside which no other runs: counted where they do, not required
        if commits:
            out += raced(*raced_pairs(d, owners_only))
        if d.external != "none":  # the call, one step of a block's schedule, like a statement
            out.append(needs(IN_A_BLOCK + "send", "concurrency"))
    if d.external != "none":
        out.append("external reply lost")
    if d.external == "at-least-once":
        out.append("duplicate delivery")
    if d.idempotency_key:
        out.append("repeat answered")
    return tuple(out)


def heartbeat_op(d: RunKind) -> str:
    """The name the check gives the heartbeat: ``renew_lease`` behind an id-only fence (or
    none), where a stale beat lands like a stale outcome and, drawn by name after the record's,
    the shrinker shows the stale outcome of two equally short counterexamples."""
    return (
        "renew_lease"
        if d.fence.of("extend_lease") in ("unless-terminal", "none")
        else "extend_lease"
    )


def raced_pairs(d: RunKind, owners_only: bool | str = False) -> list[tuple[str, str]]:
    """The pairs of operations that can touch one row, each to be raced on one in a block
    (:func:`~.blocks.raced`): two claims of a due run; two adds under one key (unless every
    producer keeps keys of its own); with a reaper, the take-back against a claim, a second
    reaper (unless one runs at a time) and the holder's writes (its outcome, its heartbeat:
    unless a control stops writing once the lease lapsed); and, where a lapsed run is claimed
    again, a stale holder's outcome against the new claim (not in a control: it makes no stale
    write). Named as the check names its operations (a heartbeat behind an id-only fence is
    ``renew_lease``)."""
    pairs = [("claim", "claim")]
    if d.keys != "producers":
        pairs.append(("enqueue", "enqueue"))
    if d.lease is None or not d.lease.taken_back_by:
        return pairs
    pairs.append(("claim", "reclaim_stale"))
    if d.lease.reapers == "any":
        pairs.append(("reclaim_stale", "reclaim_stale"))
    if owners_only != "under-lease":
        pairs.append(("reclaim_stale", "record"))
        if generic.EXTEND in d.events():
            pairs.append(("reclaim_stale", heartbeat_op(d)))
    if claimed_again(d) and not owners_only:
        pairs.append(("claim", "record"))
    return pairs


def reaping(d: RunKind, w: int) -> bool:
    """Whether worker ``w`` runs the reaper: w2, the reaper process, when the lease is taken
    back by one; the loop's workers w0 and w1 too, unless one reaper runs at a time
    (``Lease(reapers="one")``: then no block races two)."""
    taken_back = d.lease is not None and bool(d.lease.taken_back_by)
    return taken_back and (w == 2 or d.lease.reapers == "any")
