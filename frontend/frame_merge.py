"""TOKEN frames that wait for a client go out as one.

A job's frames queue at the frontend while its client (or the request
thread that writes to it) is behind: a client reading slowly, a frontend
whose threads are short of CPU. Handed out one by one, each costs a whole
event: an OpenAI chunk is some 270 bytes for a few bytes of text, so a
client on a slow link falls behind by the envelope alone. Merged, the
backlog costs one event (BENCHMARKS.md section 28: 1.30x the tokens/s of
a client reading 8 KiB/s). A client that keeps up never has a second
frame waiting and gets each token the moment it arrives: this is vLLM's
``--stream-interval`` only while the client is behind, never a delay.

Off unless ``--merge-waiting-frames`` asks, until on has been through CI:
merged events are dense, so where the model outpaces the frontend a client
that stops reading takes more tokens into the socket buffers before its
worker pauses for credit (docs/operations.md, flow control).

Every shape a client sees takes a frame of several tokens already (the
worker holds text back at a possible stop string and sends it as one
frame): the text, ``n_tokens``, one log-probability entry and one token id
per token. An embedding's frame is one input's vector, and is never merged.
"""

from __future__ import annotations

import dataclasses

from protocol import messages

#: The longest text one merged frame carries: a worker's frames are bounded
#: one by one on the wire, and a merge must not make one event of many.
MERGED_TEXT_MAX_CHARS = 65536


def merged(first: messages.Token, then: messages.Token) -> messages.Token | None:
    """One frame for ``first`` followed by ``then``; None where the two do
    not merge (an embedding, text past ``MERGED_TEXT_MAX_CHARS``, or frames
    that disagree on what they carry: a peer that lied, or a worker that
    changed mid-job)."""
    if first.embedding or then.embedding:
        return None
    if len(first.text) + len(then.text) > MERGED_TEXT_MAX_CHARS:
        return None
    if (bool(first.token_ids) != bool(then.token_ids)
            or bool(first.logprobs) != bool(then.logprobs)):
        return None
    return dataclasses.replace(
        first,
        text=first.text + then.text,
        n_tokens=first.n_tokens + then.n_tokens,
        logprobs=first.logprobs + then.logprobs,
        # The job's timings so far: the later frame's are the newer.
        timings=then.timings if then.timings is not None else first.timings,
        token_ids=first.token_ids + then.token_ids,
    )
