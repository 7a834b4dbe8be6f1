"""Which vocabulary counts a model's prompts at the door (``frontend.
vocabularies``): ``--model``'s one, or ``--models``' one per table; in
process, no vocabulary loaded (the gates load on first use)."""

from __future__ import annotations

import pytest

from frontend.settings import FrontendSettings
from frontend.vocabularies import Vocabularies
from protocol.payloads import ModelStatus
from protocol.settings import ConfigError

BROKER = "ipc:///tmp/vocabularies-test"


@pytest.fixture
def files(tmp_path):
    paths = {name: tmp_path / f"{name}.gguf" for name in ("alpha", "bravo")}
    for path in paths.values():
        path.write_bytes(b"GGUF")  # never read: a gate loads on first use
    return paths


def models_file(tmp_path, text: str) -> str:
    path = tmp_path / "models.toml"
    path.write_text(text)
    return str(path)


def catalog(*models: ModelStatus) -> dict[str, ModelStatus]:
    return {m.name: m for m in models}


def test_the_models_file_gives_each_model_its_gate(tmp_path, files):
    vocabs = Vocabularies(FrontendSettings(
        broker_endpoint=BROKER, n_ctx=4096, chat_format="chatml",
        models_file=models_file(tmp_path, (
            f'[alpha]\npath = "{files["alpha"]}"\naliases = ["a"]\nctx = 1024\n'
            f'workers = 3\n[bravo]\npath = "{files["bravo"]}"\n'
            'chat_format = "gemma"\n'))))
    pool = catalog(ModelStatus("alpha"), ModelStatus("bravo", aliases=["b"]))
    alpha, bravo = vocabs.gate_for("alpha", pool), vocabs.gate_for("bravo", pool)
    assert alpha.model_path == str(files["alpha"]) and alpha.n_ctx == 1024
    assert alpha.chat_format == "chatml"  # the frontend's own, as a worker's
    assert bravo.model_path == str(files["bravo"]) and bravo.n_ctx == 4096
    assert bravo.chat_format == "gemma"
    # A model the file does not name has no gate: its worker counts.
    assert vocabs.gate_for("charlie", catalog(*pool.values(),
                                              ModelStatus("charlie"))) is None
    # The pool's alias of a model finds the table too.
    renamed = catalog(ModelStatus("alpha-v2", aliases=["a"]), ModelStatus("bravo"))
    assert vocabs.gate_for("alpha-v2", renamed) is alpha


def test_one_model_file_gate_serves_a_pool_of_one(tmp_path, files):
    vocabs = Vocabularies(FrontendSettings(
        broker_endpoint=BROKER, models_file=models_file(
            tmp_path, f'[alpha]\npath = "{files["alpha"]}"\n')))
    assert vocabs.gate_for("tiny.gguf", catalog(ModelStatus("tiny.gguf"))) \
        is vocabs.gates()[0]
    two = catalog(ModelStatus("tiny.gguf"), ModelStatus("other"))
    assert vocabs.gate_for("tiny.gguf", two) is None


def test_the_single_model_gate_counts_for_its_own_model(files):
    vocabs = Vocabularies(FrontendSettings(
        broker_endpoint=BROKER, tokenizer_model=str(files["alpha"]),
        model_name="alpha"))
    one = catalog(ModelStatus("whatever"))
    assert vocabs.gate_for("whatever", one) is vocabs.single  # as it always was
    two = catalog(ModelStatus("alpha"), ModelStatus("bravo", aliases=["b"]))
    assert vocabs.gate_for("alpha", two) is vocabs.single
    assert vocabs.gate_for("bravo", two) is None
    assert not Vocabularies(FrontendSettings(broker_endpoint=BROKER))


@pytest.mark.parametrize("table, words", [
    ('[alpha]\naliases = ["a"]\n', "model 'alpha': no 'path'"),
    ('[alpha]\npath = "/nope.gguf"\n', "model 'alpha': path '/nope.gguf' is not"),
    ('[alpha]\npath = "{alpha}"\nctx = 0\n', "model 'alpha': ctx = 0"),
    ('[alpha]\npath = "{alpha}"\nchat_format = 3\n', "model 'alpha': chat_format"),
    ('[alpha]\npath = "{alpha}"\n[bravo]\npath = "{bravo}"\naliases = ["alpha"]\n',
     "model 'bravo': 'alpha' names two models"),
    ("", "no model tables"),
    ("[alpha\n", "not TOML"),
])
def test_a_mistake_in_the_file_names_the_model(tmp_path, files, table, words):
    path = models_file(tmp_path, table.format(**files))
    with pytest.raises(ConfigError, match=words):
        Vocabularies(FrontendSettings(broker_endpoint=BROKER, models_file=path))


def test_model_and_models_are_refused_together(tmp_path, files):
    with pytest.raises(ConfigError, match="not both"):
        FrontendSettings(broker_endpoint=BROKER, tokenizer_model=str(files["alpha"]),
                         models_file=models_file(tmp_path, ""))
