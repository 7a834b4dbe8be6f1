"""Whether a worker's cache claims are believed: checked against what it
then reuses.

Prefix routing (``workers.broker.ledger``) gives a job to the idle worker
that says it holds the most of the job's prompt: its CACHE_REPORT
fingerprints, and the prompts the broker gave it since. A worker that claims
the fingerprints of prompts it never saw would attract them all (issue 29:
one that claimed 40 prompts got 40 of 40 jobs, against 0 of 40 without the
claim). The FINAL of such a job says how many prompt tokens the worker
really served from its cache (``Usage.cached_tokens``), so every claim that
placed, or could have placed, a job is checked there.

The rule, per worker (``ClaimTrust``):

* A claim of ``k`` blocks is kept when the job reused at least
  ``max(1, (k - 1) * BLOCK_TOKENS)`` tokens. An honest worker reuses all
  ``k`` blocks but the last prompt token, or one block less when it skips a
  restore that would save less than a block over its live sequence
  (``workers.model.prompt_reuse``); one that holds nothing reuses 0.
* Only claims that can be checked count: a FINAL that is not ``cancelled``
  (a job cancelled before its prefill reports no reuse), of a generation
  (not an embedding) that allowed reuse (``cache_prompt``).
* The score starts at ``START_SCORE``; a kept claim takes 1 off (down to 0),
  a failed one adds ``FAILED_CLAIM_COST`` (up to ``MAX_SCORE``). While the
  score is ``DISTRUST_AT`` or more, the worker's claims steer no routing: it
  competes as if it held nothing (least recently used), and the claims it
  would have made are still checked, so an honest worker whose cache was
  evicted at a bad moment is trusted again after one or two kept claims,
  and a liar at the cap after five, which it cannot keep without really
  reusing (or lying in its FINAL too: the check raises the bar, it proves
  nothing about a worker that lies everywhere; that needs a worker key).
* A new registration starts over at ``START_SCORE``, one failed claim from
  distrust: a liar that reconnects wins one job per registration.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from protocol import messages
from protocol.payloads import EMBEDDING
from protocol.prefix import BLOCK_TOKENS

if TYPE_CHECKING:
    from workers.broker.broker import Broker
    from workers.broker.ledger import Job, WorkerSlot

START_SCORE = 2
FAILED_CLAIM_COST = 2
MAX_SCORE = 8
DISTRUST_AT = 4


def claim_kept(claimed_blocks: int, cached_tokens: int) -> bool:
    """Whether a job that its worker claimed ``claimed_blocks`` of, and that
    reused ``cached_tokens``, bore the claim out (see the module's rule)."""
    return cached_tokens >= max(1, (claimed_blocks - 1) * BLOCK_TOKENS)


@dataclasses.dataclass
class ClaimTrust:
    """One worker's claim score (0 .. ``MAX_SCORE``; lower is better)."""

    score: int = START_SCORE
    kept: int = 0
    failed: int = 0

    @property
    def trusted(self) -> bool:
        return self.score < DISTRUST_AT

    def record(self, kept: bool) -> bool:
        """Count one checked claim; True if it just made the worker
        distrusted."""
        was_trusted = self.trusted
        if kept:
            self.kept += 1
            self.score = max(0, self.score - 1)
        else:
            self.failed += 1
            self.score = min(MAX_SCORE, self.score + FAILED_CLAIM_COST)
        return was_trusted and not self.trusted


def checkable(final: messages.Final) -> bool:
    """Whether a FINAL's usage can check a claim (not a cancelled job)."""
    return final.finish_reason != messages.FinishReason.CANCELLED


class ClaimChecks:
    """The broker's policy: note at assignment which jobs can check their
    worker's claim, and score the claim when the job ends."""

    def __init__(self, broker: Broker) -> None:
        self._broker = broker

    @staticmethod
    def on_assign(job: Job, submit: messages.Submit) -> None:
        # Reuse is what a FINAL's cached_tokens measures: not for an
        # embedding, nor for a request that asked for none.
        job.check_claim = (submit.request.kind != EMBEDDING
                           and submit.request.cache_prompt)

    def on_finish(self, slot: WorkerSlot | None, job: Job,
                  msg: messages.Message) -> None:
        if (slot is None or not job.claimed_blocks or not job.check_claim
                or not isinstance(msg, messages.Final) or not checkable(msg)):
            return
        b = self._broker
        cached_tokens = msg.usage.cached_tokens
        kept = claim_kept(job.claimed_blocks, cached_tokens)
        if kept:
            b.counters.cache_claims_kept += 1
        else:
            b.counters.cache_claims_failed += 1
        if slot.claims.record(kept):
            b.counters.workers_distrusted += 1
            b.log.warning(
                "claims distrusted", "worker's cache claims failed: slot=%d "
                "pid=%d host=%s claimed %d blocks of %s and reused %d tokens "
                "(%d of its claims failed, %d kept); its claims steer no "
                "routing until it keeps them", slot.slot_id, slot.info.pid,
                slot.info.host, job.claimed_blocks, job.named(), cached_tokens,
                slot.claims.failed, slot.claims.kept)
