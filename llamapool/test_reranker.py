"""Tiny random-weight reranker GGUF for tests (``make-test-model --reranker``).

A Qwen3-architecture model with a rank head, as Qwen3-Reranker is
converted for llama.cpp: ``{arch}.pooling_type`` rank, a ``cls.output``
matrix with one row per label (``yes``, ``no``), and llama.cpp's graph for
the arch ends in a softmax over them, so a sequence's score is the first
label's probability, read from its last token (causal attention). Why this
arch and not a BERT cross-encoder: it is still a causal LM with an output
matrix, so a generation worker loads and serves it like any other model and
takes rank jobs in its second, pooled context (``workers.model.embedding``).

The vocabulary and layers are ``llamapool.test_model``'s, plus the per-head
query and key norms Qwen3 has; the weights are random but deterministic.
"""

from __future__ import annotations

import os

from llamapool import test_model as tm

#: The rank head's labels (llama.cpp's ``classifier.output_labels``).
LABELS = ("yes", "no")

#: llama.cpp's ``LLAMA_POOLING_TYPE_RANK``.
POOLING_RANK = 4

#: ``tokenizer.chat_template.rerank``: how llama.cpp's server joins a query
#: and a document for a model that has one (``format_prompt_rerank``).
#: Qwen3-Reranker's ends with the assistant's turn opened; this one ends
#: with the document, so that the last token, whose state the rank head
#: reads, differs between documents and random weights spread the scores.
RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the Query. Answer "
    "only \"yes\" or \"no\".<|im_end|>\n"
    "<|im_start|>user\n<Query>: {query}\n<Document>: {document}")


def write_test_reranker(path: str | os.PathLike[str], *, seed: int = 0,
                        rerank_template: bool = True, quant: str = "f32") -> None:
    """Write the tiny Qwen3 reranker (F32 about 0.5 MB, less quantized).

    Args:
        path: Destination file; overwritten if it exists.
        seed: Seed for the weights; same seed gives a byte-identical file.
        rerank_template: Give it a ``rerank`` chat template; without one,
            llama.cpp joins query and document as BOS query [EOS] [SEP] doc.
        quant: One of ``test_model.QUANTS``: the layers' weight type (the
            embeddings and both heads stay F32).
    """
    if quant not in tm.QUANTS:
        raise ValueError(f"quant {quant!r}: one of {', '.join(tm.QUANTS)}")
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType
    from gguf.quants import quantize

    pieces, scores, types = tm._vocab()
    im_end_id = pieces.index("<|im_end|>")
    head_dim = tm.N_EMBD // tm.N_HEAD
    tensors = tm._weights(seed, pieces)
    rng = np.random.default_rng(seed + 1)
    for i in range(tm.N_LAYER):
        tensors[f"blk.{i}.attn_q_norm.weight"] = np.ones(head_dim, np.float32)
        tensors[f"blk.{i}.attn_k_norm.weight"] = np.ones(head_dim, np.float32)
    # One row per label, small, and blind to the constant bias channel
    # (dimension 0): the yes/no softmax then spreads scores over (0, 1)
    # instead of pinning them at 0 or 1, so documents order distinctly.
    cls_out = (rng.standard_normal((len(LABELS), tm.N_EMBD)) * 0.3).astype(np.float32)
    cls_out[:, 0] = 0.0
    tensors["cls.output.weight"] = cls_out

    writer = GGUFWriter(os.fspath(path), "qwen3")
    writer.add_name("llamapool-test-reranker")
    qtype = {"q8_0": GGMLQuantizationType.Q8_0,
             "q4_0": GGMLQuantizationType.Q4_0}.get(quant)
    writer.add_file_type({"q8_0": LlamaFileType.MOSTLY_Q8_0,
                          "q4_0": LlamaFileType.MOSTLY_Q4_0}.get(
                              quant, LlamaFileType.ALL_F32))
    writer.add_context_length(tm.N_CTX_TRAIN)
    writer.add_embedding_length(tm.N_EMBD)
    writer.add_block_count(tm.N_LAYER)
    writer.add_feed_forward_length(tm.N_FF)
    writer.add_head_count(tm.N_HEAD)
    writer.add_head_count_kv(tm.N_HEAD_KV)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(len(pieces))
    writer.add_uint32("qwen3.pooling_type", POOLING_RANK)
    writer.add_array("qwen3.classifier.output_labels", list(LABELS))

    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(tm.UNK_ID)
    writer.add_bos_token_id(tm.BOS_ID)
    writer.add_eos_token_id(tm.EOS_ID)
    writer.add_eot_token_id(im_end_id)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(tm.CHAT_TEMPLATE)
    if rerank_template:
        writer.add_string("tokenizer.chat_template.rerank", RERANK_TEMPLATE)

    for name, data in tensors.items():
        if qtype is not None and name.endswith(tm._QUANTIZED_SUFFIXES):
            writer.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
