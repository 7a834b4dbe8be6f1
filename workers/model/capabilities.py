"""What a worker's model can do, as it tells the broker (``Ready.capabilities``).

Read once from the loaded engine, so ``/v1/models`` says per model what
requests it takes (issue 30): ``completion`` and ``chat`` always (a model
without a chat template is rendered in llama-cpp-python's fallback format),
``tools`` when its chat template renders them (``PromptBuilder``),
``embeddings`` when the engine has the feature, ``infill`` when the
vocabulary has the fill-in-the-middle tokens (llama.cpp's own test),
``rerank`` when the model has a rank head (``workers.model.rerank``).
"""

from __future__ import annotations

from workers.model.engine import Engine
from workers.model.features import Feature


def engine_capabilities(engine: Engine) -> list[str]:
    """The capability names of ``protocol.payloads.CAPABILITIES`` it has."""
    caps = ["completion", "chat"]
    # The synthetic engine (and a test's stand-in) has no prompts.
    prompts = getattr(engine, "prompts", None)
    if prompts is not None and prompts.renders_tools:
        caps.append("tools")
    if Feature.EMBEDDINGS in getattr(engine, "features", ()):
        caps.append("embeddings")
        embedder = getattr(engine, "embedder", None)
        if embedder is not None and embedder.ranks:
            caps.append("rerank")
    if prompts is not None:
        from workers.model.infill import fim_problem

        if fim_problem(prompts) is None:
            caps.append("infill")
    return caps
