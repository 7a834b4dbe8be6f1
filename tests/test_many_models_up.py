"""``llamapool up --models FILE`` (issue 30, item 5): several models on one
machine, each with its own worker count and settings; a mistake in the
file exits 2 with a message naming the model, before anything starts."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys

import httpx
import pytest

from tests.pool import free_port, wait_until
from tests.test_many_models import model_files  # noqa: F401 (module fixture)

pytestmark = pytest.mark.stack


def up(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "llamapool", "up", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, **kw)


def test_up_runs_each_model_of_the_file(model_files, tmp_path):  # noqa: F811
    models = tmp_path / "models.toml"
    models.write_text(
        f'[alpha]\npath = "{model_files["alpha"]}"\naliases = ["a"]\n'
        f'workers = 2\nctx = 1024\nthreads = 1\ncache_ram = 0\n\n'
        f'[bravo]\npath = "{model_files["bravo"]}"\nworkers = 1\nctx = 2048\n'
        f'threads = 1\ndefault = true\n')
    port = free_port()
    proc = up("--models", str(models), "--port", str(port),
              "--heartbeat-interval-s", "0.2")
    url = f"http://127.0.0.1:{port}"
    try:
        def listed():
            with contextlib.suppress(httpx.HTTPError):
                data = httpx.get(url + "/v1/models", timeout=2).json()["data"]
                by_id = {m["id"]: m for m in data}
                if {"alpha", "bravo"} <= set(by_id) and all(
                        m["meta"]["slots_loading"] == 0 for m in data):
                    return by_id
            return None
        by_id = wait_until(listed, 90, "both models to be listed")
        assert by_id["alpha"]["meta"]["slots_total"] == 2
        assert by_id["alpha"]["meta"]["n_ctx"] == 1024
        assert by_id["alpha"]["aliases"] == ["a"]
        assert by_id["bravo"]["meta"]["slots_total"] == 1
        assert by_id["bravo"]["meta"]["n_ctx"] == 2048
        for asked, name in (("a", "alpha"), ("bravo", "bravo"), (None, "bravo")):
            body = {"prompt": "Hi", "max_tokens": 2}
            if asked:
                body["model"] = asked
            resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert resp.status_code == 200, resp.text
            assert resp.json()["model"] == name
        # The frontend has the file too: each model's own vocabulary (only
        # bravo's has the FIM tokens).
        for asked, n_tokens in (("bravo", 1), ("a", None)):
            resp = httpx.post(url + "/tokenize", timeout=60, json={
                "content": "<|fim_prefix|>", "model": asked})
            assert resp.status_code == 200, resp.text
            got = len(resp.json()["tokens"])
            assert got == n_tokens if n_tokens else got > 1, (asked, got)
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    assert b"models alpha, bravo" in output, output.decode(errors="replace")[-3000:]


@pytest.mark.parametrize("table, words", [
    ('[alpha]\npath = "{alpha}"\nworkers = 0\n', "model 'alpha': workers = 0"),
    ('[alpha]\npath = "{alpha}"\ncolour = "red"\n',
     "model 'alpha': unknown key 'colour'"),
    ('[alpha]\npath = "/nope.gguf"\n',
     "model 'alpha': path '/nope.gguf' is not a file"),
    ('[alpha]\npath = "{alpha}"\nctx = 0\n', "model 'alpha': ctx = 0"),
    ('[alpha]\npath = "{alpha}"\nrepack = "maybe"\n',
     "model 'alpha': repack = 'maybe'"),
    ('[alpha]\npath = "{alpha}"\n[bravo]\npath = "{alpha}"\naliases = ["alpha"]\n',
     "model 'bravo': 'alpha' already names model 'alpha'"),
])
def test_a_mistake_in_the_file_exits_2_naming_the_model(model_files, tmp_path,  # noqa: F811
                                                         table, words):
    models = tmp_path / "models.toml"
    models.write_text(table.format(alpha=model_files["alpha"]))
    proc = up("--models", str(models), "--port", str(free_port()))
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, output.decode(errors="replace")
    assert words in output.decode(), output.decode()
