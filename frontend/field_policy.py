"""Which request fields the server accepts: no field is silently ignored.

A field of a request body is either implemented (read by
``frontend.openai_schema``), or accepted with a value that asks for nothing
(a llama.cpp sampler's "off" value, ``cache_prompt: true`` which is what the
pool always does), or ignored on purpose and listed in the README. Anything
else gets a 400 naming it: a client that asks for a sampler, a feature or a
field we do not have learns so, instead of getting an answer made without it.
"""

from __future__ import annotations

from typing import Any

from frontend.errors import BadRequest

#: Read by both endpoints (``frontend.openai_schema``).
COMMON_FIELDS = frozenset({
    "model", "stream", "stream_options", "max_tokens", "max_completion_tokens",
    "n_predict", "temperature", "top_p", "top_k", "min_p", "repeat_penalty",
    "presence_penalty", "frequency_penalty", "seed", "ignore_eos", "stop", "n",
    "logit_bias", "grammar", "json_schema", "response_format", "n_probs",
    "timings_per_token",
})
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "logprobs", "top_logprobs", "tools",
                               "functions", "function_call", "tool_choice"}

#: Accepted and ignored on purpose (docs/api.md, "Request fields"): they ask the
#: server to record or label a request, which it does not do, and change no
#: output.
IGNORED_ON_PURPOSE = frozenset({"user", "metadata", "store", "service_tier",
                                "parallel_tool_calls"})

#: llama.cpp fields accepted only with the value that leaves their feature
#: off (the value llama.cpp itself defaults to): that is what the pool does.
NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "typical_p": (1, 1.0),
    "tfs_z": (1, 1.0),
    "mirostat": (0,),
    "dynatemp_range": (0, 0.0),
    "xtc_probability": (0, 0.0),
    "dry_multiplier": (0, 0.0),
    "top_n_sigma": (-1, -1.0),
    "repeat_last_n": (64,),
    "penalize_nl": (False,),
    "n_keep": (0,),
    "min_keep": (0,),
    "n_indent": (0,),
    "t_max_predict_ms": (0,),
    "cache_prompt": (True,),
    "id_slot": (-1,),
    "return_tokens": (False,),
    "post_sampling_probs": (False,),
    "best_of": (1,),
    "suffix": ("",),
}

#: Settings of a llama.cpp sampler that is off (its switch must be at its
#: ``NO_OP_VALUES`` value or absent, which is checked), so they change nothing.
SETTINGS_OF_A_SAMPLER_THAT_IS_OFF = {
    "mirostat_tau": "mirostat",
    "mirostat_eta": "mirostat",
    "dynatemp_exponent": "dynatemp_range",
    "xtc_threshold": "xtc_probability",
    "dry_base": "dry_multiplier",
    "dry_allowed_length": "dry_multiplier",
    "dry_penalty_last_n": "dry_multiplier",
    "dry_sequence_breakers": "dry_multiplier",
}


def _is_no_op(value: Any, allowed: tuple[Any, ...]) -> bool:
    # bool is an int in Python: True must not pass for 1, nor 0 for False.
    return any(type(value) is type(a) and value == a
               or (type(a) in (int, float) and type(value) in (int, float)
                   and value == a)
               for a in allowed)


def check_fields(body: dict, implemented: frozenset[str]) -> None:
    """Raise a 400 naming the first field that would be ignored."""
    for name, value in body.items():
        if name in implemented or name in IGNORED_ON_PURPOSE or value is None:
            continue
        if name in NO_OP_VALUES:
            if not _is_no_op(value, NO_OP_VALUES[name]):
                shown = NO_OP_VALUES[name][-1]
                raise BadRequest(
                    f"'{name}' is not supported (only its default, "
                    f"{shown!r}, is accepted)", param=name)
            continue
        if name in SETTINGS_OF_A_SAMPLER_THAT_IS_OFF:
            continue  # its switch was checked above, in the same loop
        raise BadRequest(f"'{name}' is not supported", param=name)
