"""Tiny random-weight llama GGUF for tests.

Real models are hundreds of MB and slow to load; tests only need something
llama.cpp accepts as a llama-architecture model with an SPM tokenizer and a
chat template. This writes one (about 0.5 MB) in a few milliseconds.
"""

from __future__ import annotations

import os

# Fixed token ids, in the usual SentencePiece llama layout, so tests can
# refer to them directly.
UNK_ID = 0
BOS_ID = 1
EOS_ID = 2
FIRST_BYTE_ID = 3  # <0x00> .. <0xFF> occupy ids 3..258

N_CTX_TRAIN = 2048
N_EMBD = 64
N_HEAD = 4
N_HEAD_KV = 2
N_FF = 128
N_LAYER = 2

# chatml-like; <|im_end|> is also registered as EOT so llama.cpp treats it as
# end-of-generation.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: The same, plus the tool list in a system turn, as Hermes- and Qwen-style
#: templates render it, and the call format they teach (``<tool_call>``):
#: a template that supports tools (``frontend.tool_calls``).
TOOLS_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\nYou may call these functions. To call "
    "one, answer <tool_call>{\"name\": <name>, \"arguments\": <object>}"
    "</tool_call>.\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: A reasoning model's template, in Qwen3's manner: the assistant turn opens
#: ``<think>`` in the prompt (the model reasons first, ``frontend.reasoning``)
#: unless ``enable_thinking`` is false, when it writes an empty reasoning;
#: an earlier turn's ``reasoning_content`` is shown again; tools as above.
REASONING_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\nYou may call these functions. To call "
    "one, answer <tool_call>{\"name\": <name>, \"arguments\": <object>}"
    "</tool_call>.\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message.reasoning_content %}<think>\n{{ message.reasoning_content }}"
    "\n</think>\n\n{% endif %}"
    "{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}"
)

#: Templates teaching the other tool-call formats (``protocol.tool_formats``),
#: on the same chatml control tokens (``<|im_end|>`` ends a turn), so the
#: tiny model runs them: ``make-test-model --tool-format NAME``.
#: Llama 3.x: a JSON object; this one renders ``tool_calls`` itself.
LLAMA3_TOOLS_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nTo call a "
    "function, answer {\"name\": function name, \"parameters\": dictionary "
    "of argument name and its value}.\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}"
    "<|start_header_id|>ipython<|end_header_id|>\n\n{{ message.content }}"
    "<|im_end|>"
    "{% elif message.tool_calls %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for call in message.tool_calls %}{\"name\": \"{{ call.function.name }}"
    "\", \"parameters\": {{ call.function.arguments | tojson }}}"
    "{% endfor %}<|im_end|>"
    "{% else %}"
    "<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n"
    "{{ message.content }}<|im_end|>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>"
    "\n\n{% endif %}"
)
#: Mistral v3: ``[TOOL_CALLS][{...}]``; earlier calls come in the text.
MISTRAL_TOOLS_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}[AVAILABLE_TOOLS]Call as [TOOL_CALLS][{\"name\": name, "
    "\"arguments\": {...}}]: {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' %}{{ message.content }}<|im_end|>"
    "{% elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.content }}"
    "[/TOOL_RESULTS]"
    "{% else %}[INST]{{ message.content }}[/INST]{% endif %}"
    "{% endfor %}"
)
#: Mistral v11 (Magistral, Devstral): ``[TOOL_CALLS]name[ARGS]{...}``.
MISTRAL_V11_TOOLS_CHAT_TEMPLATE = MISTRAL_TOOLS_CHAT_TEMPLATE.replace(
    "[TOOL_CALLS][{\"name\": name, \"arguments\": {...}}]",
    "[TOOL_CALLS]name[ARGS]{...}")
#: The control tokens a real vocabulary of each format has for its markers
#: (``--tool-format`` adds them).
TOOL_FORMAT_CONTROL_PIECES = {
    "mistral": ("[TOOL_CALLS]",),
    "mistral-v11": ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
}
#: The templates by format name (``--tool-format``).
TOOL_FORMAT_TEMPLATES = {
    "hermes": TOOLS_CHAT_TEMPLATE,
    "llama3": LLAMA3_TOOLS_CHAT_TEMPLATE,
    "mistral": MISTRAL_TOOLS_CHAT_TEMPLATE,
    "mistral-v11": MISTRAL_V11_TOOLS_CHAT_TEMPLATE,
}

_WORDS = (
    "the a an and of to in is it you I am are how hi Hello hello world test "
    "model this that with for on at be we they he she not yes no what why "
    "good day time say make"
).split()
_PUNCT = list(".,!?;:'\"-()")


#: Fill-in-the-middle tokens a model written with ``fim=True`` has (after
#: the chat tokens), in llama.cpp's order: prefix, suffix, middle.
FIM_PIECES = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


def _vocab(fim: bool = False, control_pieces: tuple[str, ...] = ()
           ) -> tuple[list[str], list[float], list[int]]:
    from gguf import TokenType

    """Build the SPM vocabulary.

    Returns:
        Parallel lists of pieces, scores and token types.
    """
    pieces = ["<unk>", "<s>", "</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    # Byte fallback tokens: any character without a piece still tokenizes.
    pieces += [f"<0x{b:02X}>" for b in range(256)]
    types += [TokenType.BYTE] * 256

    normal: list[str] = ["\u2581"]
    normal += [chr(c) for c in range(ord("a"), ord("z") + 1)]
    normal += [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    normal += [str(d) for d in range(10)]
    normal += _PUNCT
    # SPM merges adjacent symbols only if the concatenation is itself a piece,
    # so every prefix of a word piece must exist for the word to be reachable.
    for word in _WORDS:
        w = "\u2581" + word
        for end in range(2, len(w) + 1):
            normal.append(w[:end])
    seen: set[str] = set()
    normal = [p for p in normal if not (p in seen or seen.add(p))]
    pieces += normal
    types += [TokenType.NORMAL] * len(normal)

    pieces += ["<|im_start|>", "<|im_end|>"]
    types += [TokenType.CONTROL, TokenType.CONTROL]
    if fim:
        pieces += list(FIM_PIECES)
        types += [TokenType.CONTROL] * len(FIM_PIECES)
    pieces += list(control_pieces)
    types += [TokenType.CONTROL] * len(control_pieces)

    # Longer pieces score higher so that whole words win over fragments;
    # non-normal tokens get 0 like sentencepiece exports.
    scores = [
        float(len(p)) if t == TokenType.NORMAL else 0.0
        for p, t in zip(pieces, types, strict=True)
    ]
    return pieces, scores, [int(t) for t in types]


def _weights(seed: int, pieces: list[str]) -> dict:
    """The tensors (F32, NumPy): random layers, and the bias channel."""
    import numpy as np

    n_vocab = len(pieces)
    im_end_id = pieces.index("<|im_end|>")
    head_dim = N_EMBD // N_HEAD
    rng = np.random.default_rng(seed)

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    tensors: dict[str, np.ndarray] = {}

    # Dimension 0 of the residual stream is a constant "bias channel": every
    # embedding has a large fixed value there and no layer writes to it. The
    # llama architecture has no output bias, so column 0 of output.weight acts
    # as one and lets us make EOS and raw byte tokens rare without making
    # them impossible.
    embd = normal((n_vocab, N_EMBD), 1.0)
    embd[:, 0] = 8.0
    tensors["token_embd.weight"] = embd

    for i in range(N_LAYER):
        # ~1/sqrt(fan_in) so layers actually mix context into the logits
        # (tests comparing cached and uncached runs need context to matter).
        std = 1.0 / np.sqrt(N_EMBD)
        p = f"blk.{i}."
        tensors[p + "attn_norm.weight"] = np.ones(N_EMBD, np.float32)
        tensors[p + "attn_q.weight"] = normal((N_EMBD, N_EMBD), std)
        tensors[p + "attn_k.weight"] = normal((N_HEAD_KV * head_dim, N_EMBD), std)
        tensors[p + "attn_v.weight"] = normal((N_HEAD_KV * head_dim, N_EMBD), std)
        attn_out = normal((N_EMBD, N_EMBD), std)
        attn_out[0, :] = 0.0  # keep the bias channel constant
        tensors[p + "attn_output.weight"] = attn_out
        tensors[p + "ffn_norm.weight"] = np.ones(N_EMBD, np.float32)
        tensors[p + "ffn_gate.weight"] = normal((N_FF, N_EMBD), std)
        tensors[p + "ffn_up.weight"] = normal((N_FF, N_EMBD), std)
        ffn_down = normal((N_EMBD, N_FF), 1.0 / np.sqrt(N_FF))
        ffn_down[0, :] = 0.0  # keep the bias channel constant
        tensors[p + "ffn_down.weight"] = ffn_down

    tensors["output_norm.weight"] = np.ones(N_EMBD, np.float32)
    # Random part gives logits a spread of ~3 so sampling is varied; column 0
    # is the bias (the normed bias channel is ~5, so bias/5 is roughly a logit
    # offset). With -4, EOS is never in the default top-k=40 but is sampled
    # now and then with top_k=0.
    out = normal((n_vocab, N_EMBD), 0.25)
    bias = np.zeros(n_vocab, np.float32)
    bias[[UNK_ID, BOS_ID, pieces.index("<|im_start|>")]] = -30.0  # never useful
    bias[[EOS_ID, im_end_id]] = -4.0  # rare but possible
    bias[FIRST_BYTE_ID : FIRST_BYTE_ID + 256] = -4.0  # mostly readable text
    out[:, 0] = bias / 5.0
    tensors["output.weight"] = out

    return tensors


#: Weight types ``write_test_model`` can write (``--quant``). The block
#: quants are what users run, and the ones llama.cpp's repacked (AVX2:
#: Q4_0) and AMX (Q4_0, Q8_0) matmul kernels take; F32 takes neither.
QUANTS = ("f32", "q8_0", "q4_0")

#: The quantized tensors: the layers' matrices, as a quantized model's are.
#: The embeddings and the output matrix stay F32, so the bias channel below
#: keeps its exact offsets.
_QUANTIZED_SUFFIXES = ("attn_q.weight", "attn_k.weight", "attn_v.weight",
                       "attn_output.weight", "ffn_gate.weight", "ffn_up.weight",
                       "ffn_down.weight")


def write_test_model(path: str | os.PathLike[str], *, seed: int = 0,
                     chat_template: str = CHAT_TEMPLATE, fim: bool = False,
                     quant: str = "f32", control_pieces: tuple[str, ...] = ()) -> None:
    """Write a tiny random-weight llama GGUF (F32 ~0.5 MB, less quantized).

    2 layers, 64 dims, 4 heads (2 KV heads), FFN 128, context length 2048,
    SPM vocabulary (<unk>=0, <s>=1, </s>=2, byte tokens, a few hundred pieces,
    <|im_start|>/<|im_end|>) and a chatml-like ``tokenizer.chat_template``.

    Args:
        path: Destination file; overwritten if it exists.
        seed: Seed for the weights; same seed gives a byte-identical file.
        chat_template: ``tokenizer.chat_template`` (``TOOLS_CHAT_TEMPLATE``:
            one that renders tools; ``REASONING_CHAT_TEMPLATE``: one that
            reasons).
        fim: Also give it fill-in-the-middle tokens (``FIM_PIECES``), for
            ``/infill``; the default model has none, like most chat models.
        quant: One of ``QUANTS``: the layers' weight type.
        control_pieces: More control tokens, as a real vocabulary has its
            tool format's markers (Mistral's ``[TOOL_CALLS]``).
    """
    if quant not in QUANTS:
        raise ValueError(f"quant {quant!r}: one of {', '.join(QUANTS)}")
    # Imported here: gguf and numpy are test dependencies, not the server's.
    from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType
    from gguf.quants import quantize

    pieces, scores, types = _vocab(fim, control_pieces)
    n_vocab = len(pieces)
    im_end_id = pieces.index("<|im_end|>")
    head_dim = N_EMBD // N_HEAD
    tensors = _weights(seed, pieces)

    writer = GGUFWriter(os.fspath(path), "llama")
    writer.add_name("llamapool-test-model")
    qtype = {"q8_0": GGMLQuantizationType.Q8_0,
             "q4_0": GGMLQuantizationType.Q4_0}.get(quant)
    writer.add_file_type({"q8_0": LlamaFileType.MOSTLY_Q8_0,
                          "q4_0": LlamaFileType.MOSTLY_Q4_0}.get(
                              quant, LlamaFileType.ALL_F32))
    writer.add_context_length(N_CTX_TRAIN)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)

    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(UNK_ID)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_eot_token_id(im_end_id)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(chat_template)
    if fim:
        from gguf import Keys

        for key, piece in zip((Keys.Tokenizer.FIM_PRE_ID, Keys.Tokenizer.FIM_SUF_ID,
                               Keys.Tokenizer.FIM_MID_ID), FIM_PIECES, strict=True):
            writer.add_uint32(key, pieces.index(piece))

    for name, data in tensors.items():
        if qtype is not None and name.endswith(_QUANTIZED_SUFFIXES):
            # Bytes of blocks: the writer derives the shape from them.
            writer.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, data)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
