"""A frontend process's links to several brokers, used like one.

The pool's ledgers are sharded (docs/operations.md, "Several brokers"): each worker is
registered with exactly one broker, so each broker can lease only its own
workers and a slot is never leased twice. A frontend keeps one
``BrokerLink`` per broker (zguide ch. 4, Freelance: the client knows every
server) and this class gives the rest of the frontend the same interface as
one link (``frontend.interfaces.BrokerClient``):

* ``submit`` asks one broker. A refusal (NO_SLOT), or the loss of that
  broker before it accepted, moves the job to the next broker, each broker at
  most once per request; only when every broker refused does the client get
  503, with the smallest Retry-After any of them gave. Nothing is queued.
* The order tried: a broker not heard from for more than
  ``SUSPECT_AFTER_BEATS`` heartbeat intervals goes last (it is probably
  dead: requests that start after a broker dies do not wait for its
  liveness window), then a broker that refused within its own Retry-After;
  otherwise round robin, except that a conversation's follow-up turn goes
  first to the broker that served its previous turn (``ConversationRoutes``),
  whose workers hold its prompt state.
* CANCEL and CREDIT go to the broker that holds the job; ``forget`` ends
  the job's routing there.
* ``status`` merges every live broker's ledger (``frontend.pool_view``).
* A job for a model (``GenerationRequest.model``) asks only the brokers
  whose last STATUS showed a worker of it, in the order above (all of them
  when none did: a broker not yet asked may have it); a broker without a
  loaded worker of it answers ``model_not_found`` or ``loading_model``,
  and the job moves on as after a refusal (issue 30).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections import OrderedDict

from frontend.broker_link import BrokerLink, JobStream
from frontend.interfaces import JobOrigin
from frontend.pool_view import SLOT_ID_STRIDE, merge_statuses, pool_slot_id
from protocol import messages
from protocol.errors import ErrorCode
from protocol.payloads import GenerationRequest, PoolStatus

#: A broker silent for this many heartbeat intervals is tried last: its
#: heartbeat is overdue, though the liveness window has not yet passed.
SUSPECT_AFTER_BEATS = 1.5

#: ERROR codes a broker's link makes up when that broker is gone or forgot
#: us: before ACCEPTED the job held nothing there, so another broker may
#: take it.
_RETRY_ELSEWHERE = frozenset({ErrorCode.BROKER_UNREACHABLE,
                              ErrorCode.BROKER_RESTARTED})
#: ERROR codes of a broker that has no loaded worker of the job's model: the
#: job took no slot there, and another broker may have that model. The
#: client gets one of them only when no broker took the job, "loading"
#: before "not found" (some broker does have the model).
_MODEL_NOT_HERE = (ErrorCode.LOADING_MODEL, ErrorCode.MODEL_NOT_FOUND)


class ConversationRoutes:
    """Which broker served a prompt prefix last, for at most ``capacity``
    prefix fingerprints (least recently used dropped first).

    A follow-up turn repeats the conversation so far, so its leading
    fingerprints (``protocol.prefix``) are those of the previous turn's
    prompt. Sending it to the same broker lets that broker's prefix-aware
    routing find the worker that holds the state. Per frontend process:
    another process starts without the memory, and the turn goes round
    robin (still served; only the prefill is not skipped).
    """

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._broker_of: OrderedDict[int, int] = OrderedDict()

    def remember(self, blocks: list[int], broker_index: int) -> None:
        with self._lock:
            for block in blocks:
                self._broker_of[block] = broker_index
                self._broker_of.move_to_end(block)
            while len(self._broker_of) > self.capacity:
                self._broker_of.popitem(last=False)

    def broker_for(self, blocks: list[int]) -> int | None:
        """The broker that served the longest known prefix of ``blocks``."""
        with self._lock:
            for block in reversed(blocks):
                index = self._broker_of.get(block)
                if index is not None:
                    return index
        return None

    def __len__(self) -> int:
        return len(self._broker_of)


class PoolJobStream:
    """One job's frames, from whichever broker took it.

    A ``FrameStream`` (``frontend.interfaces``), as a link's ``JobStream``.
    Until a broker accepts, ``get`` moves the job along the brokers it was
    given, in order, on a refusal or a lost broker, through the pool's
    ``submit_to``, ``accepted_by`` and ``refused_by``.
    """

    def __init__(self, pool: BrokerPool, job_id: str, request: GenerationRequest,
                 blocks: list[int], order: list[int], id_slot: int = -1,
                 origin: JobOrigin | None = None) -> None:
        self.job_id = job_id
        self._pool = pool
        self._request = request
        self._blocks = blocks
        self._order = order
        #: A slot of that broker's ledger (``order`` is then that broker alone).
        self._id_slot = id_slot
        self._origin = origin
        self._tried = 0
        self._retry_after_s: float | None = None
        #: The most telling "not this model here" answer so far.
        self._model_error: messages.Error | None = None
        self.broker_index = order[0]
        self._stream: JobStream = pool.submit_to(order[0], job_id, request, blocks,
                                                 id_slot, origin)

    @property
    def accepted(self) -> bool:
        return self._stream.accepted

    @property
    def brokers_asked(self) -> int:
        """Brokers the job was submitted to so far (a trace's attribute)."""
        return self._tried + 1

    def get(self, timeout_s: float) -> messages.Message | None:
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self._stream.get(max(0.0, deadline - time.monotonic()))
            if msg is None or self._stream.accepted and not isinstance(
                    msg, messages.Accepted):
                return msg
            if isinstance(msg, messages.Accepted):
                self._pool.accepted_by(self.broker_index, self._blocks)
                return dataclasses.replace(
                    msg, slot_id=pool_slot_id(self.broker_index, msg.slot_id))
            refused = isinstance(msg, messages.NoSlot)
            if refused:
                self._pool.refused_by(self.broker_index, msg.retry_after_s)
                self._retry_after_s = min(msg.retry_after_s, self._retry_after_s
                                          if self._retry_after_s is not None
                                          else msg.retry_after_s)
            elif isinstance(msg, messages.Error) and msg.code in _MODEL_NOT_HERE:
                if self._model_error is None or (
                        msg.code == ErrorCode.LOADING_MODEL):
                    self._model_error = msg
            elif not (isinstance(msg, messages.Error)
                      and msg.code in _RETRY_ELSEWHERE):
                return msg
            if not self._next_broker():
                if self._retry_after_s is not None:
                    # At least one broker is up and full: that is the answer
                    # (503 with the soonest hint), not the lost one's error.
                    return messages.NoSlot(self.job_id, self._retry_after_s)
                return self._model_error or msg

    def _next_broker(self) -> bool:
        self._tried += 1
        if self._tried >= len(self._order):
            return False
        self.broker_index = self._order[self._tried]
        self._stream = self._pool.submit_to(self.broker_index, self.job_id,
                                            self._request, self._blocks,
                                            self._id_slot, self._origin)
        return True


class BrokerPool:
    """Several ``BrokerLink``s with the interface of one (a ``BrokerClient``,
    ``frontend.interfaces``)."""

    def __init__(self, links: list[BrokerLink],
                 routes: ConversationRoutes | None = None) -> None:
        if not links:
            raise ValueError("a broker pool needs at least one link")
        self._links = links
        self.routes = routes or ConversationRoutes()
        #: job id -> index of the broker that holds it now.
        self._job_broker: dict[str, int] = {}
        #: broker index -> monotonic time until which it is taken for full.
        self._full_until: dict[int, float] = {}
        self._turn = itertools.count()

    @property
    def links(self) -> list[BrokerLink]:
        return list(self._links)

    # --- lifecycle -------------------------------------------------------------

    def start(self) -> BrokerPool:
        for link in self._links:
            link.start()
        return self

    def close(self) -> None:
        for link in self._links:
            link.close()

    # --- request-thread API (as BrokerLink) --------------------------------------

    def send(self, msg: messages.Message) -> None:
        """CANCEL and CREDIT go to the broker holding their job; a job no
        broker holds any more has nothing to cancel or credit."""
        index = self._job_broker.get(getattr(msg, "job_id", None))
        if index is not None:
            self._links[index].send(msg)

    def submit(self, job_id: str, request: GenerationRequest,
               prefix_blocks: list[int] | None = None,
               id_slot: int = -1, origin: JobOrigin | None = None) -> PoolJobStream:
        """Submit to the first broker in ``order_for``; see ``PoolJobStream``.

        ``id_slot`` (llama.cpp's, a pool-wide id from ``/slots``): only the
        broker whose ledger has that slot is asked, with its own id for it
        (``frontend.pool_view.pool_slot_id`` in reverse). An id beyond the
        brokers goes to the first, whose ledger does not have it either: the
        client gets the same "Invalid slot ID" as with one broker.

        Raises:
            PayloadTooLarge: as ``BrokerLink.submit`` (before any broker is
                asked).
        """
        self.start()
        blocks = prefix_blocks or []
        if id_slot >= 0:
            index, local = divmod(id_slot, SLOT_ID_STRIDE)
            if index >= len(self._links):
                index, local = 0, id_slot
            return PoolJobStream(self, job_id, request, blocks, [index], local,
                                 origin)
        return PoolJobStream(self, job_id, request, blocks,
                             self.serving(self.order_for(blocks), request.model),
                             origin=origin)

    def slot_action(self, msg: messages.SlotAction) -> JobStream:
        """To the broker whose ledger has the pool-wide slot ``msg.id_slot``,
        with its own id for it, as ``submit`` routes ``id_slot``."""
        self.start()
        index, local = divmod(msg.id_slot, SLOT_ID_STRIDE)
        if index >= len(self._links):
            index, local = 0, msg.id_slot
        self._job_broker[msg.job_id] = index
        return self._links[index].slot_action(
            dataclasses.replace(msg, id_slot=local))

    def serving(self, order: list[int], model: str) -> list[int]:
        """``order`` without the brokers whose last ledger had no worker of
        ``model``; ``order`` itself if none had one (or none is known)."""
        if not model:
            return order
        known = [i for i in order if _has_model(self._links[i], model)]
        return known or order

    def forget(self, job_id: str) -> None:
        index = self._job_broker.pop(job_id, None)
        if index is not None:
            self._links[index].forget(job_id)

    def order_for(self, blocks: list[int], now: float | None = None) -> list[int]:
        """Broker indexes in the order a new job tries them."""
        now = time.monotonic() if now is None else now
        n = len(self._links)
        start = next(self._turn) % n
        preferred = self.routes.broker_for(blocks) if blocks else None

        def rank(index: int) -> tuple:
            return (
                self._suspect(index, now),
                self._full_until.get(index, 0.0) > now,
                index != preferred,
                (index - start) % n,
            )

        return sorted(range(n), key=rank)

    def status(self, timeout_s: float, max_age_s: float = 0.0) -> PoolStatus | None:
        """Every answering broker's ledger, merged; None if none answers.

        The brokers are asked in parallel, so this takes at most
        ``timeout_s`` however many are down, and a broker known to be gone
        costs nothing.
        """
        self.start()
        # A broker heard before and silent past its liveness window is not
        # asked: /health must not wait out its timeout during an outage.
        asked = [i for i, link in enumerate(self._links)
                 if link.broker_alive() or link.last_heard == 0.0]
        if max_age_s > 0:
            # Every request resolves its model from a catalog this fresh
            # (``model_resolution``): no thread per broker when the snapshots
            # at hand will do.
            cached = [(i, self._links[i].cached_status(max_age_s)) for i in asked]
            if asked and all(reply is not None for _, reply in cached):
                return merge_statuses(cached)
        replies: list[tuple[int, PoolStatus]] = []
        lock = threading.Lock()

        def ask(index: int) -> None:
            reply = self._links[index].status(timeout_s, max_age_s)
            if reply is not None:
                with lock:
                    replies.append((index, reply))

        threads = [threading.Thread(target=ask, args=(i,), daemon=True)
                   for i in asked]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout_s + 1.0)
        with lock:
            return merge_statuses(list(replies))

    @property
    def last_heard(self) -> float:
        return max(link.last_heard for link in self._links)

    def broker_alive(self) -> bool:
        return any(link.broker_alive() for link in self._links)

    @property
    def malformed_dropped(self) -> int:
        return sum(link.malformed_dropped for link in self._links)

    @property
    def broker_losses(self) -> int:
        return sum(link.broker_losses for link in self._links)

    # --- one broker's part in a job (what ``PoolJobStream`` calls) -----------------

    def submit_to(self, index: int, job_id: str, request: GenerationRequest,
                  blocks: list[int], id_slot: int = -1,
                  origin: JobOrigin | None = None) -> JobStream:
        """Submit the job to broker ``index`` alone; CANCEL and CREDIT for it
        go there from now on. A broker that had the job before (it refused,
        or was lost before it accepted) forgets it first."""
        previous = self._job_broker.get(job_id)
        if previous is not None and previous != index:
            self._links[previous].forget(job_id)
        self._job_broker[job_id] = index
        return self._links[index].submit(job_id, request, blocks, id_slot, origin)

    def accepted_by(self, index: int, blocks: list[int]) -> None:
        """Broker ``index`` took a job: it is not full, and the job's prompt
        prefix is routed to it next time (``ConversationRoutes``)."""
        self._full_until.pop(index, None)
        if blocks:
            self.routes.remember(blocks, index)

    def refused_by(self, index: int, retry_after_s: float) -> None:
        """Broker ``index`` answered NO_SLOT with ``retry_after_s``."""
        # Tried last until its own hint says a slot may be free; a refusal
        # costs one round trip, so the hint is capped at one second.
        self._full_until[index] = time.monotonic() + min(retry_after_s, 1.0)

    # --- internals ------------------------------------------------------------------

    def _suspect(self, index: int, now: float) -> bool:
        link = self._links[index]
        heard = link.last_heard
        if heard == 0.0:
            return not link.broker_alive()
        return now - heard > SUSPECT_AFTER_BEATS * link.heartbeat_interval_s


def _has_model(link: BrokerLink, model: str) -> bool:
    """Whether the link's last STATUS showed a worker of ``model`` (by name
    or alias): the frontend resolved it in the merged ledger, by name."""
    status = link.latest_status
    if status is None:
        return False
    return (any(slot.model == model for slot in status.slots)
            or any(model in m.aliases for m in status.models))
