"""One JSON reader at the boundaries: a missing, unreadable or invalid file raises the caller's
typed error naming the file (config.json, an asset's manifest, an acceptance model file,
tokenizer_config.json)."""
from __future__ import annotations

import pytest

from refspec.assets import store
from refspec.assets.registry import AssetError
from refspec.assets.tokenizer import TokenizerError, load_tokenizer
from refspec.config import ConfigError, ModelArgs, read_json
from refspec.eval.acceptance_models import AcceptanceModelError
from refspec.eval.injection import load_acceptance_models

NOT_TEXT = b"\xff\xfe{"  # not UTF-8: json never sees it


def test_read_json_returns_the_document(tmp_path):
    (tmp_path / "a.json").write_text('{"x": [1, 2]}')
    assert read_json(tmp_path / "a.json", ConfigError, missing="none") == {"x": [1, 2]}


@pytest.mark.parametrize("content, words", [(None, "absent here"), (b"{", "is not valid JSON"),
                                            (NOT_TEXT, "is not valid JSON"), ("dir", "cannot be read")])
def test_read_json_raises_the_callers_error_naming_the_file(tmp_path, content, words):
    path = tmp_path / "a.json"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError, match=words) as exc:
        read_json(path, ConfigError, missing=f"absent here: {path}", fix="write it again")
    assert str(path) in str(exc.value)
    assert content is None or str(exc.value).endswith("; write it again")


def test_every_boundary_reader_types_a_file_that_is_not_text(tmp_path):
    for name in ("config.json", "asset.json", "acc.json"):
        (tmp_path / name).write_bytes(NOT_TEXT)
    with pytest.raises(ConfigError, match="config.json is not valid JSON"):
        ModelArgs.from_file(tmp_path)
    with pytest.raises(AssetError, match="asset.json is not valid JSON.*; convert it again"):
        store.verify_model_dir(tmp_path)
    with pytest.raises(AcceptanceModelError, match="acc.json is not valid JSON"):
        load_acceptance_models(tmp_path / "acc.json")


def test_the_tokenizer_config_is_read_the_same_way(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_bytes(NOT_TEXT)
    with pytest.raises(TokenizerError, match="tokenizer_config.json is not valid JSON"):
        load_tokenizer(tmp_path)
