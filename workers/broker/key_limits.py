"""Limits and usage per named API key, at the broker.

A keys file (``frontend.key_records``) names each key and may limit it; the
frontend puts the name and the limits in each of the key's SUBMITs
(``messages.Submit.key_policy``). They are enforced here, where every
frontend's jobs meet, so that N frontends do not make a limit N times what
was set:

* ``max_slots``: jobs of the key running at once;
* ``max_queued``: jobs of the key waiting for a slot (``--queue-max``);
* ``tokens_per_minute``: prompt tokens (charged when a job starts) and
  completion tokens (when it ends) in the last 60 s, in one-second buckets.
  A job is refused while the window holds the limit or more, or when its
  prompt alone would pass it; a job that started under the limit is never
  cut, so the window may end above it by one job's tokens.

A job over a limit gets RATE_LIMITED (the frontend's 429) and nothing is run
or queued for it. The limits a job carries are the ones its frontend read
last; frontends that read the file at different moments disagree until
both have reloaded it.

With several brokers each enforces what the frontends send it, and the
frontend divides each limit between them (``frontend.key_records``), so the
pool-wide overshoot is at most one job per broker per limit.

Usage (tokens, requests, refusals by reason) is kept per name for
``/metrics``, for at most ``limits.MAX_KEY_NAMES`` names; the rest is summed
under ``OTHER``.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable

from protocol import limits, messages
from protocol.payloads import KeyUsage

#: The tokens-per-minute window, and its buckets.
WINDOW_S = 60
#: Usage of names beyond ``limits.MAX_KEY_NAMES``.
OTHER = "(other)"


@dataclasses.dataclass
class _Usage:
    """``KeyUsage``'s counts, kept as they change (the record is frozen)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    requests: int = 0
    refused: dict[str, int] = dataclasses.field(default_factory=dict)
    running: int = 0
    waiting: int = 0


@dataclasses.dataclass
class _Account:
    usage: _Usage = dataclasses.field(default_factory=_Usage)
    #: Tokens charged per whole second (monotonic), the last WINDOW_S of them.
    buckets: collections.OrderedDict[int, int] = dataclasses.field(
        default_factory=collections.OrderedDict)

    def window_tokens(self, now: float) -> int:
        oldest = int(now) - WINDOW_S + 1
        while self.buckets and next(iter(self.buckets)) < oldest:
            self.buckets.popitem(last=False)
        return sum(self.buckets.values())

    def charge(self, tokens: int, now: float) -> None:
        if tokens > 0:
            second = int(now)
            self.buckets[second] = self.buckets.get(second, 0) + tokens


class KeyAccounts:
    """Each named key's running and waiting jobs, token window and usage."""

    def __init__(self) -> None:
        self._accounts: dict[str, _Account] = {}
        #: Each running job of a named key: the name, and the prompt tokens
        #: charged when it started.
        self._running: dict[str, tuple[str, int]] = {}
        #: Each waiting job of a named key: the name.
        self._waiting: dict[str, str] = {}

    def _account(self, name: str) -> _Account:
        account = self._accounts.get(name)
        if account is None:
            if len(self._accounts) >= limits.MAX_KEY_NAMES:
                name = OTHER
                account = self._accounts.get(OTHER)
            if account is None:
                account = self._accounts[name] = _Account()
        return account

    # --- the checks -------------------------------------------------------------------

    def over_limit(self, submit: messages.Submit, now: float,
                   slot_hint_s: Callable[[], float]) -> messages.RateLimited | None:
        """RATE_LIMITED if the job's key may not start a job now (its
        running jobs or its tokens), else None. ``slot_hint_s``: when a busy
        slot should free (the broker's Retry-After), the hint for a key at
        its running or waiting limit, since one of its jobs must end."""
        policy = submit.key_policy
        if policy is None:
            return None
        account = self._account(policy.name)
        if policy.max_slots and account.usage.running >= policy.max_slots:
            return self._refuse(account, submit.job_id, "slots", policy.max_slots, 0,
                                slot_hint_s())
        if policy.tokens_per_minute:
            prompt = len(submit.request.prompt_tokens or ())
            used = account.window_tokens(now)
            if used >= policy.tokens_per_minute or (
                    prompt and used + prompt > policy.tokens_per_minute):
                reset = _window_reset_s(account, policy.tokens_per_minute, prompt, now)
                return self._refuse(account, submit.job_id, "tokens",
                                    policy.tokens_per_minute,
                                    max(0, policy.tokens_per_minute - used), reset)
        return None

    def queue_full(self, submit: messages.Submit, slot_hint_s: Callable[[], float]
                   ) -> messages.RateLimited | None:
        """RATE_LIMITED if the job's key has its most jobs waiting."""
        policy = submit.key_policy
        if policy is None or not policy.max_queued:
            return None
        account = self._account(policy.name)
        if account.usage.waiting < policy.max_queued:
            return None
        return self._refuse(account, submit.job_id, "queued", policy.max_queued, 0,
                            slot_hint_s())

    def _refuse(self, account: _Account, job_id: str, reason: str, limit: int,
                remaining: int, reset_s: float) -> messages.RateLimited:
        refused = account.usage.refused
        refused[reason] = refused.get(reason, 0) + 1
        return messages.RateLimited(job_id, reason, limit, remaining, reset_s)

    # --- what happens to a key's jobs -------------------------------------------------

    def on_no_slot(self, submit: messages.Submit) -> None:
        """The job was refused for want of a slot (503)."""
        if submit.key_policy is not None:
            refused = self._account(submit.key_policy.name).usage.refused
            refused["no_slot"] = refused.get("no_slot", 0) + 1

    def on_queued(self, submit: messages.Submit) -> None:
        if submit.key_policy is not None:
            self._waiting[submit.job_id] = submit.key_policy.name
            self._account(submit.key_policy.name).usage.waiting += 1

    def on_dequeued(self, job_id: str) -> None:
        """The job left the queue: started (``on_start`` follows), expired or
        left."""
        name = self._waiting.pop(job_id, None)
        if name is not None:
            self._account(name).usage.waiting -= 1

    def on_start(self, submit: messages.Submit, now: float) -> None:
        self.on_dequeued(submit.job_id)
        if submit.key_policy is None:
            return
        name = submit.key_policy.name
        account = self._account(name)
        # Counted by the frontend when it has the vocabulary; else the
        # worker's count comes with the job's FINAL.
        prompt = len(submit.request.prompt_tokens or ())
        self._running[submit.job_id] = (name, prompt)
        account.usage.running += 1
        account.usage.requests += 1
        account.charge(prompt, now)

    def on_end(self, job_id: str, msg: messages.Message | None, now: float) -> None:
        """The job's terminal frame (None: it ended with its worker)."""
        entry = self._running.pop(job_id, None)
        if entry is None:
            return
        name, charged = entry
        account = self._account(name)
        account.usage.running -= 1
        usage = getattr(msg, "usage", None)
        prompt = max(charged, usage.prompt_tokens if usage is not None else 0)
        completion = usage.completion_tokens if usage is not None else 0
        account.usage.prompt_tokens += prompt
        account.usage.completion_tokens += completion
        account.charge(prompt - charged + completion, now)

    def usage(self) -> list[KeyUsage]:
        return [KeyUsage(name, **{**dataclasses.asdict(a.usage),
                                  "refused": dict(a.usage.refused)})
                for name, a in sorted(self._accounts.items())]


def _window_reset_s(account: _Account, limit: int, prompt: int, now: float) -> float:
    """Seconds until the window has room for ``prompt`` more tokens (the whole
    window, if the prompt alone is more than the limit)."""
    if prompt > limit:
        return float(WINDOW_S)
    total = account.window_tokens(now)
    for second, tokens in account.buckets.items():
        total -= tokens
        if total + prompt <= limit and total < limit:
            return float(max(1, math.ceil(second + WINDOW_S - now)))
    return float(WINDOW_S)

