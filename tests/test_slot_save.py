"""llama-server's slot actions through real processes (issue 34, item 9):
``POST /slots/{id}?action=save|restore|erase`` with ``--slot-save-path``.

A broker, workers started with ``--slot-save-path`` and ``--cache-ram 0``
(no prompt-state cache: after an erase nothing but a restored file can serve
a prompt's prefix, so ``timings.cache_n`` tells whether the restore worked),
and gunicorn. Also the default pool (no save path) and a batched worker
(no slot actions yet).
"""

from __future__ import annotations

import os

import httpx
import pytest

from frontend.pool_view import SLOT_ID_STRIDE
from tests.brokers_pool import BrokersPool
from tests.pool import EXACT_GREEDY
from tests.pool_factory import PoolOptions
from tests.test_slot_paths import RawStream, wait_paused
from workers.model import slot_files

pytestmark = pytest.mark.stack

TEXT = "Hello world, how are you? I am a test model. " * 6


@pytest.fixture(scope="module")
def saving(pool_factory, tmp_path_factory):
    """A private pool whose two workers keep slot files in one directory."""
    save_dir = tmp_path_factory.mktemp("slot-files")
    options = PoolOptions(workers=2, worker_args=(
        "--slot-save-path", str(save_dir), "--cache-ram", "0", *EXACT_GREEDY))
    with pool_factory(options, private=True) as pool:
        pool.save_dir = save_dir
        yield pool
        pool.assert_whole()


def _post(pool, path: str, body: dict | None = None, **params) -> httpx.Response:
    return httpx.post(pool.url + path, json=body, params=params, timeout=60)


def _action(pool, slot: int, action: str, body: dict | None = None):
    return _post(pool, f"/slots/{slot}", body, action=action)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status  # llama-server's shape
    return error


def _slot_ids(pool) -> list[int]:
    return sorted(s["id"] for s in httpx.get(pool.url + "/slots").json())


def _tokens(pool, text: str) -> list[int]:
    r = _post(pool, "/tokenize", {"content": text, "add_special": True})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _complete(pool, slot: int, prompt: list[int]) -> dict:
    r = _post(pool, "/completion", {"prompt": prompt, "n_predict": 4,
                                    "temperature": 0, "id_slot": slot})
    assert r.status_code == 200, r.text
    assert r.json()["id_slot"] == slot
    return r.json()


def test_save_erase_restore_round_trip_reuses_the_restored_tokens(saving):
    slot = _slot_ids(saving)[0]
    prompt = _tokens(saving, TEXT)
    longer = prompt + _tokens(saving, " And one more line.")[1:]
    _complete(saving, slot, prompt)

    saved = _action(saving, slot, "save", {"filename": "round.bin"})
    assert saved.status_code == 200, saved.text
    body = saved.json()
    assert set(body) == {"id_slot", "filename", "n_saved", "n_written", "timings"}
    assert body["id_slot"] == slot and body["filename"] == "round.bin"
    assert body["n_saved"] >= len(prompt)
    assert body["n_written"] == os.path.getsize(saving.save_dir / "round.bin")
    assert body["timings"]["save_ms"] >= 0

    erased = _action(saving, slot, "erase")
    assert erased.status_code == 200, erased.text
    assert erased.json() == {"id_slot": slot, "n_erased": body["n_saved"]}
    cold = _complete(saving, slot, longer)
    assert cold["timings"]["cache_n"] == 0  # the erase emptied the slot
    # Something else in the slot: the restore must replace it.
    _complete(saving, slot, _tokens(saving, "Zebras " * 40))

    restored = _action(saving, slot, "restore", {"filename": "round.bin"})
    assert restored.status_code == 200, restored.text
    assert restored.json() == {
        "id_slot": slot, "filename": "round.bin", "n_restored": body["n_saved"],
        "n_read": body["n_written"],
        "timings": {"restore_ms": restored.json()["timings"]["restore_ms"]}}
    warm = _complete(saving, slot, longer)
    assert warm["timings"]["cache_n"] >= len(prompt) - 1
    # The restored KV cells are the real ones: greedy output as from cold.
    assert warm["content"] == cold["content"]


def test_a_file_restores_into_another_slot_of_the_same_model(saving):
    first, second = _slot_ids(saving)
    prompt = _tokens(saving, TEXT + " Another.")
    _complete(saving, first, prompt)
    assert _action(saving, first, "save", {"filename": "moved"}).status_code == 200
    r = _action(saving, second, "restore", {"filename": "moved"})
    assert r.status_code == 200, r.text
    assert _complete(saving, second, prompt)["timings"]["cache_n"] == len(prompt) - 1


@pytest.mark.parametrize("name", ["../escape.bin", "a/b.bin", "..", ".", "",
                                  "trailing.", " lead", "x:y", "nul\x00"])
def test_a_bad_filename_is_llama_servers_400(saving, name):
    for action in ("save", "restore"):
        error = _error(_action(saving, _slot_ids(saving)[0], action,
                               {"filename": name}), 400)
        assert error["message"] == "Invalid filename"
    assert not (saving.save_dir.parent / "escape.bin").exists()


def test_a_name_that_resolves_outside_the_directory_is_refused(saving, tmp_path):
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"not yours")
    link = saving.save_dir / "link.bin"
    link.symlink_to(outside)
    try:
        for action in ("save", "restore"):
            error = _error(_action(saving, _slot_ids(saving)[0], action,
                                   {"filename": "link.bin"}), 400)
            assert error["message"] == "Invalid filename"
        assert outside.read_bytes() == b"not yours"
    finally:
        link.unlink()


def _saved_file(pool, name: str) -> bytes:
    slot = _slot_ids(pool)[0]
    _complete(pool, slot, _tokens(pool, TEXT))
    assert _action(pool, slot, "save", {"filename": name}).status_code == 200
    return (pool.save_dir / name).read_bytes()


def _refused_restore(pool, name: str) -> str:
    error = _error(_action(pool, _slot_ids(pool)[0], "restore",
                           {"filename": name}), 400)
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("Unable to restore slot: ")
    return error["message"]


def test_a_file_of_another_model_is_refused(saving):
    state = slot_files.decode(_saved_file(saving, "mine.bin"))
    (saving.save_dir / "other.bin").write_bytes(slot_files.encode(
        state.__class__(state.tokens, state.data, "/elsewhere/other.gguf:1:2",
                        (), state.crc32, state.tenant)))
    assert "another model" in _refused_restore(saving, "other.bin")


def test_a_damaged_file_is_refused(saving):
    raw = bytearray(_saved_file(saving, "whole.bin"))
    middle = len(raw) // 2
    raw[middle:middle + 64] = bytes(b ^ 0xFF for b in raw[middle:middle + 64])
    (saving.save_dir / "flipped.bin").write_bytes(bytes(raw))
    assert "damaged" in _refused_restore(saving, "flipped.bin")
    # Damaged KV bytes under a recomputed file checksum: the state's own
    # checksum (the prompt-state cache's) still finds them.
    state = slot_files.decode(_saved_file(saving, "whole.bin"))
    data = bytearray(state.data)
    data[len(data) // 2] ^= 0xFF
    (saving.save_dir / "forged.bin").write_bytes(slot_files.encode(
        state.__class__(state.tokens, bytes(data), state.model_id, (),
                        state.crc32, state.tenant)))
    assert "state checksum" in _refused_restore(saving, "forged.bin")
    (saving.save_dir / "junk.bin").write_bytes(b"\x00" * 100)
    assert "not a slot file" in _refused_restore(saving, "junk.bin")
    assert "no file" in _refused_restore(saving, "missing.bin")
    (saving.save_dir / "a-dir").mkdir()
    assert "cannot read" in _refused_restore(saving, "a-dir")


def test_unknown_actions_slots_and_fields_are_400s(saving):
    slot = _slot_ids(saving)[0]
    assert _error(_action(saving, slot, "dump"), 400)["message"] == "Invalid action"
    assert _error(_post(saving, f"/slots/{slot}"), 400)["message"] == "Invalid action"
    unknown = max(_slot_ids(saving)) + 1000
    for action, body in (("erase", None), ("save", {"filename": "a.bin"})):
        assert _error(_action(saving, unknown, action, body),
                      400)["message"] == "Invalid slot ID"
    assert _error(_action(saving, "x1", "erase"), 400)["message"] == "Invalid slot ID"
    assert "'filename'" in _error(_action(saving, slot, "save", {}), 400)["message"]
    assert "'filename'" in _error(_action(saving, slot, "save",
                                          {"filename": 7}), 400)["message"]
    assert "'mode'" in _error(_action(saving, slot, "save",
                                      {"filename": "a.bin", "mode": "x"}),
                              400)["message"]
    assert "'filename'" in _error(_action(saving, slot, "erase",
                                          {"filename": "a"}), 400)["message"]


def test_a_busy_slot_answers_503_and_the_action_runs_once_it_is_free(saving):
    slot = _slot_ids(saving)[0]
    body = {"prompt": "Hi", "n_predict": 2000, "ignore_eos": True, "stream": True,
            "id_slot": slot}
    held = RawStream(saving.port, body, path="/completion")
    try:
        assert int(held.header("X-Slot-Id")) == slot
        wait_paused(saving, slot)
        for action, extra in (("save", {"filename": "busy.bin"}),
                              ("restore", {"filename": "busy.bin"}),
                              ("erase", None)):
            r = _action(saving, slot, action, extra)
            assert r.status_code == 503, r.text
            assert int(r.headers["Retry-After"]) >= 1
        assert not (saving.save_dir / "busy.bin").exists()
    finally:
        held.close()
    saving.wait_free(2)
    r = _action(saving, slot, "save", {"filename": "busy.bin"})
    assert r.status_code == 200, r.text


def test_without_a_save_path_save_and_restore_get_llama_servers_501(whole_pool):
    slot = _slot_ids(whole_pool)[0]
    for action in ("save", "restore"):
        error = _error(_action(whole_pool, slot, action, {"filename": "a.bin"}),
                       501)
        assert error["type"] == "not_supported_error"
        assert error["message"] == slot_files.NO_SAVE_PATH
    r = _action(whole_pool, slot, "erase")
    assert r.status_code == 200, r.text
    assert r.json()["id_slot"] == slot


@pytest.fixture(scope="module")
def batched(pool_factory, tmp_path_factory):
    """One worker of two batched slots, with a save path."""
    save_dir = tmp_path_factory.mktemp("slot-files-batched")
    options = PoolOptions(workers=1, slots_per_worker=2, worker_args=(
        "--slot-save-path", str(save_dir), "--cache-ram", "0"))
    with pool_factory(options, private=True) as pool:
        yield pool
        pool.assert_whole()


def test_a_batched_workers_slot_saves_and_the_other_restores(batched):
    """Each slot of a batched worker is its own sequence of one context: a
    file saved from one restores into the other, and erase empties only its
    own slot."""
    first, second = _slot_ids(batched)
    prompt = _tokens(batched, TEXT + " Batched.")
    _complete(batched, first, prompt)
    saved = _action(batched, first, "save", {"filename": "batched.bin"})
    assert saved.status_code == 200, saved.text
    assert saved.json()["n_saved"] >= len(prompt)
    restored = _action(batched, second, "restore", {"filename": "batched.bin"})
    assert restored.status_code == 200, restored.text
    erased = _action(batched, first, "erase")
    assert erased.json() == {"id_slot": first, "n_erased": saved.json()["n_saved"]}
    assert _complete(batched, second, prompt)["timings"]["cache_n"] == len(prompt) - 1
    assert _complete(batched, first, prompt)["timings"]["cache_n"] == 0


KEY_A, KEY_B = "sk-slots-a-11aa", "sk-slots-b-22bb"


@pytest.fixture(scope="module")
def two_keys(pool_factory, tmp_path_factory):
    """One worker with a save path, two keys: each its own cache scope."""
    save_dir = tmp_path_factory.mktemp("slot-files-keys")
    options = PoolOptions(workers=1, api_keys=(KEY_A, KEY_B), worker_args=(
        "--slot-save-path", str(save_dir), "--cache-ram", "0"))
    with pool_factory(options, private=True) as pool:
        yield pool


def test_no_key_saves_restores_or_counts_another_keys_prompt(two_keys):
    def call(key: str, path: str, body: dict | None = None, **params):
        return httpx.post(two_keys.url + path, json=body, params=params,
                          headers={"Authorization": f"Bearer {key}"}, timeout=60)

    slot = httpx.get(two_keys.url + "/slots",
                     headers={"Authorization": f"Bearer {KEY_A}"}).json()[0]["id"]
    assert call(KEY_A, f"/slots/{slot}", action="erase").status_code == 200
    r = call(KEY_B, "/completion", {"prompt": TEXT, "n_predict": 2, "id_slot": slot})
    assert r.status_code == 200, r.text
    # A's save of the slot that holds B's prompt writes none of it.
    r = call(KEY_A, f"/slots/{slot}", {"filename": "a.bin"}, action="save")
    assert r.status_code == 200 and r.json()["n_saved"] == 0, r.text
    r = call(KEY_B, f"/slots/{slot}", {"filename": "b.bin"}, action="save")
    assert r.status_code == 200 and r.json()["n_saved"] > 0, r.text
    # B's file is not A's to load.
    r = call(KEY_A, f"/slots/{slot}", {"filename": "b.bin"}, action="restore")
    assert r.status_code == 400 and "another API key" in r.text, r.text
    assert call(KEY_A, f"/slots/{slot}", action="erase").json()["n_erased"] == 0
    r = call(KEY_B, f"/slots/{slot}", {"filename": "b.bin"}, action="restore")
    assert r.status_code == 200, r.text
    r = call(KEY_B, "/completion", {"prompt": TEXT, "n_predict": 2, "id_slot": slot})
    assert r.json()["timings"]["cache_n"] > 0
    # Without a key, the action is refused like any other route.
    assert httpx.post(two_keys.url + f"/slots/{slot}?action=erase").status_code == 401


def test_with_two_brokers_a_pool_wide_slot_id_names_its_broker(tiny_model, tmp_path):
    save_dir = tmp_path / "slot-files"
    pool = BrokersPool(tmp_path, worker_args=(
        "--model", str(tiny_model), "--threads", "1", "--ctx", "2048",
        "--slot-save-path", str(save_dir), "--cache-ram", "0"))
    try:
        ids = _slot_ids(pool)
        assert len(ids) == 2 and ids[1] >= SLOT_ID_STRIDE  # one per broker
        for n, slot in enumerate(ids):
            prompt = f"{TEXT} Slot number {n}."
            r = _post(pool, "/completion", {"prompt": prompt, "n_predict": 2,
                                            "id_slot": slot})
            assert r.status_code == 200 and r.json()["id_slot"] == slot, r.text
            saved = _action(pool, slot, "save", {"filename": f"b{n}.bin"})
            assert saved.status_code == 200, saved.text
            # The slot that ran the prompt saved it: the right broker's.
            assert saved.json()["id_slot"] == slot
            assert saved.json()["n_saved"] >= r.json()["tokens_evaluated"]
            erased = _action(pool, slot, "erase").json()
            assert erased == {"id_slot": slot, "n_erased": saved.json()["n_saved"]}
        missing = ids[1] + 50  # broker 1's range, no slot of it
        assert _error(_action(pool, missing, "erase"),
                      400)["message"] == "Invalid slot ID"
    finally:
        pool.stop()
