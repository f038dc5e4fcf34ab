"""Bad inputs through the real command lines, one subprocess each: exit 2, one line naming the flag.

Each case runs ``python -m refspec.eval ...`` as a user would and asserts: exit status 2, exactly
one ``error:`` line on stderr naming the flag (or file) at fault, no traceback, and nothing left
behind (no ``--out`` directory, no rewritten summary). Cases that fail before a model loads must
print nothing else; they exit before torch is imported, so each takes a fraction of a second.
Cases that need the model (corrupt checkpoints, context limits) may log before the error line.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HUGE = str(2**64)
# (id, argv after ``python -m refspec.eval``, text the error line must hold, loads the model)
# ``{model}``, ``{prompts}``, ``{file}``, ``{dir}`` ... are filled from the ``inputs`` fixture;
# run/sweep/roofline cases get ``--out {out}`` appended, which must not exist afterwards.
RUN = ["--model", "{model}", "--corpus", "{prompts}", "--no-progress", "--no-warmup"]
LOADS = [*RUN, "--meter", "time"]  # the time meter needs no bandwidth measurement before the model loads
CASES: list[tuple[str, list[str], str, bool]] = [
    ("temperature-nan", [*RUN, "--temperature", "nan"], "--temperature", False),
    ("temperature-negative", [*RUN, "--temperature", "-1"], "--temperature", False),
    ("top-p-zero", [*RUN, "--top-p", "0"], "--top-p", False),
    ("top-p-above-one", [*RUN, "--top-p", "1.5"], "--top-p", False),
    ("top-k-negative", [*RUN, "--top-k", "-1"], "--top-k", False),
    ("seed-2-64", [*RUN, "--seed", HUGE], "--seed", False),
    ("seed-negative", [*RUN, "--seed", "-1"], "--seed", False),
    ("latency-nan", [*RUN, "--latency-target", "nan"], "--latency-target", False),
    ("latency-negative", [*RUN, "--latency-target", "-0.5"], "--latency-target", False),
    ("latency-inf", [*RUN, "--latency-target", "inf"], "--latency-target", False),
    ("num-prompts-zero", [*RUN, "--num-prompts", "0"], "--num-prompts", False),
    ("max-new-tokens-zero", [*RUN, "--max-new-tokens", "0"], "--max-new-tokens", False),
    ("requests-zero", [*RUN, "--requests", "0"], "--requests", False),
    ("requests-negative", ["sweep", *RUN, "--requests", "-3"], "--requests", False),
    ("request-rate-negative", [*RUN, "--request-rate", "-2"], "--request-rate", False),
    ("request-rate-zero", [*RUN, "--request-rate", "0"], "--request-rate", False),
    ("request-rate-nan", [*RUN, "--request-rate", "nan"], "--request-rate", False),
    ("request-rate-with-static", [*RUN, "--request-rate", "2", "--schedule", "static"], "--request-rate", False),
    ("schedule-unknown", [*RUN, "--schedule", "dynamic"], "--schedule", False),
    ("schedule-two-in-run", [*RUN, "--schedule", "static,continuous"], "--schedule", False),
    ("batch-zero", [*RUN, "--batch", "0"], "--batch", False),
    ("k-negative", [*RUN, "--k", "-1"], "--k", False),
    ("k-zero-with-drafter", [*RUN, "--drafter", "ngram", "--k", "0"], "--k 0", False),
    ("k-without-drafter", [*RUN, "--drafter", "none", "--k", "4"], "--k 4", False),
    ("option-unknown", [*RUN, "--drafter-option", "colour=blue"], "--drafter-option 'colour'", False),
    ("option-misspelt", [*RUN, "--drafter-option", "max-n=1"], "--drafter-option 'max-n'", False),
    ("option-no-value", [*RUN, "--drafter-option", "max_n"], "--drafter-option", False),
    ("draft-model-for-ngram", [*RUN, "--draft-model", "self:1"], "--draft-model", False),
    ("meter-unknown", [*RUN, "--meter", "bogus"], "--meter", False),
    ("meter-profile-unknown", [*RUN, "--meter", "roofline:a100"], "--meter", False),
    ("meter-profile-on-time", [*RUN, "--meter", "time:cpu"], "--meter", False),
    ("threads-zero", [*RUN, "--threads", "0"], "--threads", False),
    ("threads-word", [*RUN, "--threads", "many"], "--threads", False),
    ("threads-huge", [*RUN, "--threads", "100000"], "--threads", False),
    ("tree-with-ngram", [*RUN, "--tree"], "--tree", False),
    ("export-with-injection", [*RUN, "--accept-model", "geometric:0.5", "--export-acceptance", "{new}/a.json"],
     "--export-acceptance", False),
    ("inject-without-drafter", [*RUN, "--drafter", "none", "--accept-model", "geometric:0.5"], "--accept-model", False),
    ("out-is-a-file", [*RUN, "--out", "{file}"], "--out", False),
    ("out-under-a-file", [*RUN, "--out", "{file}/sub"], "--out", False),
    ("export-is-a-dir", [*RUN, "--export-acceptance", "{dir}"], "--export-acceptance", False),
    ("batch-not-int", [*RUN, "--batch", "x"], "--batch", False),
    ("unknown-flag", [*RUN, "--bogus-flag"], "--bogus-flag", False),
    ("nothing-to-run", [*RUN, "--drafter", "none", "--no-baseline"], "--no-baseline", False),
    ("corpus-empty", [*RUN, "--corpus", ","], "--corpus", False),
    ("device-garbage", [*RUN, "--device", "toaster"], "--device", False),
    ("dtype-unknown", [*RUN, "--dtype", "int3"], "--dtype", False),
    ("drafter-unknown", [*RUN, "--drafter", "no-such-drafter"], "--drafter", False),
    ("corpus-unknown", [*RUN, "--corpus", "no-such-corpus"], "--corpus", False),
    ("accept-model-missing", [*RUN, "--accept-model", "{new}/acc.json"], "--accept-model", False),
    ("sweep-batch-empty", ["sweep", *RUN, "--batch", ","], "--batch", False),
    ("sweep-batch-zero", ["sweep", *RUN, "--batch", "0,1"], "--batch", False),
    ("sweep-k-negative", ["sweep", *RUN, "--k", "0,-2"], "--k", False),
    ("sweep-slurm-gpus", ["sweep", *RUN, "--slurm-gpus", "-1"], "--slurm-gpus", False),
    ("sweep-task-outside", ["sweep", *RUN, "--task-index", "99"], "--task-index", False),
    ("report-latency-nan", ["report", "{report}", "--latency-target", "nan"], "--latency-target", False),
    ("report-latency-negative", ["report", "{report}", "--latency-target", "-0.5"], "--latency-target", False),
    ("report-ttft-negative", ["report", "{report}", "--ttft-target", "-1"], "--ttft-target", False),
    ("report-ttft-nan", ["report", "{report}", "--ttft-target", "nan"], "--ttft-target", False),
    ("report-ttft-zero", ["report", "{report}", "--ttft-target", "0", "--latency-target", "0.05"], "--ttft-target",
     False),
    ("report-ttft-old-records", ["report", "{report_old}", "--ttft-target", "1"], "--ttft-target", False),
    ("report-not-a-dir", ["report", "{new}"], "report", False),
    ("report-unknown-version", ["report", "{report_v99}"], "record_version", False),
    ("report-missing-fields", ["report", "{report_short}"], "lacks", False),
    ("report-wrong-type", ["report", "{report_wrong_type}"], "tau is 'fast'", False),
    ("generate-temperature-nan", ["generate", "--model", "{model}", "--temperature", "nan"], "--temperature", False),
    ("generate-seed-2-64", ["generate", "--model", "{model}", "--seed", HUGE], "--seed", False),
    ("generate-k-without-drafter", ["generate", "--model", "{model}", "--k", "4"], "--k 4", False),
    ("generate-k-zero", ["generate", "--model", "{model}", "--drafter", "ngram", "--k", "0"], "--k", False),
    ("generate-draft-model-for-ngram", ["generate", "--model", "{model}", "--drafter", "ngram", "--draft-model",
                                        "self:1"], "--draft-model", False),
    ("generate-option-unknown", ["generate", "--model", "{model}", "--drafter", "ngram", "--drafter-option",
                                 "colour=blue"], "--drafter-option 'colour'", False),
    ("generate-budget-zero", ["generate", "--model", "{model}", "--max-new-tokens", "0"], "--max-new-tokens", False),
    ("generate-prompt-not-text", ["generate", "--model", "{model}", "--prompts-file", "{number_prompt}"],
     "--prompts-file", False),
    ("generate-prompts-missing", ["generate", "--model", "{model}", "--prompts-file", "{new}"], "--prompts-file", False),
    ("generate-dtype", ["generate", "--model", "{model}", "--dtype", "int8"], "--dtype", False),
    ("roofline-context", ["roofline", "--context", "-100"], "--context", False),
    ("roofline-dtype-bytes-zero", ["roofline", "--dtype-bytes", "0"], "--dtype-bytes", False),
    ("roofline-dtype-bytes-negative", ["roofline", "--dtype-bytes", "-2"], "--dtype-bytes", False),
    ("roofline-batch-empty", ["roofline", "--batch", ","], "--batch", False),
    ("roofline-batch-zero", ["roofline", "--batch", "0,1"], "--batch", False),
    ("roofline-k-negative", ["roofline", "--k", "-1"], "--k", False),
    ("roofline-fraction-word", ["roofline", "--drafter", "fraction:abc"], "--drafter", False),
    ("roofline-acceptance", ["roofline", "--acceptance", "2"], "--acceptance", False),
    ("roofline-gpu", ["roofline", "--gpu", "a100"], "--gpu", False),
    ("roofline-out-file", ["roofline", "--out", "{file}"], "--out", False),
    ("roofline-out-under-file", ["roofline", "--out", "{file}/x"], "--out", False),
    ("assets-verify-file", ["assets", "verify", "{file}"], "assets verify", False),
    ("assets-convert-missing", ["assets", "convert", "{new}.gguf", "{new}"], "assets convert", False),
    ("truncated-safetensors", [*LOADS, "--model", "{truncated}"], "--model", True),
    ("garbage-safetensors", [*LOADS, "--model", "{garbage}"], "--model", True),
    ("index-without-weight-map", [*LOADS, "--model", "{no_weight_map}"], "--model", True),
    ("generate-truncated", ["generate", "--model", "{truncated}", "--prompt", "w3 w4"], "--model", True),
    ("generate-budget-beyond-context", ["generate", "--model", "{model}", "--prompt", "w3 w4", "--max-new-tokens",
                                        "100000"], "--max-new-tokens 100000", True),
    ("generate-shape-mismatch", ["generate", "--model", "{wrong_shape}", "--prompt", "w3 w4"], "wrong shape", True),
    ("corpus-prompt-not-text", [*LOADS, "--corpus", "{number_prompt}"], "--corpus", True),
    ("corpus-not-json", [*LOADS, "--corpus", "{garbage_jsonl}"], "--corpus", True),
    ("budget-beyond-context", [*LOADS, "--max-new-tokens", "100000"], "--max-new-tokens 100000", True),
    ("sweep-k-beyond-context", ["sweep", *LOADS, "--max-new-tokens", "4", "--k", "0,2,9000", "--batch", "1"],
     "--max-new-tokens 4 (--k 9000", True),
    # outputs: one check for every output flag (empty, an input, the command's own file, a link, a FIFO)
    ("out-empty", [*RUN, "--out", ""], "--out", False),
    ("per-request-is-records", [*RUN, "--per-request-metrics", "{out}/records.jsonl"], "--per-request-metrics", False),
    ("per-request-is-ledger", [*RUN, "--per-request-metrics", "{out}/ledger.jsonl"], "--per-request-metrics", False),
    ("per-request-is-corpus", [*RUN, "--per-request-metrics", "{prompts}"], "--per-request-metrics", False),
    ("per-request-symlink", [*RUN, "--per-request-metrics", "{link}"], "--per-request-metrics", False),
    ("per-request-fifo", [*RUN, "--per-request-metrics", "{fifo}"], "--per-request-metrics", False),
    ("per-request-empty", [*RUN, "--per-request-metrics", ""], "--per-request-metrics", False),
    ("export-empty", [*RUN, "--export-acceptance", ""], "--export-acceptance", False),
    ("export-over-another-file", [*RUN, "--export-acceptance", "{file}"], "--export-acceptance", False),
    ("export-is-corpus", [*RUN, "--export-acceptance", "{prompts}"], "--export-acceptance", False),
    # numbers and combinations, before any work
    ("spec-policy-without-drafter", [*RUN, "--drafter", "none", "--spec-policy", "off-above:2"], "--spec-policy",
     False),
    ("meter-profile-cpu-bogus", [*RUN, "--meter", "roofline:cpu-bogus"], "--meter", False),
    ("meter-period-huge", [*RUN, "--meter", "simulated:period_ms=1e308"], "--meter", False),
    ("meter-period-tiny", [*RUN, "--meter", "simulated:period_ms=1e-300"], "--meter", False),
    ("meter-noise-huge", [*RUN, "--meter", "simulated:noise=1e6"], "--meter", False),
    ("batch-huge", [*RUN, "--batch", "100000", "--requests", "2"], "--batch", False),
    ("batch-beyond-requests", [*RUN, "--batch", "8", "--requests", "2"], "--batch 8", False),
    ("sweep-batch-huge", ["sweep", *RUN, "--batch", "1,100000"], "--batch", False),
    ("corpus-lone-surrogate", [*LOADS, "--corpus", "{surrogate}"], "line 1", True),
    ("corpus-not-utf8", [*LOADS, "--corpus", "{not_utf8}"], "line 2", True),
    ("generate-lone-surrogate", ["generate", "--model", "{model}", "--prompts-file", "{surrogate}"], "line 1", False),
    ("generate-not-utf8", ["generate", "--model", "{model}", "--prompts-file", "{not_utf8}"], "line 2", False),
    # paper
    ("paper-min-window-nan", ["paper", "--plan-only", "--min-window-s", "nan"], "--min-window-s", False),
    ("paper-min-window-negative", ["paper", "--plan-only", "--min-window-s", "-5"], "--min-window-s", False),
    ("paper-budget-negative", ["paper", "--plan-only", "--budget-s", "-1"], "--budget-s", False),
    ("paper-prompt-len-huge", ["paper", "--plan-only", "--prompt-len", "100000000"], "--prompt-len", False),
    ("paper-threads-zero", ["paper", "--plan-only", "--threads", "0"], "--threads", False),
    ("paper-blocks-empty", ["paper", "--plan-only", "--blocks", ","], "--blocks", False),
    ("paper-repeats-zero", ["paper", "--plan-only", "--repeats", "0"], "--repeats", False),
    ("paper-out-empty", ["paper", "--out", ""], "--out", False),
    ("paper-out-is-a-file", ["paper", "--quick", "--out", "{file}"], "--out", False),
    ("paper-out-finished", ["paper", "--quick", "--out", "{paper_done}"], "earlier paper run", False),
    ("paper-unknown-flag", ["paper", "--bogus"], "--bogus", False),
    # the other commands: unknown flags are one line, outputs are checked
    ("calibrate-unknown-flag", ["calibrate", "--bogus"], "--bogus", False),
    ("bench-unknown-flag", ["bench", "decode", "--bogus"], "--bogus", False),
    ("bench-no-subcommand", ["bench"], "bench", False),
    ("bench-plot-empty", ["bench", "roofline", "--plot", ""], "--plot", False),
    ("bench-plot-under-a-file", ["bench", "roofline", "--plot", "{file}/x.png"], "--plot", False),
    ("bench-plot-fifo", ["bench", "roofline", "--plot", "{fifo}"], "--plot", False),
    ("bench-batch-huge", ["bench", "decode", "--model", "{model}", "--batch", "100000"], "--batch", False),
    ("bench-batch-empty", ["bench", "decode", "--model", "{model}", "--batch", ","], "--batch", False),
    ("bench-new-tokens-zero", ["bench", "decode", "--model", "{model}", "--new-tokens", "0"], "--new-tokens", False),
    ("bench-spec-k-zero", ["bench", "spec", "--model", "{model}", "--k", "0"], "--k", False),
    ("bench-corpus-surrogate", ["bench", "spec", "--model", "{model}", "--corpus-file", "{surrogate}", "--batch",
                                "1", "--dtype", "fp32"], "line 1", True),
    ("per-request-under-a-file", [*RUN, "--per-request-metrics", "{file}/x.jsonl"], "--per-request-metrics", False),
    ("train-unknown-flag", ["train", "--drafter", "eagle", "--bogus"], "--bogus", False),
    ("train-out-empty", ["train", "--drafter", "eagle", "--out", ""], "--out", False),
    ("train-steps-zero", ["train", "--drafter", "eagle", "--steps", "0"], "--steps", False),
    ("train-lr-nan", ["train", "--drafter", "eagle", "--lr", "nan"], "--lr", False),
    ("train-out-is-a-file", ["train", "--drafter", "eagle", "--out", "{file}"], "--out", False),
    ("train-data-cache-fifo", ["train", "--drafter", "eagle", "--data-cache", "{fifo}"], "--data-cache", False),
    ("dvfs-unknown-flag", ["dvfs", "--bogus"], "--bogus", False),
    ("roofline-out-empty", ["roofline", "--out", ""], "--out", False),
    ("assets-fetch-unknown", ["assets", "fetch", "no-such-model"], "no-such-model", False),
    ("assets-path-unknown", ["assets", "path", "no-such-model"], "no-such-model", False),
    ("assets-convert-out-file", ["assets", "convert", "{file}", "{file}"], "assets convert", False),
]
OWN_OUT = ("report", "generate", "assets", "paper", "bench", "calibrate", "train", "dvfs")
"""Commands that get no ``--out {out}`` appended (they take none, or the case names it)."""


def _write_model_copy(src: Path, dst: Path, weights: bytes | None, index: dict | None = None,
                      config: dict | None = None) -> Path:
    dst.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (dst / name).write_bytes((src / name).read_bytes())
    if config is not None:
        (dst / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()), **config}))
    if weights is not None:
        (dst / "model.safetensors").write_bytes(weights)
    if index is not None:
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def _report_dir(root: Path, name: str, record: dict) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "records.jsonl").write_text(json.dumps(record) + "\n")
    return folder


@pytest.fixture(scope="session")
def inputs(tmp_path_factory) -> dict[str, str]:
    """A tiny random llama with a tokenizer, made once, and the broken files the cases point at."""
    from tiny import save_hf, save_tokenizer

    root = tmp_path_factory.mktemp("bad_inputs")
    model = root / "model"
    model.mkdir()
    save_hf("llama", model)
    save_tokenizer(model)
    weights = (model / "model.safetensors").read_bytes()
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "w3 w4 w5 w6 w7 w8", "kind": "code"}) + "\n" for _ in range(2)))
    (root / "file.txt").write_text("a regular file\n")
    (root / "emptydir").mkdir()
    (root / "number_prompt.jsonl").write_text(json.dumps({"prompt": 5}) + "\n")
    (root / "garbage.jsonl").write_text("not json at all\n")
    record = {"record_version": 2, "status": "ok", "config_id": "none-k0-b1-x-0"}
    (root / "link").symlink_to(root / "file.txt")
    os.mkfifo(root / "fifo")
    (root / "surrogate.jsonl").write_text('{"prompt": "w3 w4 \\ud800 w5"}\n')
    (root / "not_utf8.jsonl").write_bytes(b'{"prompt": "w3 w4"}\n{"prompt": "w3 \xff w4"}\n')
    (root / "paper_done").mkdir()
    (root / "paper_done" / "claims.md").write_text("# claims of an earlier run\n")
    return {
        "link": str(root / "link"), "fifo": str(root / "fifo"), "surrogate": str(root / "surrogate.jsonl"),
        "not_utf8": str(root / "not_utf8.jsonl"), "paper_done": str(root / "paper_done"),
        "model": str(model), "prompts": str(prompts), "file": str(root / "file.txt"), "dir": str(root / "emptydir"),
        "number_prompt": str(root / "number_prompt.jsonl"), "garbage_jsonl": str(root / "garbage.jsonl"),
        "truncated": str(_write_model_copy(model, root / "truncated", weights[: len(weights) // 2])),
        "garbage": str(_write_model_copy(model, root / "garbage", b"garbage!" * 64)),
        "no_weight_map": str(_write_model_copy(model, root / "no_weight_map", None, {"metadata": {}})),
        "wrong_shape": str(_write_model_copy(model, root / "wrong_shape", weights, config={"intermediate_size": 256})),
        "report": str(_report_dir(root, "report", record)),
        "report_v99": str(_report_dir(root, "report_v99", {**record, "record_version": 99})),
        "report_short": str(_report_dir(root, "report_short", record)),
        "report_wrong_type": str(_report_dir(root, "report_wrong_type", {
            **record, "drafter": "none", "k": 0, "batch": 1, "corpus": "x", "model": "m", "tau": "fast"})),
        "report_old": str(_report_dir(root, "report_old", {  # a complete static record from before serving windows
            **record, "drafter": "none", "k": 0, "batch": 1, "corpus": "x", "model": "m", "tau": None,
            "energy_per_token_j": 0.1, "tpot_p99_s": 0.01, "baseline_config_id": record["config_id"],
            "energy_source": "modelled:roofline(cpu)"})),
    }


def _argv(case: list[str], inputs: dict[str, str], out: Path, new: Path) -> list[str]:
    argv = [a.format(**inputs, out=out, new=new) for a in case]
    if argv[0] not in OWN_OUT and "--out" not in case:
        argv += ["--out", str(out)]
    return argv


def _snapshot(inputs: dict[str, str]) -> dict[str, Any]:
    """What the shared inputs hold (a folder's names, a file's kind, size and mtime), to show a case left them be."""
    def state(path: str) -> Any:
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode):
            return sorted(os.listdir(path))
        return (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns)
    return {k: state(v) for k, v in inputs.items()}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(case, inputs, tmp_path):
    name, template, needle, loads = case
    out, new = tmp_path / "out", tmp_path / "new"
    before = _snapshot(inputs)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "REFSPEC_HOME": str(tmp_path / "home")}
    proc = subprocess.run([sys.executable, "-m", "refspec.eval", *_argv(template, inputs, out, new)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    lines = [ln for ln in proc.stderr.split("\n") if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert proc.returncode == 2, f"{name}: exit {proc.returncode}, stderr: {proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr, f"{name}: a traceback reached the user"
    assert len(errors) == 1 and needle in errors[0], f"{name}: expected one error line with {needle!r}: {lines}"
    if not loads:
        assert lines == errors, f"{name}: a failure before the model loads prints only its line: {lines}"
    assert not out.exists() and not new.exists(), f"{name}: left {out} or {new} behind"
    assert _snapshot(inputs) == before, f"{name}: wrote into the shared inputs"


def test_zeus_without_a_gpu_suggests_the_roofline_meter(inputs, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # no GPU, even on a machine with one
    proc = subprocess.run([sys.executable, "-m", "refspec.eval", *_argv([*RUN, "--meter", "zeus"], inputs,
                                                                         tmp_path / "out", tmp_path / "new")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--meter roofline" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_the_table_covers_every_command_and_at_least_135_inputs():
    from refspec.eval.cli_args import TOOLS

    commands = {c[1][0] if not c[1][0].startswith("-") else "run" for c in CASES}
    assert commands == {"run", "sweep", "report", *TOOLS}
    assert len(CASES) >= 135 and len({c[0] for c in CASES}) == len(CASES)


def test_ctrl_c_while_generate_imports_is_one_line_and_130(inputs, tmp_path):
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "refspec.eval", "generate", "--model", inputs["model"],
                             "--prompt", "w3 w4", "--max-new-tokens", "480"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # even under nohup &
    # past the flag checks, while torch imports or the model loads; a valid budget (within the
    # tiny model's 512 positions) so that a quick start lands the interrupt in decoding instead
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    lines = [ln for ln in err.split("\n") if ln.strip() and not ln.startswith(("INFO", "WARNING"))]
    assert proc.returncode == 130 and lines == ["interrupted"], (proc.returncode, err[-2000:])


def test_the_option_table_matches_what_each_built_in_drafter_reads():
    import re

    from refspec.eval.cli_checks import BUILTIN_OPTIONS

    root = Path(__file__).resolve().parents[1] / "drafters"
    files = {"ngram": "ngram.py", "draft-model": "draft_model.py", "eagle": "eagle.py", "eagle3": "eagle.py",
             "block": "block.py"}
    for drafter, name in files.items():
        source = (root / name).read_text()
        read = set(re.findall(r'opt(?:ion)?s(?:\.get\(|\[)"(\w+)"', source))
        assert read == set(BUILTIN_OPTIONS[drafter]), f"{drafter} reads {sorted(read)}; update BUILTIN_OPTIONS"
