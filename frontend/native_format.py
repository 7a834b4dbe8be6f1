"""llama.cpp's native response shape for ``/completion`` and ``/infill``.

The fields are those of llama.cpp's ``server_task_result_cmpl_final`` and
``..._partial::to_json_non_oaicompat`` (``tools/server/server-task.cpp``):
a streamed chunk is ``{index, content, tokens, stop: false, id_slot,
tokens_predicted, tokens_evaluated}``, its ``tokens`` the ids of the tokens
it covers whether or not ``return_tokens`` was asked for (llama.cpp's
``send_partial_response``), and the last one (or the whole answer) adds
``stop: true``, ``stop_type``, ``stopping_word``, the totals,
``generation_settings`` and ``timings``.
"""

from __future__ import annotations

import dataclasses
import json

from frontend.openai_format import ResponseShaper
from protocol import messages
from protocol.payloads import (
    GenerationRequest,
    RequestDefaults,
    Sampling,
    Timings,
    TokenLogprob,
)

#: llama.cpp's seed for "a fresh random seed" (``LLAMA_DEFAULT_SEED``).
RANDOM_SEED = 0xFFFFFFFF


def stop_type(finish_reason: str, stopping_word: str) -> str:
    """llama.cpp's ``stop_type``: why generation ended."""
    if finish_reason == "length":
        return "limit"
    if finish_reason == "stop":
        return "word" if stopping_word else "eos"
    return "none"  # cancelled


def sampler_params(sampling: Sampling, n_predict: int | None, *, stream: bool,
                   n_probs: int) -> dict:
    """llama.cpp's ``task_params::to_json(only_metrics=true)`` for what the
    pool does: the samplers it has, and the off values of those it has not
    (the values ``frontend.field_policy`` accepts for them)."""
    return {
        "seed": RANDOM_SEED if sampling.seed is None else sampling.seed,
        "temperature": sampling.temperature,
        "dynatemp_range": 0.0, "dynatemp_exponent": 1.0,
        "top_k": sampling.top_k, "top_p": sampling.top_p, "min_p": sampling.min_p,
        "top_n_sigma": -1.0, "xtc_probability": 0.0, "xtc_threshold": 0.1,
        "typical_p": 1.0, "repeat_last_n": 64,
        "repeat_penalty": sampling.repeat_penalty,
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "dry_multiplier": 0.0, "mirostat": 0,
        "max_tokens": -1 if n_predict is None else n_predict,
        "n_predict": -1 if n_predict is None else n_predict,
        "n_keep": 0, "ignore_eos": sampling.ignore_eos, "stream": stream,
        "n_probs": n_probs, "min_keep": 0,
        "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"],
        "timings_per_token": False, "post_sampling_probs": False,
    }


def default_params(defaults: RequestDefaults | None) -> dict:
    """``/props``' ``default_generation_settings.params``: the pool's
    defaults, with the model worker's own (``--temp``, ``--n-predict``, ...)
    where it has them, as a request that leaves them out is run."""
    defaults = defaults or RequestDefaults()
    return sampler_params(defaults.sampling(Sampling()), defaults.budget(None),
                          stream=False, n_probs=0)


def native_timings(timings: Timings, cached_tokens: int) -> dict:
    """llama.cpp's ``timings`` object, with the derived rates it also sends."""
    out = timings.public()
    prompt_n, predicted_n = out["prompt_n"], out["predicted_n"]
    out.setdefault("prompt_per_token_ms",
                   out["prompt_ms"] / prompt_n if prompt_n else 0.0)
    out.setdefault("prompt_per_second",
                   prompt_n / (out["prompt_ms"] / 1000) if out["prompt_ms"] else 0.0)
    out.setdefault("predicted_per_token_ms",
                   out["predicted_ms"] / predicted_n if predicted_n else 0.0)
    out.setdefault("cache_n", cached_tokens)
    return out


def probabilities(entries: list[TokenLogprob]) -> list[dict]:
    """llama.cpp's ``completion_probabilities`` (``probs_vector_to_json``)."""
    def candidate(c) -> dict:
        return {"id": c.id, "token": c.piece.decode("utf-8", "replace"),
                "bytes": list(c.piece), "logprob": c.logprob}
    return [{**candidate(e), "top_logprobs": [candidate(t) for t in e.top]}
            for e in entries]


def nested_values(paths: tuple[str, ...], answer: dict) -> dict:
    """llama.cpp's ``json_get_nested_values`` (``response_fields``): each
    path's value under the path itself as its key (``generation_settings/
    n_predict`` becomes a top-level field of that name); a path that leads
    nowhere is left out, without error."""
    out = {}
    for path in paths:
        value = answer
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out


def _event(obj: dict) -> bytes:
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return b"data: " + text.encode() + b"\n\n"


@dataclasses.dataclass
class NativeShaper:
    """Builds the native JSON for one request (a ``Shaper``,
    ``frontend.interfaces``).

    Args:
        generation: the request as sent to the worker.
        model: model name echoed back.
        id_slot: the slot the job got.
        n_prompt: the prompt's token count if the frontend knows it (the
            FINAL frame's usage is used at the end either way).
        prompt_text: echoed in the final ``prompt`` field.
        n_probs: alternatives per token to show (0 with ``show_probs``: just
            the chosen token's probability).
        show_probs: send ``completion_probabilities``.
        return_tokens: send the generated token ids in ``tokens``.
        stream: the request was streamed.
        response_fields: the final answer's fields to keep (``nested_values``;
            empty: all), as llama.cpp filters its final result, streamed or
            not; the other chunks are whole.
    """

    generation: GenerationRequest
    model: str
    id_slot: int
    n_prompt: int
    prompt_text: str
    n_probs: int
    show_probs: bool
    return_tokens: bool
    stream: bool
    response_fields: tuple[str, ...] = ()
    _predicted: int = 0

    def _tokens(self, entries: list[TokenLogprob]) -> list[int]:
        return [e.id for e in entries] if self.return_tokens else []

    def _streamed_tokens(self, packed: bytes, entries: list[TokenLogprob]
                         ) -> list[int]:
        """A streamed chunk's ``tokens``: the frame's ids, always, as
        llama-server sends them; from a worker that sends none, the entries'
        ids when ``return_tokens`` asked for them."""
        return (messages.unpack_token_ids(packed) if packed
                else self._tokens(entries))

    def _chunk(self, text: str, n_tokens: int, entries: list[TokenLogprob],
               packed_ids: bytes = b"") -> dict:
        self._predicted += n_tokens
        out = {"index": 0, "content": text,
               "tokens": self._streamed_tokens(packed_ids, entries),
               "stop": False, "id_slot": self.id_slot,
               "tokens_predicted": self._predicted,
               "tokens_evaluated": self.n_prompt}
        if self.show_probs and entries:
            out["completion_probabilities"] = probabilities(entries)
        return out

    def text_frame_event(self, msg: messages.Token) -> bytes:
        chunk = self._chunk(msg.text, msg.n_tokens, msg.logprobs, msg.token_ids)
        if msg.timings is not None:  # the request's timings_per_token
            chunk["timings"] = native_timings(msg.timings, msg.timings.cache_n)
        return _event(chunk)

    def final(self, msg: messages.Final, text: str, entries: list[TokenLogprob]
              ) -> dict:
        usage = msg.usage
        return {
            "index": 0, "content": text, "tokens": self._tokens(entries),
            "id_slot": self.id_slot, "stop": True, "model": self.model,
            "tokens_predicted": usage.completion_tokens,
            "tokens_evaluated": usage.prompt_tokens,
            "generation_settings": sampler_params(
                self.generation.sampling, self.generation.max_tokens,
                stream=self.stream, n_probs=self.n_probs if self.show_probs else 0),
            "prompt": self.prompt_text,
            "has_new_line": "\n" in text,
            # As llama-server: generation stopped because the context was full.
            "truncated": msg.truncated,
            "stop_type": stop_type(msg.finish_reason, msg.stopping_word),
            "stopping_word": msg.stopping_word,
            # As llama.cpp: tokens the slot's KV cache holds after the job.
            "tokens_cached": usage.prompt_tokens + usage.completion_tokens,
            "timings": native_timings(msg.timings, usage.cached_tokens),
        }

    def whole_answer(self, text: str, final: messages.Final,
                     entries: list[TokenLogprob]) -> dict:
        out = self.final(final, text, entries)
        if self.show_probs:
            out["completion_probabilities"] = probabilities(entries)
        return self._kept(out)

    def _kept(self, answer: dict) -> dict:
        if not self.response_fields:
            return answer
        return nested_values(self.response_fields, answer)

    # --- the rest of ``Shaper``: what the SSE body calls -------------------------

    def final_frame_events(self, msg: messages.Final) -> bytes:
        # The final chunk carries the held-back tail, its entries and the ids
        # of the tokens counted since the last chunk (llama.cpp's final chunk
        # has none: it sends a chunk per token, text or not); no
        # completion_probabilities on it (as llama.cpp: they went per chunk).
        out = self.final(msg, msg.text, msg.logprobs)
        out["tokens"] = self._streamed_tokens(msg.token_ids, msg.logprobs)
        if self.show_probs and msg.logprobs:
            out["completion_probabilities"] = probabilities(msg.logprobs)
        return _event(self._kept(out))

    error_event = staticmethod(ResponseShaper.error_event)
