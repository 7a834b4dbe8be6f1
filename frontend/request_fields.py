"""Reading a request body's fields: the readers every parser shares.

A parser wraps the body in ``RequestFields`` and reads each field through
it; the wrapper records what was read. When the parser is done it calls
``finish(policy)``, and every field it did not read gets a 400 naming it,
unless the endpoint's policy accepts it without reading it
(``frontend.field_policy``). So "which fields are implemented" is not a list
kept beside the code, free to drift from it: it is exactly the fields some
reader read. A reader therefore reads every field it stands for, also the
ones that lose (``n_predict`` over ``max_tokens``): a field read and then
overruled was still understood.

The shared readers (samplers, stop strings, token budget, stream flags, the
model name) are the public functions here; what only one API has stays in
its own parser (``frontend.openai_schema``, ``frontend.native_schema``,
``frontend.embeddings``).
"""

from __future__ import annotations

import math
from typing import Any

from frontend.errors import BadRequest
from frontend.field_policy import FieldPolicy, check_unread
from protocol.limits import MAX_LOGIT_BIAS_ENTRIES, MAX_STOP_CHARS_WITH_LOGPROBS
from protocol.payloads import (
    DEFAULTED_SAMPLERS,
    MAX_TOP_LOGPROBS,
    GenerationRequest,
    LogitBias,
    Sampling,
)

#: Most stop strings per request (OpenAI allows 4; llama.cpp has no limit).
MAX_STOP_STRINGS = 16


class RequestFields:
    """A JSON object being read field by field; remembers what was read."""

    def __init__(self, body: Any) -> None:
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        self._body = body
        self._read: set[str] = set()

    # --- raw access (marks the field read) -------------------------------------

    def get(self, name: str, default: Any = None) -> Any:
        self._read.add(name)
        return self._body.get(name, default)

    def __getitem__(self, name: str) -> Any:
        self._read.add(name)
        return self._body[name]

    def __contains__(self, name: str) -> bool:
        """Whether the client sent it (a presence test reads nothing)."""
        return name in self._body

    def sent(self, name: str) -> Any:
        """The client's value, or None (absent or null); reads nothing: a
        reader of its own must still read the field."""
        return self._body.get(name)

    def defer(self, *names: str) -> None:
        """These are read by a later step of the same request (which names
        them, beside its reader), after checks that must come first."""
        self._read.update(names)

    @property
    def read(self) -> frozenset[str]:
        return frozenset(self._read)

    def finish(self, policy: FieldPolicy) -> None:
        """Raise a 400 naming the first field no reader read and ``policy``
        does not accept as it is."""
        check_unread(self._body, self._read, policy)

    # --- typed readers (None: absent or null, so the default applies) ---------

    def number(self, name: str, lo=None, hi=None, integer: bool = False):
        """The field's number, range-checked."""
        value = self.get(name)
        if value is None:
            return None
        kinds = (int,) if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds):
            kind = "an integer" if integer else "a number"
            raise BadRequest(f"'{name}' must be {kind}", param=name)
        if not integer and not math.isfinite(value):
            raise BadRequest(f"'{name}' must be finite", param=name)
        if lo is not None and value < lo:
            raise BadRequest(f"'{name}' must be >= {lo}, got {value}", param=name)
        if hi is not None and value > hi:
            raise BadRequest(f"'{name}' must be <= {hi}, got {value}", param=name)
        return value

    def real(self, name: str, lo=None, hi=None) -> float | None:
        value = self.number(name, lo, hi)
        return None if value is None else float(value)

    def flag(self, name: str, default: bool | None = None) -> bool | None:
        value = self.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise BadRequest(f"'{name}' must be a boolean", param=name)
        return value


# --- the readers the parsers share -------------------------------------------------


def string_list(fields: RequestFields, name: str, most: int,
                what: str = "strings") -> list[str]:
    """``name`` as a list of at most ``most`` strings ([] when absent); a 400
    naming it otherwise (``what``: what the strings are, for the message)."""
    value = fields.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadRequest(f"'{name}' must be a list of strings", param=name)
    if len(value) > most:
        raise BadRequest(f"'{name}' has {len(value)} {what}; at most {most}",
                         param=name)
    return value


def model(fields: RequestFields) -> str | None:
    value = fields.get("model")
    if value is not None and not isinstance(value, str):
        raise BadRequest("'model' must be a string", param="model")
    return value


def stream(fields: RequestFields) -> bool:
    return bool(fields.flag("stream"))


def stream_options(fields: RequestFields) -> bool:
    """OpenAI's ``stream_options.include_usage``."""
    options = fields.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise BadRequest(
            "'stream_options.include_usage' must be a boolean",
            param="stream_options.include_usage",
        )
    return include


def timings_per_token(fields: RequestFields, streaming: bool) -> bool:
    """llama.cpp's ``timings_per_token``: timings on every streamed chunk (a
    whole answer carries its own once)."""
    return bool(fields.flag("timings_per_token")) and streaming


def stop(fields: RequestFields) -> list[str]:
    value = fields.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        if len(value) > MAX_STOP_STRINGS:
            raise BadRequest(
                f"'stop' has {len(value)} strings; at most {MAX_STOP_STRINGS}",
                param="stop",
            )
        return [s for s in value if s]
    raise BadRequest("'stop' must be a string or a list of strings", param="stop")


def max_tokens(fields: RequestFields,
               names: tuple[str, ...] = ("max_completion_tokens", "max_tokens")
               ) -> int | None:
    """The token budget: llama.cpp's ``n_predict`` (-1: no limit) wins over
    ``names``, of which the first the client sent counts."""
    n_predict = fields.number("n_predict", -1, None, integer=True)
    sent = [name for name in names if name in fields]
    values = {name: fields.get(name) for name in names}
    if n_predict is not None:
        return None if n_predict == -1 else n_predict
    param = sent[0] if sent else names[-1]
    value = values[param]
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise BadRequest(f"'{param}' must be an integer", param=param)
    if value is not None and value < 0:
        raise BadRequest(f"'{param}' must be >= 0, got {value}", param=param)
    return value


def left_out(fields: RequestFields,
             budget: tuple[str, ...] | None = ("max_completion_tokens",
                                               "max_tokens")) -> list[str]:
    """The fields a model worker's own defaults fill (``--temp``,
    ``--n-predict``, ...; ``GenerationRequest.defaulted``): each sampler the
    client left out (absent or null), and the token budget when it named
    none of ``budget`` nor ``n_predict`` (None: the endpoint requires one).
    ``n_predict: -1`` counts as none, as in llama-server, whose ``-n`` a
    request's -1 does not override."""
    sent = fields.sent
    names = [name for name in DEFAULTED_SAMPLERS if sent(name) is None]
    if budget is not None and all(sent(name) is None for name in budget) and (
            sent("n_predict") in (None, -1)):
        names.insert(0, "max_tokens")
    return names


def top_count(fields: RequestFields, name: str) -> int | None:
    """How many alternatives per token a field asks for (0 to the limit)."""
    return fields.number(name, 0, MAX_TOP_LOGPROBS, integer=True)


def sampling(fields: RequestFields) -> Sampling:
    """The samplers; a field left out is left out of the result, so that
    ``Sampling``'s own default (the one place it is written) applies."""
    n = fields.number("n", integer=True)
    if n not in (None, 1):
        raise BadRequest("only n=1 is supported", param="n")
    seed = fields.number("seed", integer=True)
    if seed is not None and not 0 <= seed < 2**32:
        raise BadRequest("'seed' must be in [0, 2^32)", param="seed")
    given = {
        "temperature": fields.real("temperature", 0, 2),
        "top_p": fields.real("top_p", 0, 1),
        "top_k": fields.number("top_k", 0, None, integer=True),
        "min_p": fields.real("min_p", 0, 1),
        "repeat_penalty": fields.real("repeat_penalty", 0, None),
        "presence_penalty": fields.real("presence_penalty", -2, 2),
        "frequency_penalty": fields.real("frequency_penalty", -2, 2),
        "seed": seed,
        "ignore_eos": fields.flag("ignore_eos"),
        "logit_bias": logit_bias(fields),
    }
    return Sampling(**{k: v for k, v in given.items() if v is not None})


def _bias_entry(key: Any, value: Any) -> LogitBias:
    """One entry: a token id or a text, biased by a number or banned by
    ``false`` (llama.cpp's forms; OpenAI's keys are ids written as text)."""
    if isinstance(key, str):
        try:
            token, piece = int(key), ""
        except ValueError:
            token, piece = None, key
    elif isinstance(key, int) and not isinstance(key, bool):
        token, piece = key, ""
    else:
        raise BadRequest("'logit_bias' keys must be token ids or strings",
                         param="logit_bias")
    if token is not None and token < 0:
        raise BadRequest(f"'logit_bias': token {token} is negative",
                         param="logit_bias")
    if token is None and not piece:
        raise BadRequest("'logit_bias': an empty string has no tokens",
                         param="logit_bias")
    if value is False:
        return LogitBias(token=token, piece=piece, never=True)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value)):
        raise BadRequest("'logit_bias' values must be finite numbers or false",
                         param="logit_bias")
    return LogitBias(token=token, piece=piece, bias=float(value))


def logit_bias(fields: RequestFields) -> list[LogitBias] | None:
    raw = fields.get("logit_bias")
    if raw is None:
        return None
    if isinstance(raw, dict):
        pairs = list(raw.items())
    elif isinstance(raw, list):
        pairs = []
        for item in raw:
            if not isinstance(item, list) or len(item) != 2:
                raise BadRequest("'logit_bias' as a list holds [token, bias] pairs",
                                 param="logit_bias")
            pairs.append((item[0], item[1]))
    else:
        raise BadRequest("'logit_bias' must be an object or a list of pairs",
                         param="logit_bias")
    if len(pairs) > MAX_LOGIT_BIAS_ENTRIES:
        raise BadRequest(f"'logit_bias' has {len(pairs)} entries; at most "
                         f"{MAX_LOGIT_BIAS_ENTRIES}", param="logit_bias")
    return [_bias_entry(k, v) for k, v in pairs]


#: Longest ``cache_salt`` (vLLM suggests 43 characters of base64: 256 bits).
MAX_CACHE_SALT_CHARS = 256


def cache_salt(fields: RequestFields) -> str:
    """vLLM's ``cache_salt``: cached prompts are reused only between requests
    with the same salt (and, with ``--cache-scope key``, the same key). A
    non-empty string when given, as vLLM has it. The parser leaves it in
    ``GenerationRequest.cache_tenant``; the endpoint turns it into the
    tenant id before anything is sent (``frontend.cache_scope``)."""
    value = fields.get("cache_salt")
    if value is None:
        return ""
    if not isinstance(value, str) or not value:
        raise BadRequest("'cache_salt' must be a non-empty string",
                         param="cache_salt")
    if len(value) > MAX_CACHE_SALT_CHARS:
        raise BadRequest(f"'cache_salt' has {len(value)} characters; at most "
                         f"{MAX_CACHE_SALT_CHARS}", param="cache_salt")
    return value


def check_stops_with_logprobs(generation: GenerationRequest) -> None:
    """Tokens held back behind a stop-string prefix travel with their
    log-probabilities in one frame, whose size the wire bounds."""
    if generation.logprobs is not None and any(
            len(s) > MAX_STOP_CHARS_WITH_LOGPROBS for s in generation.stop):
        raise BadRequest(f"with logprobs, a stop string is at most "
                         f"{MAX_STOP_CHARS_WITH_LOGPROBS} characters",
                         param="stop")
