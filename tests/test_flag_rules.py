"""Flag rules that need a loaded model: a batch's KV cache is checked against free memory before any run."""
from __future__ import annotations

from refspec.eval import cli
from test_eval_cli import QUIET, one_thread, tiny  # noqa: F401  (fixtures)


def test_a_batch_whose_kv_cache_exceeds_free_memory_is_refused(tiny, tmp_path, monkeypatch, capsys):  # noqa: F811
    import refspec.eval.run as run_mod

    monkeypatch.setattr(run_mod, "_free_bytes", lambda device: 64 << 10)  # 64 KiB free: less than one row's cache
    out = tmp_path / "out"
    argv = ["--model", str(tiny["model"]), "--corpus", str(tiny["prompts"]), "--max-new-tokens", "6", "--batch", "4",
            "--meter", "time", *QUIET, "--out", str(out)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "--batch 4" in err and "GiB free" in err and not out.exists(), err


def test_the_kv_estimate_admits_an_ordinary_batch(tiny, tmp_path):  # noqa: F811
    argv = ["--model", str(tiny["model"]), "--corpus", str(tiny["prompts"]), "--max-new-tokens", "4", "--batch", "2",
            "--drafter", "none", "--meter", "time", *QUIET, "--out", str(tmp_path / "out")]
    assert cli.main(argv) == 0
