"""The server on the real SmolLM2-135M (fp32, n-gram drafter): a chat request through the openai
client decodes exactly what ``python -m refspec.eval generate`` decodes for the same prompt, and its
response carries energy and acceptance."""
from __future__ import annotations

import json

import pytest

from test_serve import one_thread  # noqa: F401  (fixture)

PROMPT = "List three uses of a paperclip."


@pytest.mark.real
def test_a_chat_request_on_smollm2_equals_generate(tmp_path, capsys, one_thread):  # noqa: F811
    import openai

    from refspec.eval import generate
    from refspec.serve.cli import start

    assert generate.main(["--model", "smollm2-135m", "--dtype", "fp32", "--drafter", "ngram", "--k", "4",
                          "--max-new-tokens", "24", "--json", "--prompt", PROMPT]) == 0
    expected = json.loads(capsys.readouterr().out.splitlines()[0])
    server = start(["--model", "smollm2-135m", "--dtype", "fp32", "--drafter", "ngram", "--k", "4", "--batch", "2",
                    "--port", "0", "--out", str(tmp_path / "out"), "--no-warmup", "--max-len", "512"])
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="smollm2-135m", max_tokens=24,
                                           messages=[{"role": "user", "content": PROMPT}],
                                           extra_body={"return_token_ids": True})
    finally:
        assert server.stop() == 0
    ids = r.choices[0].model_extra["token_ids"]
    assert server.session.target.tokenizer.decode(ids) == expected["completion"] and len(ids) == expected["tokens"]
    assert r.usage.model_extra["energy"]["joules"] > 0
    assert r.model_extra["metrics"]["speculative_decoding"]["num_spec_tokens"] == 4
