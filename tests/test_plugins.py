"""Drafters from outside refspec: ``--drafter MODULE:CLASS``, entry points, and the example drafter.

The plug-in is ``drafters/example.py`` copied into a temporary folder under another module
name, so the test also shows the example is self-contained. The target is a tiny random llama
with a WordLevel tokenizer built here; nothing is fetched.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from refspec.drafters import example, registry
from refspec.drafting import DecodeState, DrafterError
from refspec.engine import Engine, EngineConfig
from refspec.eval import cli
from refspec.sampling import SamplingConfig

SPEC = "mybigram:BigramDrafter"
QUIET = ["--no-progress", "--no-warmup", "--no-chat", "--threads", "1"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """A tiny llama with a tokenizer, a repetitive prompt file, and a folder of drafter modules."""
    from tiny import save_hf
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("plugins")
    model = root / "model"
    model.mkdir()
    save_hf("llama", model)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, 96)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "unk_token": "<unk>"}))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"w{3 + (j * (i + 2)) % 7}" for j in range(14))}) + "\n"
                               for i in range(2)))
    mods = root / "mods"
    mods.mkdir()
    shutil.copy(example.__file__, mods / "mybigram.py")
    (mods / "broken.py").write_text("import no_such_dependency_of_broken\n")
    (mods / "ctxdrafter.py").write_text(
        "from refspec.drafters.example import BigramDrafter\n\n\n"
        "class FromContext(BigramDrafter):\n    default_k = 2\n\n"
        "    @classmethod\n    def from_context(cls, ctx):\n"
        "        d = cls(**ctx.options)\n        d.target_name = ctx.target_name\n        return d\n")
    (mods / "halfdrafter.py").write_text("class Half:\n    name = 'half'\n    hidden_layers = ()\n\n"
                                         "    def reset(self, state):\n        pass\n")
    return {"model": model, "prompts": prompts, "mods": mods, "root": root}


def _argv(tiny, *extra: str) -> list[str]:
    return ["--model", str(tiny["model"]), "--corpus", str(tiny["prompts"]), "--num-prompts", "2",
            "--max-new-tokens", "8", *QUIET, *extra]


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines() if line.strip()]


def _subprocess(argv: list[str], *, cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "refspec.eval", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture
def plugin_path(tiny, monkeypatch):
    """The modules folder on sys.path for in-process CLI calls, and its modules forgotten after."""
    monkeypatch.syspath_prepend(str(tiny["mods"]))
    yield tiny["mods"]
    for name in ("mybigram", "broken", "halfdrafter", "ctxdrafter"):
        sys.modules.pop(name, None)


# ---- the example drafter --------------------------------------------------------------------------
def test_example_drafts_the_docstring_worked_example():
    a, b, c = 5, 6, 7
    tokens = torch.tensor([[a, b, c, a, 0, 0]])  # pending a at position 3
    lengths = torch.tensor([3])
    args = type("Args", (), {"vocab_size": 10})()
    state = DecodeState(tokens=tokens, lengths=lengths, prev_lengths=torch.zeros(1, dtype=torch.long),
                        pending=torch.tensor([a]), prompt_lengths=lengths, done=torch.tensor([False]), hidden=[],
                        num_accepted=torch.zeros(1, dtype=torch.long), sampling=SamplingConfig(), generator=None,
                        step=0, max_length_bound=4, target_args=args, dtype_bytes=4)
    d = example.BigramDrafter()
    d.reset(state)
    assert d.propose(state, 3).tokens.tolist() == [[b, c, a]]
    assert d.propose(state, 1).tokens.tolist() == [[b]]
    state.pending = torch.tensor([9])  # never seen: repeats itself
    assert d.propose(state, 2).tokens.tolist() == [[9, 9]]


def test_example_rejects_a_bad_option():
    with pytest.raises(DrafterError, match="learn_output must be true or false"):
        example.BigramDrafter(learn_output="maybe")


@pytest.mark.parametrize("learn_output", ["true", "false"])
def test_example_greedy_speculative_equals_plain(tiny, learn_output):
    from refspec.models import load_model

    m = load_model(tiny["model"])
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (5, 17, 1, 9)]
    prompts[1] = prompts[1][:4] * 4
    plain = Engine(m, eos_token_ids=[2]).generate(prompts, max_new_tokens=24)
    for k in (1, 4):
        drafter = example.BigramDrafter(learn_output=learn_output)
        spec = Engine(m, drafter, config=EngineConfig(k=k), eos_token_ids=[2]).generate(prompts, max_new_tokens=24)
        assert spec.tokens == plain.tokens, f"k={k}: the bigram drafter changed greedy output"
        assert spec.steps <= plain.steps


def test_example_is_free_in_the_roofline():
    assert example.BigramDrafter().roofline_model(object()) is None


# ---- MODULE:CLASS through the CLI -----------------------------------------------------------------
def test_plugin_runs_through_the_cli_from_the_working_directory(tiny, tmp_path):
    out = tmp_path / "out"
    proc = _subprocess(_argv(tiny, "--drafter", SPEC, "--batch", "2", "--out", str(out)), cwd=tiny["mods"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    base, spec = _records(out)
    assert spec["drafter"] == SPEC and spec["k"] == example.BigramDrafter.default_k
    assert spec["config_id"].startswith(f"{SPEC}-k4-b2-")
    assert spec["greedy_match_baseline"] is True, "a plug-in must not change greedy output"
    assert base["drafter"] == "none"
    assert spec["roofline"] is not None and spec["roofline"]["drafter_model"] == "free", \
        "roofline_model returning None predicts a free draft phase"


def test_plugin_sweep_resumes_by_its_exact_name(tiny, tmp_path, plugin_path, capsys):
    out = tmp_path / "sweep"
    argv = ["sweep", *_argv(tiny, "--drafter", f"{SPEC},ngram", "--batch", "1", "--k", "2", "--out", str(out))]
    proc = _subprocess(argv, cwd=tmp_path, pythonpath=plugin_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first = _records(out)
    assert [r["drafter"] for r in first] == ["none", SPEC, "ngram"]
    assert cli.main(argv) == 0, "the same sweep again, in another process, must resume"
    capsys.readouterr()
    assert len(_records(out)) == 3, "every configuration, the plug-in's too, was found done"


@pytest.mark.parametrize("spec, message", [
    ("no_such_module_xyz:Drafter", "cannot import module 'no_such_module_xyz': it is not on the Python path"),
    ("broken:Drafter", "its dependency 'no_such_dependency_of_broken' is not on the Python path"),
    ("mybigram:NoSuchClass", "has no 'NoSuchClass'"),
    ("mybigram:torch", "is a module, not a drafter class"),
    ("halfdrafter:Half", "is not a drafter: it lacks propose, commit"),
    ("mybigram:", "is not MODULE:CLASS"),
])
def test_bad_plugin_names_exit_2_with_one_line(tiny, plugin_path, spec, message, capsys):
    rc = cli.main(_argv(tiny, "--drafter", spec, "--batch", "1"))
    err = capsys.readouterr().err
    assert rc == 2, f"{spec}: rc {rc}"
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: --drafter {spec}: "), err
    assert message in lines[0], err


def test_an_option_the_plugin_does_not_take_exits_2(tiny, plugin_path, capsys):
    rc = cli.main(_argv(tiny, "--drafter", SPEC, "--batch", "1", "--drafter-option", "max_n=3"))
    err = capsys.readouterr().err
    assert rc == 2 and "--drafter-option" in err and "max_n" in err and "learn_output" in err, err
    assert "Traceback" not in err


def test_a_plugin_with_from_context_gets_the_context_and_its_default_k(plugin_path):
    ctx = registry.DrafterContext(target=None, target_name="tiny", tokenizer_fingerprint=None, dtype=torch.float32,
                                  device=torch.device("cpu"), options={"learn_output": "false"})
    drafter = registry.build("ctxdrafter:FromContext", ctx)
    assert drafter.target_name == "tiny" and drafter.learn_output is False
    assert registry.default_k("ctxdrafter:FromContext") == 2


# ---- entry points -------------------------------------------------------------------------------
@pytest.fixture
def installed(tiny, tmp_path, monkeypatch, plugin_path):
    """A package installed in a tmp site folder that names ``bigram-ep`` in the entry-point group."""
    site = tmp_path / "site"
    info = site / "mybigram_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mybigram-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\nbigram-ep = {SPEC}\n"
                                           "ngram = mybigram:BigramDrafter\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.setattr(registry, "_REGISTRY", {})
    monkeypatch.setattr(registry, "_ENTRY_POINTS", {})
    return site


def test_an_entry_point_names_a_plugin_without_importing_it(installed):
    names = registry.available()
    assert names["bigram-ep"] == f"plug-in {SPEC}"
    assert "mybigram" not in sys.modules, "listing plug-ins must not import them"
    assert registry.is_plugin("bigram-ep") and not registry.is_plugin("ngram"), "a built-in name is not taken over"
    assert registry.default_k("bigram-ep") == 4


def test_an_entry_point_drafter_runs_through_the_cli(tiny, installed, tmp_path, capsys):
    out = tmp_path / "out"
    rc = cli.main(_argv(tiny, "--drafter", "bigram-ep", "--batch", "2", "--out", str(out)))
    capsys.readouterr()
    assert rc == 0
    spec = _records(out)[1]
    assert spec["drafter"] == "bigram-ep" and spec["greedy_match_baseline"] is True
