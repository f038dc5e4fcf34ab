"""Packed variable-length prefill (``Transformer.prefill``): R prompts of different lengths in
one forward over their real tokens equal a lone prefill of each prompt, write only their own
cache rows and slots, and record only the work of real tokens."""
import pytest
import torch

from refspec.energy.model.work import WorkRecorder
from refspec.models.random_models import random_model

LENGTHS = [5, 13, 1, 20]  # gemma3's tiny window is 8: two prompts cross it
ROWS = [2, 0, 4, 1]  # row 3 of the 5-row cache is not refilled
MOE = dict(model_type="qwen3_moe", vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
           num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
           rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=512, tie_word_embeddings=False,
           bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def moe_model():
    return random_model(MOE, dtype=torch.float32, std=0.3, seed=3)


def _model(name, tiny_models, moe_model):
    return moe_model if name == "qwen3_moe" else tiny_models[name]


def _prompts(lengths=LENGTHS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (s,), generator=gen) for s in lengths]


def _lone(model, prompt, hidden_layers, steps):
    """Logits at the last token, hidden states and greedy continuation of one prompt alone."""
    s = prompt.numel()
    cache = model.new_cache(1, 64)
    logits, hidden = model(prompt[None], torch.arange(s)[None], cache, logits_at=torch.tensor([[s - 1]]),
                           hidden_layers=hidden_layers)
    tok, out = logits[0, -1].argmax(), []
    for i in range(steps):
        out.append(int(tok))
        lg, _ = model(tok.view(1, 1), torch.tensor([[s + i]]), cache, num_keys=64)
        tok = lg[0, -1].argmax()
    return logits[0, -1], [h[0] for h in hidden], out, cache


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "gemma3", "qwen3_moe"])
def test_packed_prefill_equals_a_lone_prefill_of_each_prompt(name, tiny_models, moe_model):
    """Logits, zero-padded hidden states, cache entries and the greedy continuation of every
    prompt equal those of the prompt prefilled alone (fp32)."""
    model = _model(name, tiny_models, moe_model)
    prompts, layers = _prompts(), (0, model.num_layers - 1, model.num_layers)
    cache = model.new_cache(5, 64)
    rows = torch.tensor(ROWS)
    logits, hidden = model.prefill(torch.cat(prompts), LENGTHS, cache, rows, hidden_layers=layers)
    assert logits.shape == (4, model.args.vocab_size) and logits.dtype == torch.float32
    assert all(h.shape == (4, max(LENGTHS), model.args.hidden_size) for h in hidden)
    steps = 6
    # greedy decoding of the packed rows, all five cache rows in one batch (row 3 holds nothing)
    lengths = torch.zeros(5, dtype=torch.long)
    lengths[rows] = torch.tensor(LENGTHS)
    tok = torch.zeros(5, dtype=torch.long)
    tok[rows] = logits.argmax(-1)
    packed_out = [[] for _ in range(5)]
    for _ in range(steps):
        for r in range(5):
            packed_out[r].append(int(tok[r]))
        lg, _ = model(tok[:, None], lengths[:, None], cache, num_keys=64)
        tok, lengths = lg[:, -1].argmax(-1), lengths + 1
    for i, (p, row) in enumerate(zip(prompts, ROWS)):
        s = p.numel()
        lone_logits, lone_hidden, lone_out, lone_cache = _lone(model, p, layers, steps)
        torch.testing.assert_close(logits[i], lone_logits, rtol=1e-4, atol=1e-4)
        for h, lh in zip(hidden, lone_hidden):
            torch.testing.assert_close(h[i, :s], lh, rtol=1e-4, atol=1e-4)
            assert not h[i, s:].any(), "hidden states are zero past the prompt"
        assert packed_out[row] == lone_out, f"prompt {i}: greedy continuation differs from a lone prefill"
        torch.testing.assert_close(cache.k[:, row, :, :s], lone_cache.k[:, 0, :, :s], rtol=1e-4, atol=1e-4)


def test_writes_only_the_prompts_rows_and_slots(tiny_models):
    """Nothing outside each prompt's (row, 0..S_i-1) entries changes: no padded position is
    computed into the cache, and a row not refilled keeps its entries."""
    model = tiny_models["gemma3"]
    cache = model.new_cache(5, 32)
    cache.k.fill_(7.0)
    cache.v.fill_(7.0)
    model.prefill(torch.cat(_prompts()), LENGTHS, cache, torch.tensor(ROWS))
    written = torch.zeros(5, 32, dtype=torch.bool)
    for row, s in zip(ROWS, LENGTHS):
        written[row, :s] = True
    for buf in (cache.k, cache.v):
        untouched = buf.permute(1, 3, 0, 2, 4)[~written]  # [entries, L, Hkv, D]
        assert (untouched == 7.0).all()
        assert (buf.permute(1, 3, 0, 2, 4)[written] != 7.0).all()


def test_recorded_work_is_the_real_prompt_tokens(tiny_models):
    """One ForwardShape: R rows of S_max, but N = sum S_i query tokens, sum S_i keys and
    sum S_i^2 attention pairs (sliding layers likewise), R LM-head tokens. Billing padded
    positions (R * S_max tokens, R * S_max^2 pairs) fails here."""
    for name in ("llama", "gemma3"):
        model = tiny_models[name]
        with WorkRecorder() as rec:
            model.prefill(torch.cat(_prompts()), LENGTHS, model.new_cache(5, 64), torch.tensor(ROWS))
        (shape,) = rec.work
        n, pairs = sum(LENGTHS), sum(s * s for s in LENGTHS)
        assert (shape.rows, shape.tokens_per_row, shape.lm_head_tokens) == (4, 20, 4)
        assert (shape.query_tokens, shape.context_tokens, shape.attention_pairs) == (n, n, pairs)
        sliding = (shape.sliding_context_tokens, shape.sliding_attention_pairs)
        assert sliding == ((n, pairs) if name == "gemma3" else (None, None))
        # the same work as the lone prefills, each attending exactly its own S_i keys
        lone = []
        for p in _prompts():
            with WorkRecorder() as r1:
                model(p[None], torch.arange(p.numel())[None], model.new_cache(1, p.numel()),
                      logits_at=torch.tensor([[p.numel() - 1]]))
            lone.append(r1.work[0])
        assert n == sum(w.rows * w.tokens_per_row for w in lone)
        assert pairs == sum(w.tokens_per_row * w.context_tokens for w in lone)


def test_prefill_into_a_cuda_graph_runners_cache_view(tiny_models):
    """The runner's CacheView (a view of its KV pool) takes a packed prefill like a plain cache;
    a target whose steps run through the runner prefills through the model into it."""
    from refspec.cuda_graphs import GraphRunner
    from refspec.models import PreparedTarget

    model = tiny_models["qwen2"]
    runner = GraphRunner(model, capture=False)
    target = PreparedTarget(model, step=runner)
    view = target.new_cache(5, 64)
    plain = model.new_cache(5, 64)
    tokens, rows = torch.cat(_prompts()), torch.tensor(ROWS)
    a, _ = target.prefill(tokens, LENGTHS, view, rows)
    b, _ = model.prefill(tokens, LENGTHS, plain, rows)
    assert torch.equal(a, b)
    assert torch.equal(view.k, plain.k) and torch.equal(runner._pool.k[:, :5, :, :64], plain.k)


@pytest.mark.parametrize("lengths, tokens, rows, msg", [
    ([], 0, 0, "1 or more prompts"),
    ([3, 0], 3, 2, "1 or more prompts"),
    ([3, 70], 73, 2, "1..64 tokens"),
    ([3, 4], 6, 2, r"tokens \[N=7\]"),
    ([3, 4], 7, 3, r"rows \[R=2\]"),
])
def test_bad_prefill_arguments_are_named(tiny_models, lengths, tokens, rows, msg):
    model = tiny_models["llama"]
    with pytest.raises(ValueError, match=msg):
        model.prefill(torch.zeros(tokens, dtype=torch.long), lengths, model.new_cache(3, 64), torch.arange(rows))
