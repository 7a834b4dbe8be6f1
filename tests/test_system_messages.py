"""System messages reach the model under the "gemma" chat format.

``llamapool up`` renders the default Gemma model's chat with
llama-cpp-python's "gemma" format, which drops system messages (it logs so
at debug level only): a system prompt was silently ignored. They are now
folded into the first user turn, as Gemma's own chat template does.
"""

from __future__ import annotations

import httpx
import pytest

from tests.pool_factory import pool_fixture
from workers.model.prompting import fold_system_messages

SYSTEM = "You are a terse pirate who answers in riddles."


def test_fold_joins_system_turns_at_the_head_of_the_first_user_turn():
    turns = [{"role": "system", "content": "A"}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "yo"}, {"role": "system", "content": "B"},
             {"role": "user", "content": "again"}]
    assert fold_system_messages(turns) == [
        {"role": "user", "content": "A\n\nB\n\nhi"},
        {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"}]
    assert fold_system_messages([{"role": "system", "content": "A"}]) == [
        {"role": "user", "content": "A"}]
    plain = [{"role": "user", "content": "hi"}]
    assert fold_system_messages(plain) == plain


gemma_format_pool = pool_fixture(workers=1, worker_args=("--chat-format", "gemma"),
                                 frontend_env={"LLAMAPOOL_CHAT_FORMAT": "gemma"})


@pytest.mark.stack
def test_a_system_message_reaches_the_prompt(gemma_format_pool):
    url = gemma_format_pool.url
    user = [{"role": "user", "content": "Where is the treasure?"}]
    with_system = [{"role": "system", "content": SYSTEM}, *user]
    rendered = httpx.post(url + "/apply-template", json={"messages": with_system},
                          timeout=30).json()["prompt"]
    assert SYSTEM in rendered and rendered.index(SYSTEM) < rendered.index("treasure")

    def prompt_tokens(messages) -> int:
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": messages, "max_tokens": 1})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    # Counted by the worker that rendered it (the frontend's gate agrees).
    assert prompt_tokens(with_system) > prompt_tokens(user)
