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


def test_under_torchrun_a_bad_flag_fails_before_the_process_group_forms(tiny, tmp_path):  # noqa: F811
    """Rank 0 of a 2-rank launch whose rank 1 never comes: a refused flag must not wait for it to join."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
           "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    base = ["--model", str(tiny["model"]), "--corpus", str(tiny["prompts"]), *QUIET, "--tp", "2"]
    for extra, needle in ((["--compile"], "--compile"), (["--temperature", "nan"], "--temperature")):
        proc = subprocess.run([sys.executable, "-m", "refspec.eval", *base, *extra, "--out", str(tmp_path / "o")],
                              capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr[-2000:]
        assert not (tmp_path / "o").exists()


def test_paper_require_measured_energy_exits_3_on_modelled_energy(tmp_path):
    """On a CPU every paper figure is modelled: --require-measured-energy stops before the grid with status 3."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "refspec.eval", "paper", "--quick", "--device", "cpu",
                           "--require-measured-energy", "--out", str(tmp_path / "p")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 3 and len(errors) == 1 and "modelled" in errors[0], proc.stderr[-2000:]
    assert not (tmp_path / "p").exists()
