"""The wire protocol: every message round-trips; malformed frames are rejected."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import messages
from protocol.records import (
    Count,
    Finite,
    ListOf,
    MapOf,
    NonNegative,
    OneOf,
    Optional,
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
    body = msgpack.packb(["job", 3, "model", "some future field"])
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
    body = b"\x00" * (messages.MAX_BODY_BYTES + 1)
    with pytest.raises(messages.MalformedMessage, match="too large"):
        messages.decode([messages.PROTOCOL_HEADER, messages.Submit.COMMAND, body])


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
