"""The session's settings and shared fixtures.

The README's command runs the tests in parallel workers (pytest-xdist: ``-n auto --dist
loadgroup``); without ``-n`` they run in one process. Each process gets its own inductor cache and
its share of the cores; tests that share a module-scoped fixture run on one worker, so the fixture
is built once, and the GPU tests run one after another on one worker.
"""
import os
import sys
import tempfile

# each process's own inductor cache (every xdist worker too): another process compiling at the same
# time can leave a half-written kernel in a shared one ("file too short"); a user's own setting is kept
_OWN_INDUCTOR = "REFSPEC_TESTS_INDUCTOR_DIR"
if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, os.environ.get(_OWN_INDUCTOR)):
    _INDUCTOR_DIR = tempfile.mkdtemp(prefix="refspec-tests-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.environ[_OWN_INDUCTOR] = _INDUCTOR_DIR

# a worker's share of the cores, exported so that in-process CLIs (which use every core unless
# OMP_NUM_THREADS is set) and child processes keep to it instead of oversubscribing the machine
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
# tests run the reference GEMM form (F.linear) unless a test picks a plan: no calibration timing
os.environ.setdefault("REFSPEC_GEMM_PLAN", "reference")
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", max(1, min(2, os.cpu_count() or 1)))))


def pytest_unconfigure(config):
    if "_INDUCTOR_DIR" in globals():
        import shutil

        shutil.rmtree(_INDUCTOR_DIR, ignore_errors=True)


def pytest_addoption(parser):
    parser.addoption("--run-heavy", action="store_true", help="run the heavy tier (Qwen 1.5B pair)")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    gpu = torch.cuda.is_available()
    xdist = config.pluginmanager.hasplugin("xdist")
    for item in items:
        if "heavy" in item.keywords and not config.getoption("--run-heavy"):
            item.add_marker(pytest.mark.skip(reason="heavy tier (Qwen 1.5B pair): opt in with --run-heavy"))
        if "gpu" in item.keywords and not gpu:
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU; none is present"))
        if xdist and "gpu" in item.keywords:  # one GPU: its tests (and what they measure) do not overlap
            item.add_marker(pytest.mark.xdist_group("gpu"))
        elif xdist and _uses_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def _uses_a_module_fixture(item) -> bool:
    """Whether ``item`` uses a module- or class-scoped fixture (``--dist loadgroup`` then keeps it
    with the rest of its module on one worker, so the fixture is set up once)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(defs[-1].scope in ("module", "class") for defs in info.name2fixturedefs.values() if defs)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Loaded refspec models (fp32) of each tiny family config, built via transformers."""
    from tiny import TINY_HF, save_hf

    from refspec.models import load_model

    out = {}
    for name in TINY_HF:
        d = tmp_path_factory.mktemp(name)
        save_hf(name, d)
        out[name] = load_model(d)
    return out


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M in fp32 on the CPU with its tokenizer (a ``LoadedTarget``), loaded once
    per worker and fetched on first use; tests read it and never change it."""
    from refspec.eval.runtime import load_target

    return load_target("smollm2-135m", dtype=torch.float32, device=torch.device("cpu"), progress=False)


@pytest.fixture(scope="session")
def smollm2_plain(smollm2):
    """``plain(prompts, max_new_tokens, eos) -> tokens``: SmolLM2's plain greedy decoding, computed
    once per prompts, budget and EOS ids, the reference every speculative test compares with."""
    from refspec.engine import Engine

    memo: dict[tuple, list[list[int]]] = {}

    def plain(prompts: list[list[int]], max_new_tokens: int, eos) -> list[list[int]]:
        key = (tuple(map(tuple, prompts)), max_new_tokens, tuple(eos))
        if key not in memo:
            memo[key] = Engine(smollm2.model, eos_token_ids=list(eos)).generate(
                prompts, max_new_tokens=max_new_tokens).tokens
        return [list(row) for row in memo[key]]

    return plain
