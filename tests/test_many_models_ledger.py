"""The ledger and the waiting room by model (issue 30), in process: a job
gets an idle slot of its own model only, ``id_slot`` must be one of its
model's, each model's Retry-After comes from its own busy slots, names that
would mean two models are refused, and a freed slot goes only to a waiter
of its model."""

from __future__ import annotations

from protocol import limits, messages
from protocol.payloads import GenerationRequest, JobProgress
from workers.broker.ledger import Ledger
from workers.broker.waiting_room import WaitingRoom


def ready(model: str, aliases=(), caps=("completion", "chat")) -> messages.Ready:
    return messages.Ready("w", model, 2048, 1, "h", aliases=list(aliases),
                          capabilities=list(caps))


def ledger_of(*models: tuple[bytes, str, tuple]) -> Ledger:
    ledger = Ledger(10.0)
    for ident, model, aliases in models:
        ledger.register_worker(ident, ready(model, aliases), now=0.0)
    return ledger


def test_a_job_gets_a_slot_of_its_model_only():
    ledger = ledger_of((b"a1", "alpha", ("a",)), (b"b1", "bravo", ()))
    slot = ledger.assign("j1", b"f", 1.0, model="alpha")
    assert slot.identity == b"a1"
    # Alpha is full; bravo's idle slot is not alpha's.
    assert ledger.assign("j2", b"f", 1.0, model="alpha") is None
    assert ledger.free_slots("alpha") == 0 and ledger.free_slots("bravo") == 1
    assert ledger.assign("j3", b"f", 1.0, model="bravo").identity == b"b1"
    ledger.finish("j1", 2.0)
    ledger.finish("j3", 2.0)
    # "" (an older frontend): any model, as before.
    assert ledger.assign("j4", b"f", 3.0).identity in (b"a1", b"b1")


def test_id_slot_must_be_of_the_model():
    ledger = ledger_of((b"a1", "alpha", ()), (b"b1", "bravo", ()))
    bravo_id = ledger.workers[b"b1"].slot_id
    try:
        ledger.assign_slot(bravo_id, "j1", b"f", 1.0, model="alpha")
    except KeyError:
        pass
    else:
        raise AssertionError("alpha's job got bravo's slot")
    assert ledger.assign_slot(bravo_id, "j1", b"f", 1.0, model="bravo") is not None


def test_retry_after_counts_that_models_busy_slots():
    ledger = ledger_of((b"a1", "alpha", ()), (b"b1", "bravo", ()))
    for job, model, remaining in (("ja", "alpha", 100), ("jb", "bravo", 10)):
        slot = ledger.assign(job, b"f", 1.0, model=model)
        ledger.record_progress(slot, JobProgress(job, max_tokens=remaining,
                                                 tokens_per_s=1.0), 1.0)
    assert ledger.retry_after_s(1.0, "bravo") == 10
    assert ledger.retry_after_s(1.0, "alpha") == 60  # capped at the max
    assert ledger.retry_after_s(1.0) == 10  # pool-wide: the soonest


def test_names_resolve_and_clashes_are_refused():
    ledger = ledger_of((b"a1", "alpha", ("a", "first")), (b"b1", "bravo", ()))
    models = ledger.models
    assert models.resolve("first") == "alpha" and models.resolve("zzz") is None
    assert "already names model 'alpha'" in models.conflict(b"b2", "bravo", ["a"])
    assert "alias of model 'alpha'" in models.conflict(b"c1", "a", [])
    assert models.conflict(b"a2", "alpha", ["a", "more"]) == ""
    too_many = [f"x{i}" for i in range(limits.MAX_ALIASES + 1)]
    assert "at most" in models.conflict(b"c1", "charlie", too_many)
    # The last worker of a model takes its aliases with it.
    ledger.remove_worker(b"a1")
    assert models.resolve("a") is None and models.conflict(b"b2", "bravo", ["a"]) == ""


def test_model_status_counts_each_models_slots():
    ledger = ledger_of((b"a1", "alpha", ("a",)), (b"a2", "alpha", ()),
                       (b"b1", "bravo", ()))
    ledger.register_loading(b"c1", messages.Loading("w", "charlie", 2, "h",
                                                    aliases=["c"]), 0.0)
    ledger.assign("j", b"f", 1.0, model="alpha")
    statuses = {m.name: m for m in ledger.snapshot(1.0, {}, _totals()).models}
    alpha = statuses["alpha"]
    assert (alpha.slots_total, alpha.slots_idle, alpha.slots_busy) == (2, 1, 1)
    assert alpha.aliases == ["a"] and alpha.capabilities == ["completion", "chat"]
    assert statuses["charlie"].slots_loading == 1
    assert statuses["charlie"].slots_total == 0
    assert ledger.models.resolve("c") == "charlie"


def test_a_freed_slot_goes_only_to_a_waiter_of_its_model():
    room = WaitingRoom(max_jobs=4, max_tokens=0, timeout_s=60)
    for job, model in (("w-alpha", "alpha"), ("w-bravo", "bravo")):
        submit = messages.Submit(job, GenerationRequest(kind="completion",
                                                        model=model))
        room.admit(b"f", submit, [], [], now=0.0)
    # Only bravo has an idle slot: the older alpha job stays waiting.
    picked = room.pick(lambda w: 0 if w.model == "bravo" else None, now=1.0)
    assert picked.job_id == "w-bravo"
    assert room.pick(lambda w: 0 if w.model == "bravo" else None, now=1.0) is None
    assert list(room.waiters) == ["w-alpha"]


def _totals():
    from protocol.payloads import HistogramSnapshot, PoolTotals

    hist = HistogramSnapshot([1.0], [0, 0], 0.0, 0, None, None, [])
    return PoolTotals(0, 0, 0, 0, 0, 0.0, 0.0, hist)
