"""Building the engine a worker's settings name.

Imports of the engines are deferred so that a synthetic worker never loads
llama-cpp-python, and a llama.cpp worker never pays for the stand-in.
"""

from __future__ import annotations

from workers.model.engine import Engine
from workers.model.settings import WorkerSettings


def load_engine(settings: WorkerSettings) -> Engine:
    """Load the engine (the model, for llama.cpp); may take seconds."""
    if settings.engine == "synthetic":
        from workers.model.synthetic_engine import SyntheticEngine

        return SyntheticEngine(
            tokens_per_second=settings.tokens_per_second,
            n_ctx=settings.n_ctx,
            model_name=settings.model_name or None,
        )
    from workers.model.weight_repack import repack_enabled

    if settings.n_slots > 1:
        from workers.model.batched_engine import BatchedEngine

        return BatchedEngine(
            settings.model_path,
            n_slots=settings.n_slots,
            n_ctx=settings.n_ctx,
            n_threads=settings.starting_threads,
            chat_format=settings.chat_choice,
            model_name=settings.model_name or None,
            n_gpu_layers=settings.gpu_layers,
            flash_attn=settings.flash_attn == "on",
            repack=repack_enabled(settings.repack),
            cache_ram_mib=settings.cache_ram_mib,
            embedding_batch_tokens=settings.embedding_batch_tokens,
        )
    from workers.model.llama_engine import LlamaEngine

    return LlamaEngine(
        settings.model_path,
        n_ctx=settings.n_ctx,
        n_threads=settings.starting_threads,
        chat_format=settings.chat_choice,
        model_name=settings.model_name or None,
        embedding_batch_tokens=settings.embedding_batch_tokens,
        cache_ram_mib=settings.cache_ram_mib,
        n_gpu_layers=settings.gpu_layers,
        flash_attn=settings.flash_attn == "on",
        repack=repack_enabled(settings.repack),
    )
