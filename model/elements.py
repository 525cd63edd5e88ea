"""The elements of a described run kind: its claim, lease, fence and retry policy, and
durations in the user's units.

Each element is one of the contract's questions, answered for one kind (:class:`Claim`: how a
worker takes a run; :class:`Lease`: how a dead owner is detected; :class:`Fence`: what keeps a
stale owner's write out; :class:`Retry`: how failed attempts are bounded and spaced).
:class:`~knownstate.model.describe.RunKind` holds them, and checks them against each other.
Import them from :mod:`knownstate.model.describe`, where a description is written.

This module is pure: no I/O.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

# ---------------------------------------------------------------------------------------
# Durations in the user's units.
# ---------------------------------------------------------------------------------------

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"^\s*(\d+)\s*([smhd])\s*$")


def seconds(value: object) -> int:
    """Whole seconds from a number, a timedelta or ``"90s"``/``"5m"``/``"2h"``/``"1d"``."""
    if isinstance(value, dt.timedelta):
        total = value.total_seconds()
    elif isinstance(value, bool):
        raise ValueError(f"a duration, not {value!r}: give seconds, a timedelta or '5m'")
    elif isinstance(value, (int, float)):
        total = float(value)
    elif isinstance(value, str) and _DURATION.match(value):
        number, unit = _DURATION.match(value).groups()
        total = int(number) * _UNITS[unit]
    else:
        raise ValueError(
            f"{value!r} is not a duration: give seconds, a timedelta, or a "
            "string like '90s', '5m', '2h'"
        )
    if total != int(total) or total <= 0:
        raise ValueError(f"{value!r}: a duration is a positive whole number of seconds")
    return int(total)


Seconds = Annotated[int, BeforeValidator(seconds)]

# ---------------------------------------------------------------------------------------
# The elements.
# ---------------------------------------------------------------------------------------

STRICT = ConfigDict(frozen=True, extra="forbid")


class Claim(BaseModel):
    """How a worker takes a run: exactly one worker owns it."""

    model_config = STRICT
    how: str = Field(description="the claim, in a sentence, as the contract table shows it")
    skip_locked: bool = Field(
        True,
        description="the claim skips, never waits on, rows another "
        "worker is claiming (FOR UPDATE SKIP LOCKED)",
    )
    order: Literal["created", "due"] = Field(
        "created", description="which due runs a claim takes first: oldest created, or soonest due"
    )
    reclaims: bool = Field(
        False,
        description="the claim also takes owned runs whose lease lapsed, as they are (a claim "
        "that re-picks stale work itself, with no reaper between): needs "
        "'<owned> -claim-> <owned>'",
    )
    unscheduled: Literal["at-enqueue", "always", "application"] = Field(
        "at-enqueue",
        description="when a run added without a schedule is due: from the database's now at "
        "enqueue, or always (a NULL schedule, due whatever the clock says, even moved back), or "
        "from the application's now at enqueue (chancy's Job.scheduled_at): due when the "
        "database's clock reaches it. The application's clock is the one the gate hands the "
        "adapter (Adapter.now()): it starts where the database's does and none of the gate's "
        "database clock jumps move it, so the skew between them is at most the jumps drawn "
        "(RunKind.clock_skew bounds it)",
    )
    most: int | None = Field(
        None,
        ge=1,
        description="the most runs one claim takes (None: as many as asked); a library that "
        "fetches one job per call (a worker running N at once calls N times) says 1",
    )


class Lease(BaseModel):
    """How a dead owner is detected: a lease, its clock, its heartbeat and its reaper."""

    model_config = STRICT
    seconds: Seconds = Field(description="how long a claim lasts without a heartbeat")
    clock: Literal["database", "application"] = Field(
        "database", description="whose clock stamps and judges the lease"
    )
    heartbeat: Seconds | None = Field(
        None, description="an owner extends its lease this often (on a timer); None: it never does"
    )
    per: Literal["run", "worker"] = Field(
        "run",
        description="whose lease it is: each run's own (a claim stamps it), or its worker's (a "
        "worker's first claim registers it; one beat extends every run it holds, and a claim "
        "stamps nothing: a run's lease lapses when its worker's last beat is that old)",
    )
    lapsed_workers: Literal["kept", "forgotten"] = Field(
        "kept",
        description="with a lease per worker: what a worker's beat (or its first claim) does "
        "to the other workers whose lease lapsed: keeps them (a later beat of theirs, or the "
        "clock moving back, revives their runs' leases), or forgets them (chancy's "
        "announce_worker deletes their rows: their runs stay lapsed whatever the clock does, "
        "until they beat again)",
    )
    taken_back_by: tuple[str, ...] = Field(
        (),
        description="the events by which a lapsed lease's run is taken back (the reaper's, or "
        "a read's that heals); none when the claim itself re-picks it (Claim(reclaims=True))",
    )
    requeue_clock: Literal["database", "application", "unchanged"] = Field(
        "database",
        description="whose clock schedules a run the reaper puts back: the database's (due at "
        "once), or the application's (a library that stamps its own now, as procrastinate's "
        "retry_job does): due when the database's clock reaches the application's, which "
        "the gate keeps a week ahead (knownstate.model.generic.APP_AHEAD); or nobody's "
        "(unchanged: the reaper leaves the schedule the run had, as chancy's Recovery does)",
    )
    reapers: Literal["any", "one"] = Field(
        "any",
        description="how many reapers run at once: any worker may reap (the gate races two or "
        "three), or one at a time (a single reaper process, or a periodic task with a lock: "
        "procrastinate's stalled-jobs task deployed with lock=...)",
    )
    reaps: Literal["together", "one-by-one"] = Field(
        "together",
        description="how the reaper's writes commit: every lapsed run taken back in one "
        "transaction, or one-by-one: it reads the lapsed runs, then takes each back in a "
        "transaction of its own (procrastinate's stalled-jobs task: get_stalled_jobs, then "
        "retry_job per job), so a failure part-way leaves any of them taken back and the rest "
        "held (in a concurrent block a reaper that answered is still judged as one step)",
    )
    how: str = Field("", description="the lease, in a sentence (default: from the fields)")
    reaper: str = Field("", description="the reaper, in a sentence (default: from the fields)")


FenceKind = Literal["attempt", "claim", "status", "row-lock", "unless-terminal", "none"]
OwnerWrite = Literal["complete", "fail", "extend_lease"]


class Fence(BaseModel):
    """What stops an owner that lost its lease from writing."""

    model_config = STRICT
    kind: FenceKind = Field(
        description="attempt: writes match the claimed attempt; claim: writes match a token "
        "each claim sets afresh (a claim id: no count the rows show); status: writes match only "
        "the owned status; row-lock: each write locks the row and checks it is still "
        "the caller's; unless-terminal: writes match the run's id only and land unless the "
        "run ended (a heartbeat only stamps the lease); none: nothing (checked for the "
        "violation that follows)"
    )
    answers: bool = Field(
        True,
        description="False: the library's writes say nothing of whether they landed (they "
        "return None either way); each is judged by the rows read back, and no refusal is "
        "counted that the library did not show",
    )
    operations: dict[OwnerWrite, FenceKind] = Field(
        default_factory=dict,
        description="a guard of its own for some of an owner's writes (complete, fail, "
        "extend_lease), where the library's differ: a finish matching the claim's attempt "
        "beside a heartbeat by id only is kind='attempt', operations={'extend_lease': "
        "'unless-terminal'}; the writes not named have kind's (default: none named)",
    )
    how: str = Field("", description="the fence, in a sentence (default: from the kind)")

    def of(self, write: str) -> str:
        """The guard of an owner's ``write`` (complete, fail, extend_lease)."""
        return self.operations.get(write, self.kind)

    def kinds(self) -> frozenset[str]:
        """Every guard an owner's writes have."""
        return frozenset({self.kind, *self.operations.values()})


class Retry(BaseModel):
    """How retries are bounded and spaced."""

    model_config = STRICT
    max_attempts: int = Field(ge=1, description="attempts at most; then the run is given up")
    backoff: Literal["exponential", "fixed", "none"] = Field(
        "exponential",
        description="how a failed run is spaced: a wait growing from base (up to cap), a fixed "
        "one, or none: the run keeps the schedule it had (a library with no backoff of its "
        "own, as chancy without its Retry plugin) and is due again at once. Without a base, "
        "none",
    )
    base: Seconds | None = Field(
        None, description="the wait after the first failed attempt (not with backoff='none')"
    )
    cap: Seconds | None = Field(None, description="the longest wait (exponential backoff)")
    counts: Literal["claims", "retries", "executions"] = Field(
        "claims",
        description="what the library's attempts column counts: claims (a claim adds one, "
        "so the n-th run of the work is attempt n), retries (0 on the first run; a retry "
        "adds one, a claim none), or executions (each run of the work that finished adds "
        "one, succeeded or failed, as chancy counts; a claim none). max_attempts is compared "
        "with that count: retries at most, or runs of the work at most",
    )
    decided_by: Literal["row", "worker"] = Field(
        "row",
        description="where the give-up is decided: on the count the row has when the write "
        "lands (in SQL), or on the count the worker read when it claimed (in the application)",
    )
    taken_back: Literal["unchanged", "one-more"] = Field(
        "unchanged",
        description="what a take-back by the reaper does to the limit: nothing, or allows the "
        "run one more attempt (chancy's Recovery adds one to the job's max_attempts; the "
        "rows then show each run's limit, in a max_attempts column)",
    )
    how: str = Field("", description="the policy, in a sentence (default: from the fields)")

    @model_validator(mode="before")
    @classmethod
    def _no_base_no_backoff(cls, data):
        if isinstance(data, dict) and "backoff" not in data and data.get("base") is None:
            return {**data, "backoff": "none"}
        return data

    @model_validator(mode="after")
    def _spaced(self) -> "Retry":
        if self.backoff == "none" and (self.base is not None or self.cap is not None):
            raise ValueError("Retry(backoff='none') waits nothing: drop base and cap")
        if self.backoff != "none" and self.base is None:
            raise ValueError(
                f"Retry(backoff={self.backoff!r}) needs base= (the first wait), or say "
                "backoff='none'"
            )
        return self

    def runs(self, count: int) -> int:
        """How many times the work ran, from the library's ``count`` of attempts read as it was
        claimed (counting retries or executions, the current run is one more)."""
        return count if self.counts == "claims" else count + 1

    def spent(self, count: int, limit: int) -> bool:
        """Whether a failure at ``count`` (read as the run was claimed) is the last allowed:
        ``limit`` retries made, or ``limit`` runs of the work."""
        return (count if self.counts == "retries" else self.runs(count)) >= limit

    def wait(self, attempts: int, scale: int = 1) -> int:
        """Seconds a run waits after its ``attempts``-th attempt (run of the work) failed."""
        if self.backoff == "none":
            return 0
        if self.backoff == "fixed":
            return self.base * scale
        cap = (self.cap or self.base * 2**30) * scale
        return min(cap, self.base * scale * 2 ** max(0, attempts - 1))
