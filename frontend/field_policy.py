"""Which request fields are accepted without being read: no field is
silently ignored.

A field of a request body is either implemented (some reader of the
endpoint's parser read it: ``frontend.request_fields``), or accepted with a
value that asks for nothing (a llama.cpp sampler's "off" value,
``cache_prompt: true`` which is what the pool always does), or ignored on
purpose and listed in docs/api.md. Anything else gets a 400 naming it: a
client that asks for a sampler, a feature or a field we do not have learns
so, instead of getting an answer made without it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

from frontend.errors import BadRequest

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


@dataclasses.dataclass(frozen=True)
class FieldPolicy:
    """What an endpoint accepts beyond what its parser reads."""

    #: Accepted with any value, and ignored (they change no output).
    ignored: frozenset[str] = frozenset()
    #: Accepted only with one of these values (their feature off).
    no_op_values: Mapping[str, tuple[Any, ...]] = dataclasses.field(
        default_factory=dict)
    #: Accepted because the sampler they set is off (checked by its switch).
    off_sampler_settings: Mapping[str, str] = dataclasses.field(
        default_factory=dict)


#: Every endpoint but the embeddings: OpenAI's labels, and llama.cpp's
#: samplers that are off (a llama.cpp client sends its whole settings block,
#: to the tokenizer endpoints too).
DEFAULT = FieldPolicy(IGNORED_ON_PURPOSE, NO_OP_VALUES,
                      SETTINGS_OF_A_SAMPLER_THAT_IS_OFF)
#: Embeddings: OpenAI's ``user`` labels a request and changes nothing.
EMBEDDING = FieldPolicy(frozenset({"user"}))


def _is_no_op(value: Any, allowed: tuple[Any, ...]) -> bool:
    # bool is an int in Python: True must not pass for 1, nor 0 for False.
    return any(type(value) is type(a) and value == a
               or (type(a) in (int, float) and type(value) in (int, float)
                   and value == a)
               for a in allowed)


def check_unread(body: dict, read: Collection[str], policy: FieldPolicy) -> None:
    """Raise a 400 naming the first field of ``body`` that was not read and
    that ``policy`` does not accept as it is (null counts as absent)."""
    for name, value in body.items():
        if name in read or name in policy.ignored or value is None:
            continue
        if name in policy.no_op_values:
            allowed = policy.no_op_values[name]
            if not _is_no_op(value, allowed):
                raise BadRequest(
                    f"'{name}' is not supported (only its default, "
                    f"{allowed[-1]!r}, is accepted)", param=name)
            continue
        if name in policy.off_sampler_settings:
            continue  # its switch was checked above, in the same loop
        raise BadRequest(f"'{name}' is not supported", param=name)
