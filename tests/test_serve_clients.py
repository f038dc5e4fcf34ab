"""``python -m refspec.serve`` as a process, driven by a real benchmark client on loopback: GuideLLM
runs a short fixed-rate benchmark (six requests at 8/s, eight prompt and eight output tokens) and its
results are read back and compared with the session's record, request by request; then SIGTERM
arrives while a stream is running: the server admits nothing more, lets the stream finish, ends
the ledger run, writes the record and exits 0. Bounded: six requests, a few minutes at most."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from test_serve import SERVER_FLAGS, model_dir, prompt_words  # noqa: F401  (fixture)

RATE, REQUESTS, OUTPUT = 8, 6, 8
GUIDELLM_ENV = {"GUIDELLM__MAX_WORKER_PROCESSES": "1", "OMP_NUM_THREADS": "1",
                # its workers are up (a barrier) before the start delay counts; its 1 s default only waits
                "GUIDELLM__SCHEDULER_START_DELAY_NON_DISTRIBUTED": "0.1", "GUIDELLM__MP_POLL_INTERVAL": "0.02"}


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):  # noqa: F811
    """The server process, its URL and its --out directory."""
    root = tmp_path_factory.mktemp("served")
    log = root / "server.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "refspec.serve", "--model", str(model_dir), "--out",
                                 str(root / "out"), *SERVER_FLAGS, "--threads", "1", "--shutdown-timeout", "20"],
                                stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=root)
    url = None
    deadline = time.monotonic() + 240
    while url is None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
        url = next(iter(re.findall(r"listening on (http://\S+)", log.read_text())), None)
    if url is None:
        proc.kill()
        pytest.fail(f"the server did not start: {log.read_text()[-2000:]}")
    yield proc, url, root
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _record(root: Path) -> dict:
    return json.loads((root / "out" / "records.jsonl").read_text().splitlines()[-1])


def test_guidellm_at_a_fixed_rate(served, model_dir):  # noqa: F811
    proc, url, root = served
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": prompt_words(i, 8), "output_tokens_count": OUTPUT}) + "\n"
                            for i in range(REQUESTS)))
    out = root / "guidellm.json"
    env = {**os.environ, **GUIDELLM_ENV}
    r = subprocess.run([sys.executable, "-m", "guidellm", "run",
                        "--backend", f"kind=openai_http,target={url},model=model,request_format=/v1/completions",
                        "--profile", f"kind=constant,rate={RATE}",
                        "--constraint", f"kind=max_requests,count={REQUESTS}",
                        "--data", f"kind=json_file,path={data}",
                        "--tokenizer", f"kind=huggingface_auto,model={model_dir}",
                        "--output", f"kind=json,path={out}", "--disable-console-interactive"],
                       capture_output=True, text=True, env=env, cwd=root, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    bench = json.loads(out.read_text())["benchmarks"][0]
    done = bench["requests"]["successful"]
    assert len(done) == REQUESTS and not bench["requests"]["errored"]
    for q in done:
        assert q["output_metrics"]["text_tokens"] == OUTPUT, "ignore_eos: each request runs to its budget"
        spec = q["response_metrics"]["speculative_decoding"]
        assert spec["num_spec_tokens"] == 3, "GuideLLM keeps the server's per-request acceptance"
    (root / "guidellm_ids.json").write_text(json.dumps(
        {int(q["response_id"].rsplit("-", 1)[1]): q["output_metrics"]["text_tokens"] for q in done}))


def _stops_admitting(url: str, timeout_s: float) -> bool:
    """Whether ``/health`` says the server admits nothing more (or the listener is closed) within ``timeout_s``."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if not httpx.get(f"{url}/health", timeout=5).json()["admitting"]:
                return True
        except httpx.TransportError:
            return True  # the listener is closed
        time.sleep(0.01)
    return False


def test_sigterm_finishes_the_running_stream_writes_the_ledger_and_exits_0(served):
    import httpx

    proc, url, root = served
    chunks: list[str] = []
    started = threading.Event()

    def stream() -> None:
        body = {"model": "model", "prompt": prompt_words(9), "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=url, timeout=120) as c, c.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                chunks.append(line)
                started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60), "the stream must start"
    proc.send_signal(signal.SIGTERM)
    assert _stops_admitting(url, timeout_s=30), "the server must stop admitting once SIGTERM arrives"
    try:
        late = httpx.post(f"{url}/v1/completions", json={"model": "model", "prompt": "w3", "max_tokens": 2},
                          timeout=10).status_code
    except httpx.TransportError:
        late = None  # the listener is closed: refused
    assert late in (None, 503), "after SIGTERM no new request may be admitted"
    t.join(120)
    assert proc.wait(120) == 0, (root / "server.log").read_text()[-2000:]
    assert [c for c in chunks if c][-1] == "data: [DONE]", "the running stream finishes within the shutdown timeout"
    from refspec.energy.ledger.read import read_ledger
    from refspec.serve.session import FINISH_REASONS

    ledger = read_ledger(root / "out" / "ledger.jsonl")
    assert [r["status"] for r in ledger if r.get("kind") == "end"] == ["complete"]
    record = _record(root)
    reasons = json.loads((root / "out" / FINISH_REASONS).read_text())["finish_reasons"]
    outputs = {o["id"]: o for o in record["request_outputs"]}
    ids = Path(root / "guidellm_ids.json")
    if ids.exists():  # the benchmark client's requests, one by one, against the server's own record
        theirs = {int(k): v for k, v in json.loads(ids.read_text()).items()}
        assert {k: outputs[k]["output_tokens"] for k in theirs} == theirs
        assert len(outputs) == len(theirs) + 1, "GuideLLM's requests and the stream, nothing else"
    last = outputs[max(outputs)]
    assert reasons[str(last["id"])] == "length" and last["output_tokens"] == 200
