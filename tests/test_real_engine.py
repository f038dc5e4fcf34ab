"""Real tier: speculative decoding on SmolLM2-135M (fetched from PyPI) equals plain decoding.

The heavy tier runs the real Qwen2.5-Coder 0.5B -> 1.5B pair (opt in with --run-heavy).
"""
import pytest
import torch

from refspec.drafters.draft_model import DraftModelDrafter
from refspec.drafters.ngram import NgramDrafter
from refspec.engine import Engine, EngineConfig

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three uses of a hash map.",
    "def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\"\n",
    "Translate 'good morning' into French, Spanish and German.",
    "What is the capital of Australia?",
    "Explain recursion to a child.",
    "class Queue:\n    def __init__(self):\n        self.items = []\n",
    "Summarise the rules of chess in one paragraph.",
    "Write a haiku about the sea.",
]


@pytest.mark.real
@pytest.mark.parametrize("drafter", ["ngram", "self-draft"])
def test_smollm2_greedy_speculative_equals_plain(smollm2, smollm2_plain, drafter):
    from refspec.eval.runtime import encode_prompt

    prompts = [encode_prompt(smollm2, p, chat=not p.startswith(("def", "class"))) for p in PROMPTS]
    m = smollm2.model
    eos = smollm2.eos_token_ids
    plain = smollm2_plain(prompts, 40, eos)
    d = NgramDrafter() if drafter == "ngram" else DraftModelDrafter(m.truncated(8), target_vocab_size=m.args.vocab_size)
    spec = Engine(m, d, config=EngineConfig(k=4), eos_token_ids=eos).generate(prompts, max_new_tokens=40)
    for i, (a, b) in enumerate(zip(plain, spec.tokens)):
        assert a == b, f"{drafter}: row {i} differs from plain decoding"
    one = Engine(m, d, config=EngineConfig(k=4), eos_token_ids=eos).generate(prompts[:1], max_new_tokens=40)
    assert one.tokens[0] == plain[0], "batch 1 equals the row inside the ragged batch"
    assert spec.tau > 1.0


@pytest.mark.heavy
def test_qwen_pair_greedy_speculative_equals_plain():
    from refspec.drafters import registry
    from refspec.eval.runtime import encode_prompt, load_target

    target = load_target("qwen2.5-coder-1.5b", dtype=torch.float32, device=torch.device("cpu"))
    prompts = [encode_prompt(target, p, chat=True) for p in PROMPTS[:4]]
    ctx = registry.DrafterContext(target=target.model, target_name="qwen2.5-coder-1.5b",
                                  tokenizer_fingerprint=target.fingerprint, dtype=torch.float32,
                                  device=torch.device("cpu"), options={"draft_model": "qwen2.5-coder-0.5b"})
    d = registry.build("draft-model", ctx)
    eos = target.eos_token_ids
    plain = Engine(target.model, eos_token_ids=eos).generate(prompts, max_new_tokens=24)
    spec = Engine(target.model, d, config=EngineConfig(k=4), eos_token_ids=eos).generate(prompts, max_new_tokens=24)
    assert spec.tokens == plain.tokens


@pytest.mark.real
def test_bench_scripts_print_their_figures(capsys, tmp_path):
    """`bench decode` and `bench spec` run end to end on SmolLM2 (tiny budgets; the figures are
    not checked against targets here, only that they are there, finite and consistent)."""
    import json
    import math

    from refspec.eval.bench import CODE_PROMPTS, main

    prompts = tmp_path / "prompts.jsonl"  # two of the built-in prompts: batch 2 is one chunk
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in CODE_PROMPTS[:2]))

    assert main(["decode", "--batch", "1,2", "--dtype", "fp32", "--new-tokens", "3", "--repeats", "1", "--json"]) == 0
    dec = json.loads(capsys.readouterr().out)
    assert [r["batch"] for r in dec["rows"]] == [1, 2]
    for r in dec["rows"]:
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("refspec_tokens_per_s", "hf_tokens_per_s", "floor_step_ms"))
        assert r["speedup_vs_hf"] == pytest.approx(r["refspec_tokens_per_s"] / r["hf_tokens_per_s"])
    assert main(["spec", "--batch", "1,2", "--dtype", "fp32", "--new-tokens", "6", "--repeats", "1", "--json",
                 "--corpus-file", str(prompts)]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["transformers_method"] == "prompt lookup" and spec["prompts"] == 2
    assert [r["batch"] for r in spec["rows"]] == [1, 2]
    for r in spec["rows"]:
        assert r["spec_matches_plain"] and r["hf_matches_plain"], "greedy outputs must agree"
        assert r["tau"] >= 1.0 and r["spec_tokens_per_s"] > 0
