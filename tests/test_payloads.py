"""Typed payloads on the wire: the request, heartbeat progress, the snapshot.

Each is checked field by field at decode like the messages that carry it; a
malformed one is a ``MalformedMessage`` (dropped and counted at the edge),
never a crash further in. The last test shows that against a real broker.
"""

from __future__ import annotations

import os
import uuid

import msgpack
import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from frontend import openai_schema
from protocol import messages
from protocol.payloads import (
    ChatMessage,
    GenerationRequest,
    HistogramSnapshot,
    JobProgress,
    PoolStatus,
    PoolTotals,
    Sampling,
    SlotStatus,
    Timings,
    Usage,
)
from tests.pool import BrokerProbe, Proc, cli, wait_until
from workers.model.active_job import ActiveJob
from workers.model.settings import WorkerSettings

#: usage and timings of a FINAL that says nothing was used.
NOTHING_USED = (Usage(0, 0, 0), Timings(0, 0.0, 0, 0.0))

H = messages.PROTOCOL_HEADER


def decode_body(cls, body: list) -> messages.Message:
    return messages.decode([H, cls.COMMAND, msgpack.packb(body)])


CHAT = GenerationRequest(
    "chat",
    messages=[ChatMessage("system", "be brief"), ChatMessage("user", "hi")],
    max_tokens=12,
    sampling=Sampling(temperature=0.0, top_k=1, seed=7, ignore_eos=True),
    stop=["\n\n"],
    prompt_tokens=[1, 15, 300],
    extra_stops=["<|im_end|>"],
)


#: Where the nested Sampling array sits in a GenerationRequest array.
SAMPLING_AT = list(GenerationRequest.FIELD_TYPES).index("sampling")


def test_a_full_request_round_trips_with_its_types():
    msg = messages.decode(messages.Submit("j", CHAT, [3, 4]).to_wire())
    assert msg == messages.Submit("j", CHAT, [3, 4])
    assert isinstance(msg.request.messages[1], ChatMessage)
    assert msg.request.sampling.seed == 7


# --- one set of defaults -----------------------------------------------------------


def test_the_frontend_takes_its_sampling_defaults_from_the_payload():
    for body in ({"prompt": "x"},
                 {"prompt": "x", "temperature": None, "top_k": None, "seed": None,
                  "ignore_eos": None}):
        assert openai_schema.parse_completion(body).generation.sampling == Sampling()
    chat = openai_schema.parse_chat({"messages": [{"role": "user", "content": "x"}]})
    assert chat.generation.sampling == Sampling()
    assert chat.generation.max_tokens is None  # until the context is full
    given = openai_schema.parse_chat({"messages": [{"role": "user", "content": "x"}],
                                      "temperature": 1, "top_k": 5})
    assert given.generation.sampling == Sampling(temperature=1.0, top_k=5)
    assert isinstance(given.generation.sampling.temperature, float)


def test_an_older_peers_shorter_request_takes_the_defaults():
    # [kind, prompt] only, and a sampling array that stops after temperature.
    msg = decode_body(messages.Submit, ["j", ["completion", "hi"]])
    assert msg.request == GenerationRequest("completion", "hi")
    msg = decode_body(messages.Submit,
                      ["j", ["completion", "hi", [], 5, [0.1]]])
    assert msg.request.sampling == Sampling(temperature=0.1)
    assert msg.request.max_tokens == 5


def test_a_newer_peers_extra_nested_fields_are_ignored():
    body = messages.Submit("j", CHAT).to_body()
    body[1][SAMPLING_AT].append("a future sampler")  # in Sampling
    body[1].append({"a future": "field"})   # in GenerationRequest
    assert decode_body(messages.Submit, body).request == CHAT


# --- malformed payloads are rejected at decode, naming the field -------------------


def _submit_with(**changes) -> list:
    body = messages.Submit("j", CHAT).to_body()
    request = body[1]
    names = list(GenerationRequest.FIELD_TYPES)
    sampling_names = list(Sampling.FIELD_TYPES)
    for path, value in changes.items():
        if path.startswith("sampling_"):
            request[SAMPLING_AT][sampling_names.index(path[len("sampling_"):])] = value
        else:
            request[names.index(path)] = value
    return body


@pytest.mark.parametrize("changes,why", [
    ({"kind": "edit"}, r"request\.kind"),
    ({"kind": 1}, r"request\.kind"),
    ({"prompt": 5}, r"request\.prompt: int"),
    ({"max_tokens": "16"}, r"request\.max_tokens: str"),
    ({"max_tokens": True}, r"request\.max_tokens: bool"),
    ({"sampling_temperature": "0.8"}, r"request\.sampling\.temperature: str"),
    ({"sampling_temperature": False}, r"request\.sampling\.temperature: bool"),
    ({"sampling_top_k": 40.0}, r"request\.sampling\.top_k: float"),
    ({"sampling_seed": "7"}, r"request\.sampling\.seed: str"),
    ({"sampling_ignore_eos": 1}, r"request\.sampling\.ignore_eos: int"),
    ({"sampling": {"temperature": 0.8}}, r"request\.sampling: body is not an array"),
    ({"stop": "\n"}, r"request\.stop: str, not an array"),
    ({"stop": ["a", 3]}, r"request\.stop\[\]: int"),
    ({"prompt_tokens": [1, True, 3]}, r"request\.prompt_tokens\[\]: bool"),
    ({"prompt_tokens": [1, "2"]}, r"request\.prompt_tokens\[\]: str"),
    ({"messages": [["user", "hi"], ["robot", "hi"]]},
     r"request\.messages\[1\]\.role"),
    ({"messages": [["user", ["text"]]]}, r"request\.messages\[0\]\.content: list"),
    ({"messages": [{"role": "user", "content": "hi"}]},
     r"request\.messages\[0\]: body is not an array"),
    ({"messages": [["user"]]}, r"request\.messages\[0\]: 1 fields, need 2"),
])
def test_a_malformed_request_is_rejected_naming_the_field(changes, why):
    with pytest.raises(messages.MalformedMessage, match=why):
        decode_body(messages.Submit, _submit_with(**changes))


def test_the_old_dict_request_is_rejected():
    with pytest.raises(messages.MalformedMessage, match="body is not an array"):
        decode_body(messages.Submit, ["j", {"kind": "completion", "prompt": "x"}])


def test_prefix_blocks_are_ints():
    body = messages.Submit("j", CHAT, [1, 2]).to_body()
    body[2][1] = "2"
    with pytest.raises(messages.MalformedMessage, match=r"prefix_blocks\[\]: str"):
        decode_body(messages.Submit, body)


@pytest.mark.parametrize("progress,why", [
    ({"job_id": "j", "n_generated": 3}, "progress: body is not an array"),
    (["j", "3"], r"progress\.n_prompt: str"),
    (["j", 3, 4, 10, "fast"], r"progress\.tokens_per_s: str"),
    (["j", 3, True], r"progress\.n_generated: bool"),
    ([None, 3], r"progress\.job_id: NoneType"),
])
def test_malformed_progress_is_rejected(progress, why):
    with pytest.raises(messages.MalformedMessage, match=why):
        decode_body(messages.Heartbeat, [progress])


def test_malformed_snapshot_is_rejected():
    body = messages.StatusReply("r", sample_status()).to_body()
    body[1][0][0][2] = 5  # slots[0].id_task
    with pytest.raises(messages.MalformedMessage, match=r"slots\[0\]\.id_task: int"):
        decode_body(messages.StatusReply, body)
    body = messages.StatusReply("r", sample_status()).to_body()
    body[1][8] = {"no_slot": "3"}  # counters
    with pytest.raises(messages.MalformedMessage, match="counters: str -> str"):
        decode_body(messages.StatusReply, body)


FINAL_BODY = ["j", "stop", [3, 2, 5, 1], [2, 1.5, 2, 3.0, 666.7], "!"]


@pytest.mark.parametrize("at,value,why", [
    (1, "exploded", r"Final\.finish_reason"),
    (2, {"prompt_tokens": 3}, r"Final\.usage: body is not an array"),
    (2, [3, "2", 5], r"Final\.usage\.completion_tokens: str"),
    (2, [3, 2.0, 5], r"Final\.usage\.completion_tokens: float"),
    (2, [-3, 2, 5], r"Final\.usage\.prompt_tokens: -3 is out of range"),
    (2, [3, 2**64 - 1, 5], r"Final\.usage\.completion_tokens: \d+ is out of range"),
    (2, [3, 2], r"Final\.usage: 2 fields, need 3"),
    (3, [2, float("nan"), 2, 3.0], r"Final\.timings\.prompt_ms: nan is not"),
    (3, [2, 1.5, 2, 3.0, float("inf")], r"predicted_per_second: inf is not"),
    (3, [2, 1.5, 2, -0.5], r"Final\.timings\.predicted_ms: -0\.5 is not"),
    (3, [2, b"\x00", 2, 3.0], r"Final\.timings\.prompt_ms: bytes"),
])
def test_a_malformed_final_is_rejected_naming_the_field(at, value, why):
    body = list(FINAL_BODY)
    body[at] = value
    with pytest.raises(messages.MalformedMessage, match=why):
        decode_body(messages.Final, body)


def test_a_final_takes_ints_as_times_and_defaults_the_optional_fields():
    msg = decode_body(messages.Final, ["j", "length", [3, 2, 5], [2, 1, 2, 3]])
    assert msg.usage == Usage(3, 2, 5, cached_tokens=0)
    assert msg.timings == Timings(2, 1.0, 2, 3.0, predicted_per_second=0.0)
    assert isinstance(msg.timings.prompt_ms, float)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats()
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=6)
    | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=30,
)


@given(st.sampled_from([messages.Submit, messages.Heartbeat, messages.StatusReply,
                        messages.Final]),
       st.lists(msgpack_values, max_size=4))
def test_random_nested_bodies_never_raise_anything_else(cls, body):
    try:
        decode_body(cls, body)
    except messages.MalformedMessage:
        pass


# --- heartbeat progress and the snapshot ---------------------------------------------


def test_a_worker_heartbeats_typed_progress():
    submit = messages.Submit("j", GenerationRequest("completion", "x"))
    job = ActiveJob(submit, send=None, settings=WorkerSettings("inproc://unused"))
    assert job.progress() == JobProgress("j")  # before the first token
    job.report_progress(3, 2, 10, 5.5, 5)
    beat = messages.decode(messages.Heartbeat(job.progress()).to_wire())
    assert beat.progress == JobProgress("j", n_prompt=3, n_generated=2,
                                        max_tokens=10, tokens_per_s=5.5,
                                        n_ctx_used=5)
    assert messages.decode(messages.Heartbeat().to_wire()).progress is None


def sample_status() -> PoolStatus:
    histogram = HistogramSnapshot(buckets=[0.1, 1.0], cumulative=[1, 2, 2],
                                  sum=0.6, count=2, p50=0.5, max=0.5,
                                  recent=[0.1, 0.5])
    slot = dict(state="busy", worker_name="w", host="h", pid=1, model="m",
                engine="synthetic", n_ctx=64, jobs_served=3)
    return PoolStatus(
        slots=[SlotStatus(id=0, id_task="j", lease_age_s=0.5,
                          lease_taken_at=1.7e9, progress=JobProgress("j", 1, 2),
                          **slot),
               SlotStatus(id=1, id_task=None, lease_age_s=None,
                          lease_taken_at=None, **dict(slot, state="idle"))],
        slots_total=2, slots_loading=0, slots_busy=1, slots_free=1,
        kv_cache_usage_level=0.25, jobs=1, frontends=1,
        counters={"no_slot": 3},
        stats=PoolTotals(1, 2, 3, 4, 5, 0.5, 1.5, histogram),
        retry_after_s=2.0,
    )


def test_the_snapshot_round_trips_and_keeps_its_json_shape():
    status = sample_status()
    assert messages.decode(messages.StatusReply("r", status).to_wire()).snapshot \
        == status
    shape = status.to_dict()
    assert shape["slots"][0]["progress"]["n_generated"] == 2
    assert shape["slots"][1]["progress"] == {}
    assert shape["cancel_release_s"] == shape["stats"]["cancel_release_s"]
    assert shape["cancel_release_s"]["count"] == 2
    assert (shape["slots_free"], shape["counters"]) == (1, {"no_slot": 3})


# --- a bad heartbeat against a real broker ------------------------------------------


class FakePeer:
    """A bare DEALER speaking the protocol by hand."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def expect(self, cls, timeout_s: float = 10.0):
        """The next message of type ``cls`` (others, e.g. HEARTBEAT, skipped)."""
        def arrived():
            while self.sock.poll(0):
                msg = messages.decode(self.sock.recv_multipart())
                if isinstance(msg, cls):
                    return msg
            return None
        return wait_until(arrived, timeout_s, f"a {cls.__name__}")


def submit_frames(job_id: str) -> list[bytes]:
    return messages.Submit(job_id, GenerationRequest("completion", "hi",
                                                     max_tokens=110)).to_wire()


@pytest.mark.stack
def test_a_heartbeat_with_strings_for_numbers_is_dropped_and_the_broker_serves_on(
        tmp_path):
    """Before typed progress the broker took this heartbeat, and its next
    STATUS (or NO_SLOT's Retry-After) divided a string and killed it."""
    frontends, workers = f"ipc://{tmp_path}/frontends", f"ipc://{tmp_path}/workers"
    # A liveness window (10 s) no step of this test comes near.
    broker = Proc("broker", cli("broker", "--frontends", frontends, "--workers",
                                workers, "--heartbeat-interval-s", "0.5",
                                "--heartbeat-liveness", "20"), tmp_path)
    ctx = zmq.Context()
    probe = BrokerProbe(frontends, ctx=ctx)

    def status() -> dict:
        assert broker.alive(), f"the broker died: {broker.log()}"
        return probe.status(1) or {}

    try:
        worker, frontend = FakePeer(ctx, workers), FakePeer(ctx, frontends)
        worker.send(messages.Ready("fake", "m", 2048, os.getpid(), "h").to_wire())
        wait_until(lambda: status().get("slots_free") == 1, 30,
                   "the fake worker to register")
        frontend.send(messages.Hello(os.getpid(), "h").to_wire())
        job_id = uuid.uuid4().hex
        frontend.send(submit_frames(job_id))
        assert frontend.expect(messages.Accepted).job_id == job_id
        assert worker.expect(messages.Submit).job_id == job_id

        strings = {"job_id": job_id, "n_prompt": "3", "n_generated": "ten",
                   "max_tokens": "110", "tokens_per_s": "fast", "n_ctx_used": "13"}
        for progress in (strings,                               # the old shape
                         [job_id, "3", "ten", "110", "fast", "13"],  # the new
                         [job_id, 3, True, 110, 20.0, 13]):     # bool for int
            worker.send([H, messages.Heartbeat.COMMAND, msgpack.packb([progress])])
        snap = wait_until(
            lambda: (s := status()) and s["counters"].get(
                "malformed_dropped", 0) >= 3 and s,
            10, "the broker to drop the three heartbeats")
        assert snap["counters"]["malformed_dropped"] == 3
        assert snap["slots_busy"] == 1 and snap["slots"][0]["progress"] == {}
        # The 503 path: NO_SLOT with a Retry-After computed from the ledger.
        frontend.send(submit_frames("second"))
        refused = frontend.expect(messages.NoSlot)
        assert refused.job_id == "second" and 1 <= refused.retry_after_s <= 60

        # Good progress still counts: 100 tokens left at 20/s.
        good = messages.Heartbeat(JobProgress(job_id, 3, 10, 110, 20.0, 13))
        worker.send(good.to_wire())
        snap = wait_until(
            lambda: (s := status()) and s["slots"][0]["progress"] and s,
            10, "the good heartbeat to reach the ledger")
        assert snap["slots"][0]["progress"]["n_generated"] == 10
        # The estimate counts down from the heartbeat (rounded up).
        assert snap["retry_after_s"] in (4.0, 5.0)
        frontend.send(submit_frames("third"))
        assert frontend.expect(messages.NoSlot).retry_after_s in (4.0, 5.0)

        worker.send(messages.Final(job_id, "stop", *NOTHING_USED).to_wire())
        assert frontend.expect(messages.Final).job_id == job_id
        wait_until(lambda: status().get("slots_free") == 1, 10,
                   "the slot to be free again")
        assert broker.alive()
    finally:
        probe.close()
        ctx.destroy(linger=0)
        code = broker.stop()
    assert code == 0, broker.log()
