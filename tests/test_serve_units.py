"""The server's pieces alone: request checking (types, ranges, the server's sampling), the job's
incremental text and stop strings, and the rule that nothing in refspec imports the server or
its HTTP dependencies."""
from __future__ import annotations

import subprocess
import sys

import pytest

from refspec.sampling import SamplingConfig
from refspec.serve.jobs import Job
from refspec.serve.protocol import ApiError, parse_request

GREEDY = SamplingConfig()


def _parse(body, endpoint="completions", sampling=GREEDY):
    return parse_request({"model": "m", **body}, endpoint, sampling)


def test_a_well_formed_request_is_parsed_with_its_extensions():
    p = _parse({"prompt": ["w3 w4"], "max_tokens": 5, "stop": "w9", "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}, "ignore_eos": True,
                "temperature": 0, "top_k": -1, "seed": 7, "presence_penalty": 0, "user": "me"})
    assert (p.prompt, p.max_tokens, p.stop, p.stream, p.include_usage, p.continuous_usage, p.ignore_eos) == \
        ("w3 w4", 5, ("w9",), True, True, True, True)
    chat = _parse({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                   "max_completion_tokens": 3, "max_tokens": None}, "chat")
    assert chat.prompt == ({"role": "user", "content": "hi"},) and chat.max_tokens == 3
    assert _parse({"prompt": [3, 4, 5]}).prompt == (3, 4, 5)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "w3", "max_tokens": 1.5}, "max_tokens"), ({"prompt": "w3", "stop": ["a"] * 5}, "stop"),
    ({"prompt": "w3", "stop": [""]}, "stop"), ({"prompt": []}, "prompt"), ({"prompt": [3, -1]}, "prompt"),
    ({"prompt": "w3", "stream_options": {"x": 1}}, "stream_options"), ({"prompt": "w3", "top_p": 0.5}, "top_p"),
    ({"prompt": "w3", "top_k": 5}, "top_k"), ({"prompt": "w3", "echo": True}, "echo"),
    ({"prompt": "w3", "frequency_penalty": 0.5}, "frequency_penalty"), ({"prompt": "w3", "user": 3}, "user"),
    ({"prompt": "w3", "messages": []}, "messages"), ({"model": 3, "prompt": "w3"}, "model"),
], ids=lambda x: str(x)[:40])
def test_a_bad_field_is_named_in_a_400(body, param):
    with pytest.raises(ApiError) as e:
        _parse(body)
    assert e.value.status == 400 and e.value.param == param and e.value.body()["error"]["param"] == param


def test_sampling_is_the_servers_and_a_seed_is_refused_only_under_sampling():
    warm = SamplingConfig(temperature=0.7, top_k=20)
    assert _parse({"prompt": "w3", "temperature": 0.7, "top_k": 20, "top_p": 1}, sampling=warm).prompt == "w3"
    for body in ({"temperature": 0}, {"top_k": 0}, {"seed": 1}):
        with pytest.raises(ApiError, match="server|seed"):
            _parse({"prompt": "w3", **body}, sampling=warm)
    assert _parse({"prompt": "w3", "seed": 1}).prompt == "w3", "greedy decoding ignores a seed, as OpenAI may"


def _job(stop=(), budget=20, stream=True, ignore_eos=False):
    out = []
    words = {i: f"w{i}" for i in range(3, 96)}
    job = Job(0, [3], budget, stop=stop, ignore_eos=ignore_eos, eos=[2], stream=stream, deliver=out.append,
              decode=lambda ids: " ".join(words[i] for i in ids if i in words))
    return job, out


def test_text_is_streamed_once_and_whole():
    job, out = _job()
    assert job.feed([5, 6]) is None and job.feed([7]) is None and job.feed([8, 2]) == "stop"
    assert "".join(d.text for kind, d in out) == job.text == "w5 w6 w7 w8"
    assert job.tokens == [5, 6, 7, 8, 2], "the end-of-sequence token is counted, not shown"


def test_a_stop_string_across_steps_cuts_the_text_and_is_never_streamed():
    job, out = _job(stop=("w7 w8",))
    assert job.feed([5, 6, 7]) is None
    assert job.feed([8, 9]) == "stop"
    assert job.text == "w5 w6 " and job.tokens == [5, 6, 7, 8], "cut before the stop string, at its last token"
    assert "".join(d.text for _, d in out) == job.text


def test_budget_and_ignore_eos_end_a_request():
    job, _ = _job(budget=3, ignore_eos=True)
    assert job.feed([2, 2]) is None and job.feed([4, 5]) == "length" and job.tokens == [2, 2, 4]


def test_nothing_in_refspec_imports_the_server_or_its_dependencies():
    code = ("import sys, refspec, refspec.engine, refspec.energy.accounting, refspec.eval.cli, refspec.eval.run\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('starlette', 'uvicorn', 'openai', 'guidellm')"
            " or m.startswith('refspec.serve'))\n"
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"imported by refspec: {r.stdout.strip()} {r.stderr[-500:]}"
