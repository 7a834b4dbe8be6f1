"""The wire protocol: every message round-trips; malformed frames are rejected."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import limits, messages
from protocol.payloads import Timings, Usage
from protocol.records import (
    FINITE,
    Count,
    Finite,
    ListOf,
    MapOf,
    NonNegative,
    OneOf,
    Optional,
    PackedUInts,
    Text,
    WireRecord,
    wire_record,
)

SAMPLE_VALUES = {
    (str,): "job-1",
    (int,): 7,
    (int, float): 1.5,
    (bool,): True,
    (dict,): {"k": [1, "v"]},
    (list,): [1, 2, 3],
    (bytes,): b"\xe2\x82",
}


def sample_value(kind):
    """A valid value of any field kind; nested payloads are filled in too."""
    if isinstance(kind, tuple):
        return SAMPLE_VALUES[kind]
    if isinstance(kind, ListOf):
        return [sample_value(kind.item), sample_value(kind.item)]
    if isinstance(kind, MapOf):
        return {SAMPLE_VALUES[kind.key_types]: SAMPLE_VALUES[kind.value_types]}
    if isinstance(kind, Optional):
        return sample_value(kind.kind)
    if isinstance(kind, OneOf):
        return sorted(kind.values)[0]
    if isinstance(kind, Count):
        return 3
    if isinstance(kind, NonNegative):
        return 2.5
    if isinstance(kind, Finite):
        return -0.25
    if isinstance(kind, Text):
        return "x" * kind.max_chars  # at its cap: still valid
    if isinstance(kind, PackedUInts):
        return bytes(range(2 * kind.size))
    return sample(kind)  # a nested record


def sample(cls):
    return cls(**{
        name: sample_value(types) for name, types in cls.FIELD_TYPES.items()
    })


@pytest.mark.parametrize("cls", messages.all_message_classes(),
                         ids=lambda c: c.__name__)
def test_every_message_round_trips(cls):
    msg = sample(cls)
    frames = msg.to_wire()
    assert frames[0] == messages.PROTOCOL_HEADER
    assert len(frames[1]) == 1
    assert messages.decode(frames) == msg


def test_command_bytes_are_unique():
    commands = [c.COMMAND for c in messages.all_message_classes()]
    assert len(commands) == len(set(commands))


def test_optional_trailing_fields_take_defaults():
    # An older peer that does not know Token.n_tokens yet.
    body = msgpack.packb(["job", "text"])
    msg = messages.decode([messages.PROTOCOL_HEADER, messages.Token.COMMAND, body])
    assert msg == messages.Token("job", "text", 1)


def test_newer_peer_extra_fields_are_ignored():
    body = msgpack.packb(["job", 3, "model", None, "some future field"])
    msg = messages.decode([messages.PROTOCOL_HEADER, messages.Accepted.COMMAND, body])
    assert msg == messages.Accepted("job", 3, "model")


@pytest.mark.parametrize("frames,why", [
    ([], "frames"),
    ([messages.PROTOCOL_HEADER, messages.Cancel.COMMAND], "frames"),
    ([b"LLAMAPOOL00", messages.Cancel.COMMAND, msgpack.packb(["j"])], "header"),
    ([messages.PROTOCOL_HEADER, b"\xee", msgpack.packb(["j"])], "command"),
    ([messages.PROTOCOL_HEADER, b"", msgpack.packb(["j"])], "command"),
    ([messages.PROTOCOL_HEADER, messages.Cancel.COMMAND, b"\xc1"], "msgpack"),
    ([messages.PROTOCOL_HEADER, messages.Cancel.COMMAND, msgpack.packb({"a": 1})],
     "array"),
    ([messages.PROTOCOL_HEADER, messages.Cancel.COMMAND, msgpack.packb([])], "need"),
    ([messages.PROTOCOL_HEADER, messages.Cancel.COMMAND, msgpack.packb([5])],
     "job_id"),
    ([messages.PROTOCOL_HEADER, messages.Credit.COMMAND, msgpack.packb(["j", True])],
     "frames"),
    ([messages.PROTOCOL_HEADER, messages.NoSlot.COMMAND, msgpack.packb(["j", "1"])],
     "retry_after_s"),
    ([messages.PROTOCOL_HEADER, messages.Submit.COMMAND,
      msgpack.packb(["j", {1: 2}])], "msgpack"),
])
def test_malformed_frames_are_rejected(frames, why):
    with pytest.raises(messages.MalformedMessage, match=why):
        messages.decode(frames)


def test_oversized_body_is_rejected_before_unpacking():
    body = b"\x00" * (limits.MAX_SUBMIT_BYTES + 1)
    with pytest.raises(messages.MalformedMessage, match="too large"):
        messages.decode([messages.PROTOCOL_HEADER, messages.Submit.COMMAND, body])
    # Small commands have small ceilings: a 100 KiB heartbeat is refused.
    with pytest.raises(messages.MalformedMessage, match="too large"):
        messages.decode([messages.PROTOCOL_HEADER, messages.Heartbeat.COMMAND,
                         b"\x91" + b"\xc0" * 100_000])


H = messages.PROTOCOL_HEADER


def test_many_small_containers_are_refused_cheaply():
    """The issue's attack: a body of millions of empty arrays (or maps) used to
    be unpacked in full (seconds, gigabytes) before any field was checked."""
    # Five arrays of 200 000 (each within the longest array a SUBMIT needs).
    n = 200_000
    assert n <= limits.SUBMIT.max_array_len
    for empty in (b"\x90", b"\x80"):  # an empty array, an empty map
        many = (b"\xdd" + n.to_bytes(4, "big") + empty * n) * 5
        body = b"\x93\xa1j\x95" + many + b"\x90"
        # Refused by the container budget, i.e. as soon as one container too
        # many was built, not after the million were unpacked and the fields
        # checked (what took seconds). No timing here: the benchmark
        # (make bench-limits) measures it.
        with pytest.raises(messages.MalformedMessage,
                           match="too many arrays and maps"):
            messages.decode([H, messages.Submit.COMMAND, body])
    # A length header claiming more than the command needs is refused at once.
    huge = b"\xdd" + (2**31).to_bytes(4, "big")
    with pytest.raises(messages.MalformedMessage, match="msgpack"):
        messages.decode([H, messages.Status.COMMAND, huge])
    with pytest.raises(messages.MalformedMessage, match="Cancel.job_id: bytes"):
        messages.decode([H, messages.Cancel.COMMAND,
                         msgpack.packb([b"binary is never used"])])
    with pytest.raises(messages.MalformedMessage, match="msgpack"):
        messages.decode([H, messages.Cancel.COMMAND,
                         msgpack.packb([msgpack.ExtType(1, b"nor ext")])])


@pytest.mark.parametrize("field", ["host", "worker_name", "model", "engine"])
def test_registration_strings_have_length_caps(field):
    good = messages.Ready("w", "m", 2048, 1, "h", "llama.cpp")
    cap = messages.Ready.FIELD_TYPES[field].max_chars
    assert cap <= limits.MAX_NAME_CHARS
    body = good.to_body()
    body[list(messages.Ready.FIELD_TYPES).index(field)] = "x" * (cap + 1)
    with pytest.raises(messages.MalformedMessage, match=f"{field}: {cap + 1} char"):
        messages.decode([H, messages.Ready.COMMAND, msgpack.packb(body)])
    assert messages.Hello.FIELD_TYPES["host"].max_chars == limits.MAX_HOST_CHARS == 255


def test_the_largest_valid_submit_decodes():
    from protocol.payloads import ChatMessage, GenerationRequest
    turns = [ChatMessage("user", "hi")] * (limits.MAX_CHAT_MESSAGES // 2)
    request = GenerationRequest("chat", messages=turns,
                                prompt_tokens=[65535] * 100_000)
    msg = messages.Submit("j" * limits.MAX_ID_CHARS, request, list(range(128)))
    frames = msg.to_wire()
    assert len(frames[2]) < limits.MAX_SUBMIT_BYTES
    assert messages.decode(frames) == msg


@given(st.lists(st.binary(max_size=64), max_size=5))
def test_random_frames_never_raise_anything_else(frames):
    try:
        messages.decode(frames)
    except messages.MalformedMessage:
        pass


@given(st.sampled_from(messages.all_message_classes()), st.binary(max_size=128))
def test_random_bodies_with_valid_header_never_raise_anything_else(cls, body):
    try:
        messages.decode([messages.PROTOCOL_HEADER, cls.COMMAND, body])
    except messages.MalformedMessage:
        pass


def test_messages_are_frozen():
    msg = messages.Cancel("j")
    with pytest.raises(dataclasses.FrozenInstanceError):
        msg.job_id = "other"


def test_two_messages_cannot_share_a_command_byte():
    """Two branches once both took 0x06; the registry kept the later one and
    the earlier message could no longer be decoded."""
    with pytest.raises(TypeError, match="already"):
        @messages._register(messages.Threads.COMMAND[0])
        class Again(messages.Message):
            n_threads: int


def test_a_field_whose_annotation_has_no_wire_kind_fails_at_import():
    """The annotation is the kind: one the rules cannot check is refused
    when the class is made, naming the field, not at the first message."""
    with pytest.raises(TypeError, match=r"Loose\.ids"):
        @wire_record
        class Loose(WireRecord):
            ids: set[int]
    with pytest.raises(TypeError, match=r"Misplaced\.x"):
        @wire_record
        class Misplaced(WireRecord):
            x: Annotated[float | None, FINITE] = None


# --- the broker's undecoded TOKEN relay (messages.is_token_of) ---------------


@given(st.text(max_size=40), st.text(max_size=40), st.text(max_size=20),
       st.integers(1, 5))
def test_is_token_of_names_exactly_one_job(held, sent, text, n_tokens):
    """The relay's check passes a TOKEN to a job's client only when the
    frame names that very job (an id that is a prefix of another's too)."""
    frames = messages.Token(sent, text, n_tokens).to_wire()
    assert messages.is_token_of(frames, messages.job_id_tag(held)) == (held == sent)


def test_is_token_of_refuses_everything_but_a_token():
    tag = messages.job_id_tag("j1")
    token = messages.Token("j1", "x").to_wire()
    assert messages.is_token_of(token, tag)
    final = messages.Final("j1", "stop", *_usage_and_timings()).to_wire()
    assert not messages.is_token_of(final, tag)
    assert not messages.is_token_of([b"LLAMAPOOL04", *token[1:]], tag)
    assert not messages.is_token_of(token[:2], tag)
    assert not messages.is_token_of([*token, b""], tag)
    # Only the job id is not enough: a TOKEN carries its text too.
    assert not messages.is_token_of(
        [*token[:2], msgpack.packb(["j1"])], tag)
    assert not messages.is_token_of([*token[:2], tag], tag)


def _usage_and_timings():
    return Usage(1, 1, 2), Timings(1, 1.0, 1, 1.0)


@pytest.mark.parametrize("body, expected", [
    (["j1", 5], "j1"),                      # a broken TOKEN: its job is known
    (["j1"], "j1"),
    ([5, "x"], None),                      # no id to go by
    ([], None),
    ({"job_id": "j1"}, None),               # not an array
])
def test_claimed_job_id_reads_only_the_opening_id(body, expected):
    frames = [messages.PROTOCOL_HEADER, messages.Token.COMMAND, msgpack.packb(body)]
    assert messages.claimed_job_id(frames) == expected


def test_claimed_job_id_is_none_for_garbage_and_other_commands():
    tok = messages.PROTOCOL_HEADER, messages.Token.COMMAND
    assert messages.claimed_job_id([*tok, b"\xc1\xff"]) is None
    assert messages.claimed_job_id([*tok, b""]) is None
    assert messages.claimed_job_id([*tok, b"\x91\xdb\xff\xff\xff\xff"]) is None
    status = messages.Status("j1").to_wire()
    assert messages.claimed_job_id(status) is None
