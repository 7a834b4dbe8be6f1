"""The broker's per-key accounting (``workers.broker.key_limits``) and the
keys file's parser (``frontend.key_records``), in process."""

from __future__ import annotations

import hashlib

import pytest

from frontend.key_records import KeyRecords, KeysFileError, parse_keys
from protocol import limits, messages
from protocol.payloads import COMPLETION, GenerationRequest, KeyPolicy, Timings, Usage
from workers.broker.key_limits import OTHER, KeyAccounts


def submit(job_id: str, policy: KeyPolicy | None, prompt: int = 5) -> messages.Submit:
    request = GenerationRequest(kind=COMPLETION, prompt_tokens=list(range(prompt)))
    return messages.Submit(job_id, request, key_policy=policy)


def final(job_id: str, prompt: int, completion: int) -> messages.Final:
    return messages.Final(job_id, "length", Usage(prompt, completion, prompt + completion),
                          Timings(prompt_n=prompt, prompt_ms=1.0,
                                  predicted_n=completion, predicted_ms=1.0))


def hint() -> float:
    return 3.0


def test_running_jobs_are_bounded_and_counted():
    accounts, policy = KeyAccounts(), KeyPolicy("a", max_slots=1)
    assert accounts.over_limit(submit("j1", policy), 0.0, hint) is None
    accounts.on_start(submit("j1", policy), 0.0)
    refused = accounts.over_limit(submit("j2", policy), 0.0, hint)
    assert (refused.reason, refused.limit, refused.remaining, refused.reset_s) == (
        "slots", 1, 0, 3.0)
    accounts.on_end("j1", final("j1", 5, 4), 1.0)
    assert accounts.over_limit(submit("j3", policy), 1.0, hint) is None
    [usage] = accounts.usage()
    assert (usage.requests, usage.prompt_tokens, usage.completion_tokens,
            usage.running, usage.refused) == (1, 5, 4, 0, {"slots": 1})


def test_the_token_window_slides_and_names_its_reset():
    accounts, policy = KeyAccounts(), KeyPolicy("b", tokens_per_minute=20)
    accounts.on_start(submit("j1", policy, prompt=6), 10.0)
    accounts.on_end("j1", final("j1", 6, 10), 10.5)  # 16 tokens at second 10
    refused = accounts.over_limit(submit("j2", policy, prompt=6), 30.0, hint)
    assert refused.reason == "tokens" and refused.remaining == 4
    assert refused.reset_s == 40.0  # second 10 leaves the window at 70
    assert accounts.over_limit(submit("j3", policy, prompt=4), 30.0, hint) is None
    assert accounts.over_limit(submit("j4", policy, prompt=6), 70.0, hint) is None
    # A prompt over the whole limit waits for the whole window.
    assert accounts.over_limit(submit("j5", policy, prompt=21), 70.0,
                               hint).reset_s == 60.0


def test_prompt_tokens_counted_by_the_worker_are_charged_at_the_end():
    accounts, policy = KeyAccounts(), KeyPolicy("c", tokens_per_minute=100)
    accounts.on_start(submit("j1", policy, prompt=0), 0.0)
    accounts.on_end("j1", final("j1", 30, 10), 0.0)
    [usage] = accounts.usage()
    assert (usage.prompt_tokens, usage.completion_tokens) == (30, 10)
    assert accounts.over_limit(submit("j2", policy, prompt=61), 1.0, hint).remaining == 60


def test_waiting_jobs_are_bounded_and_leave():
    accounts, policy = KeyAccounts(), KeyPolicy("d", max_queued=1)
    accounts.on_queued(submit("j1", policy))
    assert accounts.queue_full(submit("j2", policy), hint).reason == "queued"
    accounts.on_dequeued("j1")
    assert accounts.queue_full(submit("j2", policy), hint) is None


def test_unnamed_jobs_cost_nothing_and_names_are_bounded():
    accounts = KeyAccounts()
    assert accounts.over_limit(submit("j", None), 0.0, hint) is None
    accounts.on_start(submit("j", None), 0.0)
    accounts.on_end("j", final("j", 1, 1), 0.0)
    assert accounts.usage() == []
    for i in range(limits.MAX_KEY_NAMES + 5):
        accounts.on_start(submit(f"j{i}", KeyPolicy(f"k{i}")), 0.0)
    names = [u.name for u in accounts.usage()]
    assert len(names) == limits.MAX_KEY_NAMES + 1 and OTHER in names
    assert next(u for u in accounts.usage() if u.name == OTHER).requests == 5


DIGEST = hashlib.sha256(b"sk-1").hexdigest()


@pytest.mark.parametrize("text, why", [
    ("not toml [", "not TOML"),
    ('[[key]]\nname = "a b"\nsha256 = "%s"' % DIGEST, "name must be"),
    ('[[key]]\nname = "a"\nsha256 = "sk-1"', "sha256 must be 64 hex"),
    ('[[key]]\nname = "a"\nsha256 = "%s"\nmax_slots = -1' % DIGEST, "max_slots"),
    ('[[key]]\nname = "a"\nsha256 = "%s"\nmax_slot = 1' % DIGEST, "unknown fields"),
    ('[[key]]\nname = "a"\nsha256 = "%s"\n[[key]]\nname = "a"\nsha256 = "%s"'
     % (DIGEST, "0" * 64), "given twice"),
    ('[[key]]\nname = "a"\nsha256 = "%s"\n[[key]]\nname = "b"\nsha256 = "%s"'
     % (DIGEST, DIGEST), "given twice"),
    ('keys = 1', "unknown top-level"),
])
def test_a_bad_keys_file_is_refused_naming_why(text, why):
    with pytest.raises(KeysFileError, match=why):
        parse_keys(text)


def test_a_key_is_found_by_its_hash_and_shares_split_between_brokers(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text('[[key]]\nname = "team"\nsha256 = "%s"\nmax_slots = 3\n'
                    'tokens_per_minute = 1000\n' % DIGEST.upper())
    records = KeyRecords(str(path))
    record = records.lookup("sk-1")
    assert record.name == "team" and records.lookup("sk-2") is None
    assert record.policy(2) == KeyPolicy("team", 2, 0, 500)
