"""The token ids a TOKEN or FINAL frame carries (issue 34, bug 2): packed,
and checked at the socket edge like every field."""

from __future__ import annotations

import msgpack
import pytest

from protocol import messages
from protocol.payloads import Timings, Usage
from protocol.records import MalformedMessage


def test_token_ids_round_trip_packed():
    ids = [0, 1, 31999, 2**32 - 1]
    msg = messages.Token("job", "hi", 4, token_ids=messages.pack_token_ids(ids))
    decoded = messages.decode(msg.to_wire())
    assert messages.unpack_token_ids(decoded.token_ids) == ids
    final = messages.decode(messages.Final(
        "job", "stop", Usage(1, 1, 2), Timings(1, 1.0, 1, 1.0),
        token_ids=messages.pack_token_ids([7])).to_wire())
    assert messages.unpack_token_ids(final.token_ids) == [7]


def test_an_older_workers_frame_has_no_ids():
    body = msgpack.packb(["job", "text", 2])
    msg = messages.decode([messages.PROTOCOL_HEADER, messages.Token.COMMAND, body])
    assert msg.token_ids == b""


@pytest.mark.parametrize("bad", [b"\x01\x02\x03", "ids", [1, 2]])
def test_ragged_or_mistyped_ids_are_malformed(bad):
    body = msgpack.packb(["job", "text", 1, [], None, b"", bad])
    with pytest.raises(MalformedMessage, match="token_ids"):
        messages.decode([messages.PROTOCOL_HEADER, messages.Token.COMMAND, body])
