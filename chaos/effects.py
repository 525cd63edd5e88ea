"""The external effects of a soak, judged by what the contract says of them.

Theory of operation
-------------------

The contract says which external effect a kind has (:class:`~knownstate.model.contract.
ExternalEffect`), and each is judged once here, for every kind that has it:

at-least-once (:func:`at_least_once`)
    a run recorded as done had its external call accepted under the attempt recorded (the
    contract's predicate, on the run's final view with the calls the stand-in accepted); a call
    accepted more than once is allowed, counted, and *attributed*: to the earlier attempt whose
    owner never recorded it — which worker, which attempt, why (its lease lapsed and the reaper
    took it back; its reply was lost; it died after the call) — and to the nemesis periods that
    overlapped that attempt, or to none (it lapsed under load alone). Two acceptances of one
    attempt mean two workers held it: a ``lease-fence`` finding.
create-once-then-poll (:func:`create_once`)
    one creation per run at the external API (the contract's predicate, on the final view with
    the creations the API made), the first one recorded on the run, a succeeded run's operation
    succeeded; a create request the API deduplicated is allowed, counted and attributed to the
    request whose sender never recorded the operation.

The stand-ins record every call with the operation that sent it (a header, or the URL), so a
duplicate is tied to its sender even when the request arrived after the sender gave up.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from knownstate.model.contract import StepView, check_invariants

from .history import Duplicate, History, Op, near

if TYPE_CHECKING:
    from .judge import Change, Replay

STEP = "run"  # a queued run's single step

# ---------------------------------------------------------------------------------------
# At least once: deliveries.
# ---------------------------------------------------------------------------------------


def at_least_once(r: "Replay") -> None:
    """Done means delivered under the attempt recorded; every duplicate attributed."""
    h, done = r.h, r.k.done
    accepted: dict[str, list[tuple[float, Any, str | None]]] = defaultdict(list)
    for t, run, token, code, *sender in h.external.get("deliveries", []):
        if code == 200:
            accepted[str(run)].append((t, token, sender[0] if sender else None))
    for run, row in r.rows.items():
        got = accepted.get(run, [])
        recorded = row.token if row.status == done else None
        finished = int(row.status == done)
        calls = sum(1 for _, token, _ in got if token == recorded)
        view = replace(
            r.view(row, r.steps[run]),
            steps={STEP: StepView(receipts=finished, effects=finished, external_calls=calls)},
        )
        for x in check_invariants(r.contract, {run: view}, {run: view}):
            if x.invariant == "external-effect-semantics":
                last = next((c for c in reversed(r.changes[run]) if c.after.status == done), None)
                op = last.op if last else None
                r.finding(
                    x.invariant,
                    f"{op.inc if op else 'an unlogged writer'} recorded {run} as {done} under "
                    f"{r.k.token_noun} {recorded}, but the stand-in never accepted that "
                    f"{r.k.token_noun}: {x.message}",
                    run,
                    t=op.t1 if op else None,
                    ref=last.audit.ref if last else None,
                )
        original = next((i for i, (_, token, _) in enumerate(got) if token == recorded), 0)
        for i, (t, token, sender) in enumerate(got):
            if i == original:
                continue
            r.v.observed["duplicate delivery"] += 1
            before = [ref for _, att, ref in got[:i] if att == token]
            _attribute_delivery(r, run, t, token, sender, before)


SAID = {
    "lost": "was refused (the fence)",
    "indeterminate": "lost its COMMIT's answer (indeterminate)",
    "conn-lost": "lost its connection",
    "aborted": "was aborted by the server",
    None: "was cut by a kill",
}


def _attribute_delivery(
    r: "Replay", run: str, t: float, attempt: Any, sender: str | None, before: list[str | None]
) -> None:
    """One delivery the stand-in accepted beyond the recorded one. ``sender``: the operation
    whose request it was; ``before``: the senders of earlier acceptances of the same attempt
    (none, unless two workers held one attempt)."""
    h, owned, changes = r.h, r.contract.owned, r.changes[run]
    send = r.ops.get(sender or "")
    if before:
        senders = ", ".join(ref or "?" for ref in [*before, sender])
        r.finding(
            "lease-fence",
            f"the stand-in accepted {run} more than once under {r.k.token_noun} {attempt} "
            f"(sent by {senders}): two workers held the same {r.k.token_noun}",
            run,
            t=t,
            ref=sender,
            periods=near(h, send.proc if send else None, t, t),
        )
        return
    claim = next((c for c in changes if _claimed(c, owned) and c.after.token == attempt), None)
    ended = next(
        (
            c
            for c in changes
            if c.before is not None
            and c.before.status in owned
            and c.before.token == attempt
            and (c.after.status not in owned or c.after.token != attempt)
        ),
        None,
    )
    owner = (claim.op if claim else None) or send
    by = ended.op if ended else None
    who = owner.inc if owner else "?"
    send = send or next(
        (o for o in h.on(run) if o.name == "send" and o.token(run) == attempt), None
    )
    writes = [
        o
        for o in h.on(run)
        if o.name in r.k.owner_writes
        and o.token(run) == attempt
        and o.proc == (owner.proc if owner else None)
    ]
    outcome = next((o for o in reversed(writes) if o.name not in r.k.heartbeats), None)
    if outcome is not None and outcome.out != "won":
        did = f"its {outcome.name} {SAID.get(outcome.out, 'ended ' + str(outcome.out))}"
    elif send is not None and send.out not in ("ok", "won", None):
        did = f"its send got no answer ({send.out})"
    elif outcome is None:
        did = "it never recorded an outcome"
    else:
        did = f"it recorded {outcome.name}"
    if by is not None and by.name in r.k.take_backs:
        cause = f"{did}; its lease lapsed and {by.inc} took it back at {h.rel(by.t0)}"
        until, why = by.t0, "lease lapsed, reclaimed"
    elif by is not None:
        cause = f"{did}; attempt ended by {by.inc} {by.name} at {h.rel(by.t0)}"
        mine = owner is not None and by.proc == owner.proc
        until, why = by.t0, f"owner recorded {by.name} (reply lost)" if mine else by.name
    else:
        cause, until, why = did, t, "never recorded"
    since = owner.t0 if owner else None
    r.v.duplicates.append(
        Duplicate(
            run,
            f"delivery {run} accepted more than once",
            t,
            who,
            attempt,
            cause,
            near(h, owner.proc if owner else None, since, until),
            why,
        )
    )


def _claimed(c: "Change", owned: frozenset[str]) -> bool:
    return c.after.status in owned and (c.before is None or c.before.status not in owned)


# ---------------------------------------------------------------------------------------
# Create once, then poll: operations at the external API.
# ---------------------------------------------------------------------------------------


def create_once(r: "Replay") -> None:
    """One creation per run, recorded on it; every deduplicated request attributed."""
    h, owned = r.h, r.contract.owned
    at_api = {o["id"]: o for o in h.external.get("ops", [])}
    creates: dict[str, list[tuple]] = defaultdict(list)
    for t, run, key, op_id, created, *sender in h.external.get("creates", []):
        creates[run].append((t, key, op_id, created, sender[0] if sender else None))
    for run, requests in creates.items():
        claims = {c.op.name for c in r.changes[run] if c.op is not None and _claimed(c, owned)}
        writers = claims | set(r.k.owner_writes)
        made = [q for q in requests if q[3]]
        row = r.rows.get(run)
        if row is not None and len(made) > 1:
            view = replace(r.view(row, r.steps[run]), external_creations=len(made))
            for x in check_invariants(r.contract, {run: view}, {run: view}):
                if x.invariant != "external-effect-semantics":
                    continue
                t, _, op_id, _, sender = made[1]
                by = r.ops.get(sender or "") or _during(h, run, t, writers)
                during = f", was created during {by.inc} {by.name}({run})" if by else ""
                r.finding(
                    x.invariant,
                    f"{x.message} (one is allowed): the second, operation {op_id}{during}",
                    run,
                    t=t,
                    ref=by.ref if by else None,
                    periods=near(h, by.proc if by else None, t, t),
                )
        for i, (t, _key, _op_id, created, sender) in enumerate(requests[1:], 1):
            if created:
                continue
            r.v.observed["create retried, one creation"] += 1
            previous, first_sender = requests[i - 1][0], requests[i - 1][4]
            first = r.ops.get(first_sender or "") or _during(h, run, previous, claims)
            again = r.ops.get(sender or "") or _during(h, run, t, claims)
            _attribute_create(r, run, (previous, first), (t, again))
        recorded = row.extra.get("op_id") if row is not None else None
        status = row.status if row is not None else None
        if made and status is not None and status not in r.claimable and recorded != made[0][2]:
            r.finding(
                "receipt-with-effect",
                f"{run} is {status} with operation {recorded} recorded, but the API created "
                f"{made[0][2]}",
                run,
            )
        op = at_api.get(recorded)
        if status == r.k.done and op is not None and op["status"] != "succeeded":
            r.finding(
                "receipt-with-effect",
                f"{run} {status}, but its operation {op['id']} is {op['status']}",
                run,
            )


def _during(h: History, run: str, t: float, names) -> Op | None:
    """The operation on ``run`` that was running at ``t`` (the latest begun, if several)."""
    found = [o for o in h.on(run) if o.name in names and o.t0 <= t <= h.until(o)]
    return max(found, key=lambda o: o.t0) if found else None


def _ended(h: History, op: Op | None, otherwise: float) -> float:
    end = h.until(op) if op is not None else otherwise
    return otherwise if end == float("inf") else end


def _attribute_create(
    r: "Replay", run: str, first: tuple[float, Op | None], again: tuple[float, Op | None]
) -> None:
    """A create request the API deduplicated, attributed to the one of the two requests (the
    one that created the operation, the one answered with it) whose sender never recorded the
    operation: usually the first (its start failed after the API acted); the second when the
    first's sender recorded it (the second was sent earlier, by a start that gave up waiting,
    and arrived late)."""
    h = r.h
    (t, owner), (t_again, other) = first, again
    late = owner is not None and owner.out == "won" and other is not None
    if late:
        t, owner = t_again, other
    if owner is None:
        cause = why = "the sender of the request is unknown"
    elif owner.t1 is None:
        cause = f"its process died after the create was sent, before its {owner.name}'s COMMIT"
        why = f"{owner.name} died before COMMIT"
    elif late:
        cause = (
            f"its {owner.name} ended {owner.out}, and its request arrived after the operation "
            "existed"
        )
        why = f"late request of a {owner.name} that ended {owner.out}"
    else:
        cause = f"its {owner.name} ended {owner.out} after the API acted on its create"
        why = f"{owner.name} ended {owner.out}"
    r.v.duplicates.append(
        Duplicate(
            run,
            f"create request for {run} acted on more than once",
            t,
            owner.inc if owner else "?",
            owner.ref if owner else "?",
            cause,
            near(h, owner.proc if owner else None, owner.t0 if owner else t, _ended(h, owner, t)),
            why,
        )
    )
