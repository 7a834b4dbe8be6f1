from __future__ import annotations
import dataclasses

@dataclasses.dataclass
class ReusePlan:
    tokens: list
    reset: bool
    cached_tokens: int

def plan_reuse(llama, prompt):
    return ReusePlan(list(prompt), True, 0)
