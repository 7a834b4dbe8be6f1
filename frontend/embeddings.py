"""``POST /v1/embeddings`` (OpenAI's shape) and ``/embeddings`` (llama.cpp's).

An embedding request is a job like a generation: it takes a slot (so the
503 + Retry-After rule holds for it too) and runs in the worker's second,
pooled llama.cpp context (``workers.model.embedding``). The worker sends one
TOKEN frame per input carrying the vector as float32 bytes, then FINAL with
the usage; the prompt tokens count into the pool's usual prompt-token
counter, with no generated tokens.

Request: ``input`` is a string, a list of strings, a list of token ids, or
a list of token-id lists (OpenAI); llama.cpp's ``content`` is accepted in
its place and selects the native response, as in llama.cpp's server. An
input may also be llama.cpp's ``{"prompt_string": ...}`` or an OpenAI-style
``{"content": [{"type": "text", "text": ...}]}``; a mix of ids and text in
one input, and media, are refused naming them.
``encoding_format`` is ``float`` or ``base64`` (little-endian float32, what
the ``openai`` client asks for by default). ``dimensions`` is refused with a
400 naming it unless it equals the model's size (vectors are not
truncated); the worker, which knows the size, checks it before computing
anything. ``embd_normalize`` is llama.cpp's.

``/embeddings`` (and ``/embedding``) answer llama.cpp's native shape,
``[{"index": i, "embedding": [[...]]}]``: one pooled vector per input,
wrapped in a list as llama.cpp does for a pooled model. Per-token vectors
(llama.cpp's ``--pooling none``) are not offered: the pool always pools.
"""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

import falcon

from frontend import field_policy, request_fields
from frontend.endpoint import JobEndpoint, Submission
from frontend.errors import BadRequest, UpstreamError
from frontend.interfaces import BrokerClient
from frontend.job import Job
from frontend.lease import LeaseEnding
from frontend.request_fields import RequestFields
from frontend.settings import FrontendSettings
from protocol import messages
from protocol.errors import ErrorCode
from protocol.limits import MAX_EMBEDDING_INPUTS
from protocol.payloads import EMBEDDING, EmbeddingInput, GenerationRequest

#: No vocabulary is this large; a larger id is refused at the door.
MAX_TOKEN_ID = 2**31


def _is_token_list(value: object) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def _is_mixed(value: object) -> bool:
    """llama.cpp's one prompt of token ids and texts (``[12, "text", 34]``)."""
    return (isinstance(value, list)
            and any(isinstance(t, int) and not isinstance(t, bool) for t in value)
            and any(isinstance(t, str) for t in value))


def _refuse_mixed(param: str, where: str) -> BadRequest:
    # The wire gives a worker whole inputs, text or ids; a mix would need
    # the texts tokenised here, with the embedding model's vocabulary.
    return BadRequest(f"'{param}'{where} mixes token ids and text, which the pool "
                      "does not embed: send the text, or tokenise it "
                      "(/tokenize) and send the ids", param=param)


#: The keys of llama.cpp's object input (``tokenize_input_subprompt``) and
#: of an OpenAI-style ``content`` one (``tokenize_oai_content_array``).
_OBJECT_KEYS = frozenset({"prompt_string", "multimodal_data", "content"})


def _object_input(value: dict, param: str, where: str) -> EmbeddingInput:
    """``{"prompt_string": ...}`` (llama.cpp) or ``{"content": [parts]}``:
    text parts joined as llama.cpp joins them (no separator); media refused,
    the pool's models take text only."""
    unknown = sorted(set(value) - _OBJECT_KEYS)
    if unknown or ("content" in value) == ("prompt_string" in value):
        raise BadRequest(f"'{param}'{where} must be {{\"prompt_string\": ...}} or "
                         f"{{\"content\": [parts]}}"
                         + (f"; unknown key '{unknown[0][:64]}'" if unknown else ""),
                         param=param)
    if "multimodal_data" in value:
        raise BadRequest(f"'{param}'{where}: 'multimodal_data' is not supported: "
                         "the pool's models take text only", param=param)
    if "prompt_string" in value:
        return _one_input(value["prompt_string"], param, where + ".prompt_string",
                          objects=False)
    parts = value["content"]
    if not isinstance(parts, list) or not parts:
        raise BadRequest(f"'{param}'{where}.content must be a non-empty list of "
                         "content parts", param=param)
    texts = []
    for i, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            shown = kind if isinstance(kind, str) else "not a text part"
            raise BadRequest(f"'{param}'{where}.content[{i}]: {shown[:64]!r} is not "
                             "supported: only {\"type\": \"text\", \"text\": "
                             "...} parts (the pool's models take text only)",
                             param=param)
        texts.append(part["text"])
    return _one_input("".join(texts), param, where + ".content", objects=False)


def _one_input(value: object, param: str, where: str, objects: bool = True
               ) -> EmbeddingInput:
    if objects and isinstance(value, dict):
        return _object_input(value, param, where)
    if _is_mixed(value):
        raise _refuse_mixed(param, where)
    if isinstance(value, str):
        if not value:
            raise BadRequest(f"'{param}'{where} must not be empty", param=param)
        return EmbeddingInput(text=value)
    if isinstance(value, list):
        if not value:
            raise BadRequest(f"'{param}'{where} must not be empty", param=param)
        if _is_token_list(value):
            # The worker checks ids against its vocabulary; this bound only
            # keeps them packable on the wire (msgpack has no big ints).
            if not all(0 <= t < MAX_TOKEN_ID for t in value):
                raise BadRequest(f"'{param}'{where} has a token id out of range",
                                 param=param)
            return EmbeddingInput(tokens=value)
    raise BadRequest(
        f"'{param}'{where} must be a string or a list of token ids", param=param)


def parse_inputs(value: object, param: str) -> list[EmbeddingInput]:
    """OpenAI's four shapes of ``input``, and llama.cpp's object inputs
    (``_object_input``), each input checked and non-empty."""
    if isinstance(value, (str, dict)) or _is_token_list(value):
        return [_one_input(value, param, "")]
    if _is_mixed(value):
        raise _refuse_mixed(param, "")
    if not isinstance(value, list):
        raise BadRequest(f"'{param}' must be a string, a list of strings, a list "
                         "of token ids or a list of token-id lists", param=param)
    if not value:
        raise BadRequest(f"'{param}' must not be empty", param=param)
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise BadRequest(f"'{param}' has {len(value)} inputs; at most "
                         f"{MAX_EMBEDDING_INPUTS}", param=param)
    return [_one_input(item, param, f"[{i}]") for i, item in enumerate(value)]


class EmbeddingRequest:
    """A validated embedding body: what goes to a worker, and how to answer."""

    def __init__(self, body: object, native_route: bool) -> None:
        fields = RequestFields(body)
        given = {name: fields.get(name) for name in ("input", "content")}
        if given["input"] is not None:
            param = "input"
        elif given["content"] is not None:
            param = "content"
            native_route = True  # llama.cpp: "content" is not OAI compatible
        else:
            raise BadRequest("\"input\" or \"content\" must be provided",
                             param="input")
        self.inputs = parse_inputs(given[param], param)
        self.native = native_route
        self.model = request_fields.model(fields)
        fmt = fields.get("encoding_format")
        if fmt not in (None, "float", "base64"):
            raise BadRequest("'encoding_format' must be \"float\" or \"base64\"",
                             param="encoding_format")
        self.base64 = fmt == "base64"
        dims = fields.get("dimensions")
        if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int)
                                 or dims < 1):
            raise BadRequest("'dimensions' must be a positive integer",
                             param="dimensions")
        self.dimensions = dims
        norm = fields.get("embd_normalize")
        if norm is not None and (isinstance(norm, bool) or not isinstance(norm, int)
                                 or not -1 <= norm <= 64):
            raise BadRequest("'embd_normalize' must be an integer from -1 to 64",
                             param="embd_normalize")
        self.embd_normalize = 2 if norm is None else norm
        fields.finish(field_policy.EMBEDDING)

    def generation(self) -> GenerationRequest:
        return GenerationRequest(kind=EMBEDDING, inputs=self.inputs,
                                 embd_normalize=self.embd_normalize,
                                 dimensions=self.dimensions)


def collect_vectors(job: Job) -> tuple[list[bytes], messages.Final]:
    """Read an embedding job to its end: one vector per TOKEN frame.

    Bounded: the frontend accepted at most ``MAX_EMBEDDING_INPUTS`` inputs,
    and the worker sends one frame per input.
    """
    vectors: list[bytes] = []
    try:
        while True:
            msg = job.next_frame()
            if isinstance(msg, messages.Token):
                if len(vectors) >= MAX_EMBEDDING_INPUTS or not msg.embedding:
                    raise UpstreamError(ErrorCode.WORKER_PROTOCOL_ERROR,
                                        "the worker sent no embedding")
                vectors.append(msg.embedding)
            elif isinstance(msg, messages.Final):
                return vectors, msg
            else:
                raise UpstreamError.from_frame(msg)
    finally:
        job.end(LeaseEnding.LOCAL_ERROR)  # a no-op after FINAL or ERROR


def _floats_json(vector: bytes) -> str:
    """One vector as a JSON array. Encoded vector by vector, so a batch never
    exists as millions of Python floats at once (2048 inputs of 4096
    dimensions would be 8 M objects); only its text does."""
    return json.dumps(struct.unpack(f"<{len(vector) // 4}f", vector))


def shape_response(parsed: EmbeddingRequest, vectors: list[bytes], model: str,
                   prompt_tokens: int) -> bytes:
    """The JSON body: OpenAI's object, or llama.cpp's native list."""
    if parsed.native:
        items = [f'{{"index":{i},"embedding":[{_floats_json(v)}]}}'
                 for i, v in enumerate(vectors)]
        return ("[" + ",".join(items) + "]").encode()
    items = []
    for i, vector in enumerate(vectors):
        embedding = (json.dumps(base64.b64encode(vector).decode("ascii"))
                     if parsed.base64 else _floats_json(vector))
        items.append(f'{{"object":"embedding","index":{i},"embedding":{embedding}}}')
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return ('{"object":"list","data":[' + ",".join(items) + '],"model":'
            + json.dumps(model) + ',"usage":' + json.dumps(usage) + "}").encode()


class EmbeddingsResource(JobEndpoint[EmbeddingRequest]):
    """``POST /v1/embeddings`` (``native=False``), ``/embeddings`` (True).

    No prompt gate: the worker counts an input's tokens, and refuses one
    longer than its context."""

    def __init__(self, link: BrokerClient, settings: FrontendSettings,
                 native: bool) -> None:
        super().__init__(link, settings)
        self.native = native

    def parse(self, body: Any) -> EmbeddingRequest:
        return EmbeddingRequest(body, self.native)

    def admit(self, parsed: EmbeddingRequest, body: Any
              ) -> Submission[EmbeddingRequest]:
        return Submission(parsed, parsed.generation())

    def respond(self, req: falcon.Request, resp: falcon.Response,
                submission: Submission[EmbeddingRequest], job: Job) -> None:
        parsed = submission.parsed
        vectors, final = collect_vectors(job)
        if final.finish_reason == "cancelled" or len(vectors) != len(parsed.inputs):
            # Only a cancel we did not send ends it early (a frontend death
            # seen by the broker); never answer with part of a batch.
            raise UpstreamError(ErrorCode.WORKER_SHUTDOWN,
                                "the embedding job ended before every input")
        model = self.model_name(job, parsed.model)
        resp.content_type = falcon.MEDIA_JSON
        resp.data = shape_response(parsed, vectors, model,
                                   final.usage.prompt_tokens)
