import os
import sys
import tempfile

# the session's own inductor cache: another process compiling at the same time can leave a
# half-written kernel in the shared /tmp one ("file too short")
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _INDUCTOR_DIR = os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="refspec-tests-inductor-")

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


def pytest_collection_modifyitems(config, items):
    gpu = torch.cuda.is_available()
    for item in items:
        if "heavy" in item.keywords and not config.getoption("--run-heavy"):
            item.add_marker(pytest.mark.skip(reason="heavy tier (Qwen 1.5B pair): opt in with --run-heavy"))
        if "gpu" in item.keywords and not gpu:
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU; none is present"))


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
