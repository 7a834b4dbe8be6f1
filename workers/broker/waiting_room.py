"""Jobs that wait for a slot: bounded, fair between keys, bound late to the
cache (``--queue-max``, ``--queue-max-tokens``, ``--queue-timeout-s``).

Off by default: a job that finds every slot busy gets NO_SLOT at once (the
seed's 503). On, it waits, bounded three ways: the number of waiting jobs,
their prompt tokens (counted where the frontend counted them), and a
deadline (the broker's timeout, or less when the request asks). A job beyond
a bound, or past its deadline, gets NO_SLOT; one whose frontend cancels it
(its client left) is gone at once and nothing is ever run for it.

Who gets a freed slot:

* **Fair between keys, by least recent service.** Each key (``Submit.client``,
  a keyed hash: the broker never sees a key) has a count of the tokens its
  jobs were served, prompt and generated, halved every ``HALF_LIFE_S``. The
  slot goes to a waiting job of the key with the least. This is what deficit
  round robin over tokens approximates with quanta and rounds, without
  either: a key with 50 waiting jobs has been served far more than one with
  a single job, so the single job goes first, and a key that was idle a
  while comes back at the front. Tokens, not jobs, so that one key's long
  jobs do not count as little as another's short ones. No weights: every
  key counts the same.
* **Bound late to the cache.** Among that key's jobs, the one whose prompt
  an idle worker holds best (the ledger's prefix blocks) goes first, then
  the oldest. A job is matched to a worker when a slot frees, not when it
  arrives (the Gateway API inference extension's "scheduling regret").

A waiting job's frontend hears its place in line (QUEUED, in arrival order)
when it starts to wait and again whenever it moves up, at most once a
second (``POSITION_UPDATE_S``): a streamed request shows it to its client
(``frontend.queued_stream``).
"""

from __future__ import annotations

import dataclasses
import math
import time

from protocol import messages, timing

#: Service counts halve this often: "recently" is the last minute or two.
HALF_LIFE_S = 60.0
#: How often waiters whose place in line moved up are told (QUEUED again).
POSITION_UPDATE_S = 1.0
#: A lease's length before any has ended, for the Retry-After of a queue.
FIRST_LEASE_GUESS_S = 5.0


@dataclasses.dataclass
class Waiter:
    """One job waiting for a slot, with its SUBMIT as it came."""

    job_id: str
    frontend: bytes
    submit: messages.Submit
    raw: list[bytes]
    blocks: list[int]
    n_tokens: int
    since: float
    deadline: float
    #: The place in line its frontend was last told (QUEUED).
    told_position: int = 0

    @property
    def client(self) -> str:
        return self.submit.client

    @property
    def model(self) -> str:
        """The model whose slot it waits for ("": any)."""
        return self.submit.request.model


class WaitingRoom:
    """The broker's waiting jobs (module doc).

    Args:
        max_jobs: how many may wait (0: none, NO_SLOT at once).
        max_tokens: their prompt tokens together (0: no bound).
        timeout_s: the longest wait.
        fair: least recent service first (module doc); False: the oldest
            waiter first, whatever its key (``--queue-order fifo``).
    """

    def __init__(self, max_jobs: int, max_tokens: int, timeout_s: float,
                 fair: bool = True) -> None:
        self.max_jobs = max_jobs
        self.fair = fair
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.waiters: dict[str, Waiter] = {}  # in arrival order
        self.tokens = 0
        self._service: dict[str, tuple[float, float]] = {}  # client: (tokens, at)
        self._clients: dict[str, str] = {}  # running job: its client
        self._lease_s = FIRST_LEASE_GUESS_S
        self._started: dict[str, float] = {}

    def __bool__(self) -> bool:
        return self.max_jobs > 0

    def __len__(self) -> int:
        return len(self.waiters)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self.waiters

    # --- arrivals and departures ------------------------------------------------------

    def admit(self, frontend: bytes, submit: messages.Submit, raw: list[bytes],
              blocks: list[int], now: float) -> Waiter | None:
        """Let the job wait, or None if a bound is reached."""
        n_tokens = len(submit.request.prompt_tokens or ())
        if len(self.waiters) >= self.max_jobs or (
                self.max_tokens and self.tokens + n_tokens > self.max_tokens):
            return None
        wait_s = self.timeout_s
        if submit.max_wait_s > 0:
            wait_s = min(wait_s, submit.max_wait_s)
        waiter = Waiter(submit.job_id, frontend, submit, raw, blocks, n_tokens,
                        since=now, deadline=now + wait_s)
        self.waiters[submit.job_id] = waiter
        self.tokens += n_tokens
        return waiter

    def remove(self, job_id: str, frontend: bytes | None = None) -> Waiter | None:
        """Take a job out (cancelled, or served); None if it is not waiting
        (or is another frontend's)."""
        waiter = self.waiters.get(job_id)
        if waiter is None or (frontend is not None and waiter.frontend != frontend):
            return None
        del self.waiters[job_id]
        self.tokens -= waiter.n_tokens
        return waiter

    def drop_frontend(self, frontend: bytes) -> list[Waiter]:
        """Everything a frontend that is gone left waiting."""
        return [self.remove(w.job_id) for w in list(self.waiters.values())
                if w.frontend == frontend]

    def expire(self, now: float) -> list[Waiter]:
        """The jobs whose deadline has passed, taken out."""
        return [self.remove(w.job_id) for w in list(self.waiters.values())
                if w.deadline <= now]

    def next_deadline(self) -> float | None:
        return min((w.deadline for w in self.waiters.values()), default=None)

    def position(self, waiter: Waiter) -> int:
        """Jobs ahead of it, were slots given in arrival order (fairness may
        serve it sooner)."""
        return list(self.waiters).index(waiter.job_id)

    # --- who is next ------------------------------------------------------------------

    def pick(self, held_blocks, now: float) -> Waiter | None:
        """The job a freed slot goes to (module doc), taken out.

        ``held_blocks(waiter)``: the most of its prefix blocks an idle
        worker of its model holds, or None when its model has no idle slot
        (a freed slot of model A never goes to a job for model B).
        """
        held = {job_id: held_blocks(w) for job_id, w in self.waiters.items()}
        servable = [w for w in self.waiters.values() if held[w.job_id] is not None]
        if not servable:
            return None
        if not self.fair:
            return self.remove(servable[0].job_id)
        first_seen: dict[str, int] = {}
        for i, w in enumerate(servable):
            first_seen.setdefault(w.client, i)
        client = min(first_seen, key=lambda c: (self.service(c, now), first_seen[c]))
        mine = [w for w in servable if w.client == client]
        best = max(mine, key=lambda w: (held[w.job_id], -w.since))
        return self.remove(best.job_id)

    def service(self, client: str, now: float) -> float:
        """The client's tokens served, decayed to now."""
        tokens, at = self._service.get(client, (0.0, now))
        return tokens * 0.5 ** ((now - at) / HALF_LIFE_S)

    def _charge(self, client: str, tokens: float, now: float) -> None:
        self._service[client] = (self.service(client, now) + tokens, now)

    def on_start(self, submit: messages.Submit, now: float) -> None:
        """A job got a slot (waited or not): its prompt counts as service."""
        self._clients[submit.job_id] = submit.client
        self._started[submit.job_id] = now
        self._charge(submit.client, len(submit.request.prompt_tokens or ()), now)

    def on_end(self, job_id: str, msg: messages.Message | None, now: float) -> None:
        """A job's lease ended: its generated tokens count as service, and its
        length goes into the Retry-After of a queue."""
        client = self._clients.pop(job_id, None)
        started = self._started.pop(job_id, None)
        if client is None:
            return
        if isinstance(msg, messages.Final):
            self._charge(client, msg.usage.completion_tokens, now)
        if started is not None:
            self._lease_s = 0.8 * self._lease_s + 0.2 * (now - started)
        # Forget keys whose service has decayed to nothing (bounded memory).
        if len(self._service) > 4 * (len(self._clients) + len(self.waiters)) + 64:
            self._service = {c: v for c, v in self._service.items()
                             if self.service(c, now) >= 1.0 or c in self._clients.values()}

    def queue_wait_s(self, live_slots: int, model: str = "") -> float:
        """How much longer than the busy slots' own estimate a job waits for
        the queue ahead of it (of ``model``'s jobs; "": all): one lease per
        slot-full of waiters."""
        ahead = (len(self.waiters) if not model else
                 sum(1 for w in self.waiters.values() if w.model == model))
        if not ahead or live_slots <= 0:
            return 0.0
        return ahead / live_slots * self._lease_s


class WaitingJobs:
    """What the broker does with its waiting room: queue a job that found no
    slot, hand freed slots out, expire, and cancel (``Broker`` calls these).
    """

    def __init__(self, broker) -> None:
        s = broker.settings
        self.broker = broker
        self.room = WaitingRoom(s.queue_max, s.queue_max_tokens, s.queue_timeout_s,
                                fair=s.queue_order == "fair")
        #: When waiters may next be told their new places (``_tell_positions``).
        self._positions_due = 0.0

    def wait(self, ident: bytes, msg: messages.Submit, raw: list[bytes],
             blocks: list[int], now: float) -> bool:
        """True if the job, which found no slot, now waits (QUEUED sent) or
        was refused for its key (RATE_LIMITED sent); False: it gets NO_SLOT (no queue, a bound reached, or ``id_slot``,
        which asks for one busy slot and is answered at once as before)."""
        b = self.broker
        if not self.room or msg.id_slot != -1:
            return False
        limited = b.key_accounts.queue_full(
            msg, lambda: self.retry_after_s(now, msg.request.model))
        if limited is not None:  # its key's own bound on waiting jobs: 429
            b.to_frontend(ident, limited)
            return True
        waiter = self.room.admit(ident, msg, raw, blocks, now)
        if waiter is None:
            b.counters.queue_full += 1
            self._counts(msg.request.model).queue_full += 1
            return False
        b.counters.queued += 1
        self._counts(waiter.model).queued += 1
        b.key_accounts.on_queued(msg)
        waiter.told_position = self.room.position(waiter)
        b.to_frontend(ident, messages.Queued(
            msg.job_id, waiter.told_position, waiter.deadline - now))
        return True

    def serve(self, now: float) -> None:
        """Freed slots to waiting jobs, then NO_SLOT to those past their
        deadline."""
        b, ledger = self.broker, self.broker.ledger
        while self.room.waiters and ledger.free_slots():
            idle: dict[str, list] = {}

            def held_blocks(w: Waiter) -> int | None:
                slots = idle.get(w.model)
                if slots is None:
                    slots = idle[w.model] = ledger.idle_slots(w.model)
                return (max(s.routing_blocks(w.blocks) for s in slots)
                        if slots else None)

            waiter = self.room.pick(held_blocks, now)
            if waiter is None:
                break  # the free slots are of models nobody waits for
            slot = ledger.assign(waiter.job_id, waiter.frontend, now, waiter.blocks,
                                 waiter.model)
            b.stats.waited(slot.info.model, now - waiter.since)
            b.start_job(waiter.frontend, waiter.submit, waiter.raw, slot, now)
            self._left_queue(waiter.job_id, "started", now)
        for waiter in self.room.expire(now):
            self._left_queue(waiter.job_id, "expired", now)
            b.counters.queue_expired += 1
            b.counters.no_slot += 1
            counts = self._counts(waiter.model)
            counts.queue_expired += 1
            counts.no_slot += 1
            b.to_frontend(waiter.frontend, messages.NoSlot(
                waiter.job_id, self.retry_after_s(now, waiter.model)))
        self._tell_positions(now)

    def _tell_positions(self, now: float) -> None:
        """Each waiter whose place in line moved up since its frontend was
        told hears it (QUEUED again, with the wait it has left), so a
        streamed waiter's client sees its progress. At most once per waiter
        every ``POSITION_UPDATE_S``, and only on a change: a place only
        moves up (later jobs line up behind), so a waiter hears at most its
        first place's worth of updates, however busy the queue."""
        if now < self._positions_due or not self.room.waiters:
            return
        self._positions_due = now + POSITION_UPDATE_S
        for position, waiter in enumerate(self.room.waiters.values()):
            if position < waiter.told_position:
                waiter.told_position = position
                self.broker.to_frontend(waiter.frontend, messages.Queued(
                    waiter.job_id, position, max(0.0, waiter.deadline - now)))

    def retry_after_s(self, now: float, model: str = "") -> float:
        """The busy slots' estimate, plus the queue ahead (of ``model``'s
        slots and jobs; "": all)."""
        ledger = self.broker.ledger
        extra = self.room.queue_wait_s(ledger.live_slots(model), model)
        base = ledger.retry_after_s(now, model)
        return base if extra == 0 else min(timing.RETRY_AFTER_MAX_S,
                                           float(math.ceil(base + extra)))

    def next_deadline(self) -> float | None:
        return self.room.next_deadline()

    def cancel(self, frontend: bytes, job_id: str) -> bool:
        """True if the job was waiting: it is gone, and nothing ran for it."""
        waiter = self.room.remove(job_id, frontend)
        if waiter is None:
            return False
        self.broker.counters.queue_left += 1
        self._counts(waiter.model).queue_left += 1
        self._left_queue(job_id, "left", time.monotonic())
        return True

    def frontend_gone(self, ident: bytes) -> None:
        gone = self.room.drop_frontend(ident)
        self.broker.counters.queue_left += len(gone)
        for waiter in gone:
            self._counts(waiter.model).queue_left += 1
            self._left_queue(waiter.job_id, "left", time.monotonic())

    def _counts(self, asked: str):
        """The per-model totals (``PoolStats.of``) of the model a job asked
        for, by its name ("": it named none)."""
        b = self.broker
        return b.stats.of((b.ledger.models.resolve(asked) or asked) if asked else "")

    def with_waiting(self, models: list) -> list:
        """``models`` (a snapshot's ``ModelStatus`` records), each with the
        jobs waiting now for it (by its name, aliases resolved)."""
        b = self.broker
        counts: dict[str, int] = {}
        for waiter in self.room.waiters.values():
            model = b.ledger.models.resolve(waiter.model) or waiter.model
            counts[model] = counts.get(model, 0) + 1
        return [dataclasses.replace(m, jobs_waiting=counts.get(m.name, 0))
                for m in models]

    def _left_queue(self, job_id: str, outcome: str, now: float) -> None:
        """The job left the queue (its key's count and its trace)."""
        if outcome != "started":
            self.broker.key_accounts.on_dequeued(job_id)
        if self.broker.traces is not None:
            self.broker.traces.on_dequeued(job_id, outcome, now)

    def on_start(self, msg: messages.Submit, now: float) -> None:
        self.room.on_start(msg, now)
        self.broker.key_accounts.on_start(msg, now)

    def on_end(self, job_id: str, msg: messages.Message | None, now: float) -> None:
        self.room.on_end(job_id, msg, now)
        self.broker.key_accounts.on_end(job_id, msg, now)
