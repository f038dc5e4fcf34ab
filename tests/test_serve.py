"""``python -m refspec.serve`` in-process on a tiny random llama (fp32, loopback only): the openai
client plain and streaming, greedy output equal to ``python -m refspec.eval generate``, energy and
acceptance in every response equal to what the session's record charges each request, the
OpenAI error bodies of bad requests (the server keeps serving), no request reading another's
output, ``/metrics``, ``/v1/energy``, and ``python -m refspec.eval report`` on the session.
What a server must survive under load (queue limit, a client leaving mid-stream) is
``tests/test_serve_survive.py``; the real clients in a subprocess are ``tests/test_serve_clients.py``."""
from __future__ import annotations

import concurrent.futures
import json
import re
from pathlib import Path

import pytest
import torch

BAD = [  # (what, body, status, param): every one answered with an OpenAI error body
    ("unknown field", {"prompt": "w3", "foo": 1}, 400, "foo"),
    ("max_tokens a string", {"prompt": "w3", "max_tokens": "ten"}, 400, "max_tokens"),
    ("max_tokens 0", {"prompt": "w3", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens huge", {"prompt": "w3", "max_tokens": 10**9}, 400, "max_tokens"),
    ("max_tokens a boolean", {"prompt": "w3", "max_tokens": True}, 400, "max_tokens"),
    ("prompt a number", {"prompt": 5}, 400, "prompt"),
    ("two prompts", {"prompt": ["w3", "w4"]}, 400, "prompt"),
    ("token id beyond the vocabulary", {"prompt": [3, 4, 999]}, 400, "prompt"),
    ("a prompt of no token", {"prompt": "   "}, 400, "prompt"),
    ("prompt beyond the context", {"prompt": " ".join(["w5"] * 300)}, 400, "prompt"),
    ("temperature a string", {"prompt": "w3", "temperature": "hot"}, 400, "temperature"),
    ("another temperature", {"prompt": "w3", "temperature": 0.7}, 400, "temperature"),
    ("n 2", {"prompt": "w3", "n": 2}, 400, "n"),
    ("stream a string", {"prompt": "w3", "stream": "yes"}, 400, "stream"),
    ("logprobs", {"prompt": "w3", "logprobs": 3}, 400, "logprobs"),
    ("unknown model", {"prompt": "w3", "model": "gpt-4"}, 404, "model"),
]


# ---- the model, the tokenizer, the server -------------------------------------------------------
def tiny_model_dir(root: Path) -> Path:
    from tiny import save_hf, save_tokenizer

    model = root / "model"
    model.mkdir()
    save_hf("llama", model)
    save_tokenizer(model)
    return model


def prompt_words(i: int, n: int = 10) -> str:
    return " ".join(f"w{4 + (j * (i + 2)) % 40}" for j in range(n))


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread, restored afterwards: the tiny model's products are too small to share."""
    before = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("serve_model"))


SERVER_FLAGS = ["--port", "0", "--batch", "2", "--no-warmup", "--max-len", "256", "--max-new-tokens", "8",
                "--dtype", "fp32", "--drafter", "ngram", "--k", "3", "--meter", "roofline:h100"]


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory, one_thread):
    from refspec.serve.cli import start

    out = tmp_path_factory.mktemp("serve_out")
    srv = start(["--model", str(model_dir), "--out", str(out), *SERVER_FLAGS])
    yield srv
    if srv.record is None and srv.uvicorn.started and not srv.uvicorn.should_exit:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    import httpx

    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _name(server) -> str:
    return server.app.config.model_name


# ---- the openai client ------------------------------------------------------------------------
def test_models_and_health(http, server):
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [_name(server)] and models["object"] == "list"
    assert http.get("/health").json() == {"status": "ok", "admitting": True}


def test_a_completion_carries_usage_energy_and_acceptance(client, server):
    r = client.completions.create(model=_name(server), prompt=prompt_words(1), max_tokens=7,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 7
    assert r.usage.prompt_tokens == 10, "ten words"
    e = r.usage.model_extra["energy"]
    assert e["joules"] > 0 and e["source"].startswith("modelled:roofline") and e["split_method"] == "modelled"
    assert sum(e["joules_by_phase"].values()) == pytest.approx(e["joules"], rel=1e-12)
    assert set(e["joules_by_phase"]) <= {"prefill", "draft", "verify", "commit"} and e["gates"] == "not evaluated"
    spec = r.model_extra["metrics"]["speculative_decoding"]
    assert spec["num_spec_tokens"] == 3 and len(spec["acceptance_histogram"]) == 4
    assert spec["num_spec_steps"] == sum(spec["acceptance_histogram"]) == len(spec["per_step_accepted"])
    steps_n = spec["num_spec_steps"]
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_draft_tokens"] / steps_n)
    steps = spec["per_step_accepted"]
    assert 1 + sum(a + 1 for a in steps[:-1]) < 7 <= 1 + sum(a + 1 for a in steps), \
        "the verify steps' accepted drafts (+ bonus) and the prefill's token account for the 7 tokens"


def test_streaming_delivers_the_same_text_and_ends_with_usage(client, server):
    plain = client.chat.completions.create(model=_name(server), max_tokens=6,
                                           messages=[{"role": "user", "content": prompt_words(2)}])
    stream = client.chat.completions.create(model=_name(server), max_tokens=6, stream=True,
                                            stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": prompt_words(2)}])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content, "streamed text must equal the plain response's"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
    last = chunks[-1]
    assert not last.choices and last.usage.completion_tokens == plain.usage.completion_tokens
    assert last.usage.model_extra["energy"]["joules"] > 0
    assert last.model_extra["metrics"]["speculative_decoding"]["num_spec_tokens"] == 3


def test_greedy_output_equals_generate_token_for_token(http, server, model_dir, capsys):
    """The server against ``python -m refspec.eval generate`` (its text) and the engine's
    ``generate`` on the same prompt (its token ids), three prompts sent concurrently."""
    from refspec.engine import Engine, EngineConfig
    from refspec.eval import generate

    prompts = [prompt_words(i, 6 + 2 * i) for i in range(3)]
    body = lambda p: {"model": _name(server), "prompt": p, "max_tokens": 12, "return_token_ids": True}  # noqa: E731
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        served = list(pool.map(lambda p: http.post("/v1/completions", json=body(p)).json(), prompts))
    assert generate.main(["--model", str(model_dir), "--dtype", "fp32", "--no-chat", "--drafter", "ngram", "--k",
                          "3", "--max-new-tokens", "12", "--json", *sum((["--prompt", p] for p in prompts), [])]) == 0
    cli = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    tok = server.session.target.tokenizer
    for s, c in zip(served, cli):
        ids = s["choices"][0]["token_ids"]
        assert tok.decode(ids) == c["completion"] and len(ids) == c["tokens"], \
            f"the server's greedy output differs from generate's for {c['prompt']!r}"
    engine = Engine(server.session.target.model, None, config=EngineConfig(),
                    eos_token_ids=server.session.target.eos_token_ids)
    alone = engine.generate([s["choices"][0]["prompt_token_ids"] for s in served], max_new_tokens=12)
    assert [s["choices"][0]["token_ids"] for s in served] == alone.tokens, "token ids must equal plain decoding's"


@pytest.mark.parametrize("what,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_a_bad_request_gets_an_openai_error_and_the_server_keeps_serving(http, server, what, body, status, param):
    r = http.post("/v1/completions", json={"model": _name(server), **body})
    assert r.status_code == status, f"{what}: {r.text}"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["message"]
    ok = http.post("/v1/completions", json={"model": _name(server), "prompt": "w3 w4", "max_tokens": 2})
    assert ok.status_code == 200, "the server must keep serving after a bad request"


def test_malformed_json_and_unknown_routes_get_error_bodies(http, server):
    r = http.post("/v1/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", json={"model": _name(server), "messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert http.get("/v1/nothing").status_code == 404 and "error" in http.get("/v1/nothing").json()


def test_stop_strings_cut_the_text_and_free_the_request(http, server):
    base = http.post("/v1/completions", json={"model": _name(server), "prompt": prompt_words(3), "max_tokens": 8,
                                              "ignore_eos": True}).json()["choices"][0]["text"]
    words = base.split()
    assert len(words) >= 4
    cut = http.post("/v1/completions", json={"model": _name(server), "prompt": prompt_words(3), "max_tokens": 8,
                                             "ignore_eos": True, "stop": [" " + words[2]]}).json()
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["text"] == base[:base.index(" " + words[2])], "the text stops before the stop string"


def test_no_request_reads_another_requests_output(http, server):
    """Twelve requests at once on two slots (ten queue): each response equals the same request alone."""
    prompts = [prompt_words(i, 4 + i % 5) for i in range(12)]
    body = lambda p: {"model": _name(server), "prompt": p, "max_tokens": 5, "return_token_ids": True}  # noqa: E731
    alone = [http.post("/v1/completions", json=body(p)).json() for p in prompts[:3]]
    http_limit = server.settings.queue_limit + 2
    with concurrent.futures.ThreadPoolExecutor(min(12, http_limit)) as pool:
        together = list(pool.map(lambda p: http.post("/v1/completions", json=body(p)).json(), prompts))
    for a, t in zip(alone, together):
        assert t["choices"][0]["token_ids"] == a["choices"][0]["token_ids"]
    for p, t in zip(prompts, together):
        assert t["choices"][0]["prompt_token_ids"] == server.session.target.tokenizer.encode(p), \
            "each response must answer its own prompt"
    assert len({t["id"] for t in together}) == 12


def test_metrics_are_prometheus_text_and_count_the_requests(http, server):
    text = http.get("/metrics").text
    assert http.get("/metrics").headers["content-type"].startswith("text/plain")
    samples = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.fullmatch(r"# (HELP|TYPE) refspec_\w+ .+", line), line
            continue
        name, value = line.rsplit(" ", 1)
        samples[name] = float(value)
    ended = sum(v for k, v in samples.items() if k.startswith("refspec_requests_total"))
    assert ended == len(server.loop.reasons) > 0
    assert samples['refspec_batch_slots{model_name="model"}'] == 2
    energy = {k: v for k, v in samples.items() if k.startswith("refspec_energy_joules_total")}
    assert energy and all('source="modelled:roofline' in k for k in energy)
    accepted = samples['refspec_spec_decode_num_accepted_tokens_total{model_name="model"}']
    rows = samples['refspec_spec_decode_num_drafts_total{model_name="model"}']
    assert samples['refspec_tau{model_name="model"}'] == pytest.approx((accepted + rows) / rows)


def test_the_run_level_endpoint_gives_the_window_and_the_ledger(http, server):
    body = http.get("/v1/energy").json()
    assert Path(body["ledger"]).is_file() and body["run_id"] == server.ledger.run_id
    assert body["run"]["j_per_token"] > 0 and body["split_method"] == "modelled"
    w = body["window"]
    assert set(w) >= {"j_per_token", "valid", "invalid_reason", "time_s", "tokens", "mean_active_rows"}
    assert w["valid"] is False or w["j_per_token"] > 0


def test_a_second_server_into_the_same_out_dir_is_refused_before_it_loads(server, model_dir):
    from refspec.eval.outputs import OutputError
    from refspec.serve.cli import start

    with pytest.raises(OutputError, match="in use by another refspec run"):
        start(["--model", str(model_dir), "--out", str(server.out_dir), *SERVER_FLAGS])


# ---- the session, after shutdown (last: it stops the module's server) ---------------------------
def test_every_response_carries_what_the_record_charges_its_request(http, server):
    from refspec.eval import cli
    from refspec.eval.outputs import RECORDS
    from refspec.eval.record_files import read_records
    from refspec.serve.session import FINISH_REASONS

    bodies = [http.post("/v1/completions", json={"model": _name(server), "prompt": prompt_words(i), "max_tokens": 6})
              .json() for i in range(4)]
    assert server.stop() == 0 and server.record is not None
    assert read_records([server.out_dir / RECORDS], strict=True).records == [server.record], \
        "records.jsonl holds the session's record as the eval reads it back"
    out = {o.id: o for o in server.record.request_outputs}
    assert len(out) == len(server.loop.submitted), "every served request is in the record"
    reasons = json.loads((server.out_dir / FINISH_REASONS).read_text())
    assert reasons["run_id"] == server.ledger.run_id and len(reasons["finish_reasons"]) == len(out)
    for b in bodies:
        e = b["usage"]["energy"]
        o = out[e["ledger_request_id"]]
        assert e["joules"] == pytest.approx(o.energy_j, rel=1e-9), "response and record must charge the same J"
        assert e["joules_by_phase"] == pytest.approx(o.energy_by_phase_j, rel=1e-9)
        spec = b["metrics"]["speculative_decoding"]
        assert tuple(spec["per_step_accepted"]) == o.accepted_per_step
        assert tuple(spec["acceptance_histogram"]) == o.accepted_hist
        assert b["usage"]["completion_tokens"] == o.output_tokens
        assert reasons["finish_reasons"][str(o.id)] == b["choices"][0]["finish_reason"] == "length"
    assert server.record.per_request.request_energy_closes, "requests + unattributed must close on the session's energy"
    assert server.record.corpus == "http"
    assert cli.main(["report", str(server.out_dir)]) == 0, "the eval's report must read a server session"
    assert (server.out_dir / "report.md").read_text().count("ngram k3 b2") >= 1
