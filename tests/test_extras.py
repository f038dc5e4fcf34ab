"""Optional dependencies fail with one line naming the pip extra, not a bare ModuleNotFoundError."""
import sys

import pytest

from refspec.extras import MissingExtraError, require


def test_missing_package_names_its_extra(monkeypatch):
    for name in ("gguf", "gguf.quants"):  # None in sys.modules makes the import fail, cached or not
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(MissingExtraError, match=r'converting a GGUF model needs the .gguf. package: '
                                                r'pip install "refspec\[assets\]"'):
        require("gguf.quants", "assets", "converting a GGUF model")


def test_present_package_is_returned():
    assert require("json", "none", "parsing").dumps([1]) == "[1]"


def test_broken_dependency_of_a_present_package_is_not_masked(tmp_path, monkeypatch):
    pkg = tmp_path / "brokenpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import no_such_module_inside\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="no_such_module_inside"):
        require("brokenpkg", "x", "y")


def test_corpus_loading_without_datasets_says_which_extra(monkeypatch):
    from refspec.eval.corpora import catalog

    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(MissingExtraError, match=r'refspec\[corpora\]'):
        catalog._to_dataset([])


def test_cli_turns_it_into_one_line(monkeypatch, tmp_path, capsys):
    from refspec.eval import assets_cli

    for name in ("gguf", "gguf.quants"):
        monkeypatch.setitem(sys.modules, name, None)
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"GGUF")
    out = tmp_path / "out"
    from refspec.eval.cli import main

    assert main(["assets", "convert", str(fake), str(out)]) == 2
    assert not out.exists()  # nothing half-written
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and 'pip install "refspec[assets]"' in err[0], err
