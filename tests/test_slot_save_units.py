"""Slot actions in process: the wire messages, the file format, the file
name rule, and the worker link's refusals (issue 34, item 9; the real
processes are in ``tests/test_slot_save.py``)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from protocol import messages
from protocol.errors import ErrorCode
from protocol.records import MalformedMessage
from protocol.slot_filename import valid_filename
from tests.test_worker_link import REQUEST, registered_link, submit
from workers.model import slot_files
from workers.model.active_job import Outgoing
from workers.model.prompt_cache import PromptStateCache
from workers.model.slot_files import SlotFiles, SlotTask


def _body(msg: messages.Message) -> list:
    return msgpack.unpackb(msg.to_wire()[2])


def _decode_fields(cls, fields: list) -> messages.Message:
    return messages.decode([messages.PROTOCOL_HEADER, cls.COMMAND,
                            msgpack.packb(fields)])


def test_slot_messages_round_trip():
    action = messages.SlotAction("j", 3, "save", "a.bin", "t" * 32, "r")
    assert messages.decode(action.to_wire()) == action
    done = messages.SlotDone("j", "restore", 10, 4096, 1.5)
    assert messages.decode(done.to_wire()) == done


@pytest.mark.parametrize("fields", [
    ["j", 0, "dump", "a.bin"],  # not an action
    ["j", -1, "save", "a.bin"],  # no such slot id
    ["j", 0, "save", "x" * 256],  # longer than any name llama.cpp takes
    ["j", "0", "save", "a.bin"],
    ["j", 0, "save", b"a.bin"],
])
def test_a_garbage_slot_action_does_not_decode(fields):
    with pytest.raises(MalformedMessage):
        _decode_fields(messages.SlotAction, fields)


def test_an_oversized_slot_message_is_refused_before_unpacking():
    frames = [messages.PROTOCOL_HEADER, messages.SlotDone.COMMAND,
              msgpack.packb(["j", "save", 0, 0, 0.0, "", "m" * 200_000])]
    with pytest.raises(MalformedMessage):
        messages.decode(frames)
    with pytest.raises(MalformedMessage):
        _decode_fields(messages.SlotDone, ["j", "save", -4])


@pytest.mark.parametrize("name,ok", [
    ("slot1.bin", True), ("état.bin", True), ("a b", True),
    ("", False), ("..", False), (".", False), ("a..b", False),
    ("../x", False), ("a/b", False), ("a\\b", False), ("x:y", False),
    ("trailing.", False), (" lead", False), ("trail ", False),
    ("tab\tx", False), ("\ud800", False), ("\u2215etc", False),
    ("x" * 255, True), ("x" * 256, False), ("é" * 128, False),
])
def test_filenames_follow_llama_cpps_rule(name, ok):
    assert valid_filename(name) is ok


def _state(cache: PromptStateCache, n: int = 5):
    return cache.state_of(np.arange(n), b"kv-bytes" * 10, "tenant")


def test_a_slot_file_keeps_the_state_and_finds_any_damage():
    cache = PromptStateCache(0, "model-a")
    state = _state(cache)
    back = slot_files.decode(slot_files.encode(state))
    assert back.tokens.tolist() == state.tokens.tolist()
    assert (back.data, back.model_id, back.tenant, back.crc32) == (
        state.data, "model-a", "tenant", state.crc32)
    assert back.intact()
    raw = bytearray(slot_files.encode(state))
    for at in range(len(slot_files.MAGIC), len(raw)):
        damaged = bytearray(raw)
        damaged[at] ^= 0x01
        with pytest.raises(slot_files.SlotFileError):
            slot_files.decode(bytes(damaged))
    for short in (b"", slot_files.MAGIC, bytes(raw[:-1]), b"GGUF" + bytes(40)):
        with pytest.raises(slot_files.SlotFileError):
            slot_files.decode(short)


class _NoSlotEngine:
    """An engine without a KV sequence to act on (the synthetic one)."""


def _task(action: str, filename: str = "") -> SlotTask:
    return SlotTask(messages.SlotAction("j", 0, action, filename))


def test_a_worker_without_a_save_path_refuses_save_and_restore(tmp_path):
    class Reuse:
        live_tenant = ""

        def live_length(self):
            return 7

        def clear_live(self):
            self.cleared = True

    class Engine:
        slot_reuse = Reuse()

    files = SlotFiles("")
    for action in ("save", "restore"):
        done = files.run(_task(action, "a.bin"), Engine())
        assert (done.code, done.message) == (
            ErrorCode.SLOT_ACTIONS_UNSUPPORTED, slot_files.NO_SAVE_PATH)
    done = files.run(_task("erase"), Engine())
    assert (done.code, done.n_tokens) == ("", 7) and Engine.slot_reuse.cleared
    done = SlotFiles(str(tmp_path)).run(_task("erase"), _NoSlotEngine())
    assert (done.code, done.message) == (ErrorCode.SLOT_ACTIONS_UNSUPPORTED,
                                         slot_files.NOT_SUPPORTED)


def test_an_uncreatable_save_path_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(slot_files.ConfigError, match="--slot-save-path"):
        SlotFiles(str(blocker / "slots"))


def test_a_runner_without_slot_actions_answers_not_supported():
    link, written = registered_link()
    link._runner = object()  # e.g. a batched worker's slot port
    link.on_message(messages.SlotAction("s", 0, "erase"))
    assert written[-1] == messages.SlotDone(
        "s", "erase", code=ErrorCode.SLOT_ACTIONS_UNSUPPORTED,
        message=slot_files.NOT_SUPPORTED)
    assert link._job is None


def test_a_slot_action_is_the_slots_job_while_it_runs():
    link, written = registered_link()
    submit(link, "gen")
    link.on_message(messages.SlotAction("s", 0, "erase"))
    assert written[-1].code == ErrorCode.WORKER_BUSY  # a job holds the slot
    link, written = registered_link()
    link.on_message(messages.SlotAction("s", 0, "erase"))
    task = link._job
    assert isinstance(task, SlotTask)
    link.on_message(messages.Submit("gen", REQUEST))
    assert written[-1] == messages.Error("gen", ErrorCode.WORKER_BUSY,
                                         "slot busy")
    assert link.forward(Outgoing(task, messages.SlotDone("s", "erase")))
    assert link._job is None  # SLOT_DONE ended it: READY may go out again


def test_up_hands_its_slot_save_path_to_every_worker():
    from llamapool.cli import build_parser
    from llamapool.supervisor import UP_WORKER_FLAGS
    from protocol.settings import as_argv, given_flags, load
    from workers.model.settings import WorkerSettings

    args = build_parser().parse_args(["up", "--slot-save-path", "/srv/slots"])
    argv = as_argv(WorkerSettings, given_flags(args, WorkerSettings,
                                               UP_WORKER_FLAGS))
    assert argv[argv.index("--slot-save-path") + 1] == "/srv/slots"
    settings = load(WorkerSettings, {"LLAMAPOOL_BROKER": "ipc:///tmp/x",
                                     "LLAMAPOOL_SLOT_SAVE_PATH": "/srv/s"})
    assert settings.slot_save_path == "/srv/s"
