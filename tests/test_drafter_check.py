"""A drafter's proposal is checked once, in the engine: every bad return is a DrafterError naming the drafter.

The drafter here returns one kind of bad proposal each; the target is a tiny random llama. Each
case would otherwise reach the target as an IndexError, a torch shape error, or (NaN,
unnormalised probabilities) a silently wrong acceptance test.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from refspec.drafting import Draft, DrafterError
from refspec.engine import Engine, EngineConfig
from refspec.sampling import SamplingConfig


def _uniform(b: int, k: int, v: int) -> torch.Tensor:
    return torch.full((b, k, v), 1.0 / v)


# (id, what propose returns given (batch, k, vocab), whether decoding samples, text the error holds)
BAD = [
    ("none", lambda b, k, v: None, False, "NoneType"),
    ("not-a-tensor", lambda b, k, v: Draft(tokens=[[3] * k] * b), False, "not a tensor"),
    ("float-ids", lambda b, k, v: Draft(tokens=torch.full((b, k), 3.0)), False, "integers"),
    ("one-dimensional", lambda b, k, v: Draft(tokens=torch.full((k,), 3)), False, "expected"),
    ("wrong-batch", lambda b, k, v: Draft(tokens=torch.full((b + 1, k), 3)), False, "expected"),
    ("too-many", lambda b, k, v: Draft(tokens=torch.full((b, k + 1), 3)), False, "at most k"),
    ("out-of-vocabulary", lambda b, k, v: Draft(tokens=torch.full((b, k), v)), False, "outside the vocabulary"),
    ("negative-id", lambda b, k, v: Draft(tokens=torch.full((b, k), -1)), False, "outside the vocabulary"),
    ("nan-probs", lambda b, k, v: Draft(tokens=torch.full((b, k), 3), probs=_uniform(b, k, v) * float("nan")),
     True, "NaN"),
    ("unnormalised-probs", lambda b, k, v: Draft(tokens=torch.full((b, k), 3), probs=_uniform(b, k, v) * 2), True,
     "sum to 1"),
    ("probs-wrong-shape", lambda b, k, v: Draft(tokens=torch.full((b, k), 3), probs=_uniform(b, k, v - 1)), True,
     "probs"),
]


class _Returns:
    """A drafter whose every proposal is ``make(batch, k, vocab)``."""

    name = "returns-bad"
    hidden_layers = ()

    def __init__(self, make, vocab: int) -> None:
        self.make, self.vocab = make, vocab

    def reset(self, state) -> None:
        pass

    def propose(self, state, k):
        return self.make(state.pending.shape[0], k, self.vocab)

    def commit(self, state) -> None:
        pass


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from tiny import save_hf

    from refspec.models import load_model

    folder = tmp_path_factory.mktemp("llama")
    save_hf("llama", folder)
    return load_model(folder)


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_a_bad_proposal_is_a_drafter_error_naming_the_drafter(case, target):
    _, make, sampled, needle = case
    sampling = SamplingConfig(temperature=1.0) if sampled else SamplingConfig()
    engine = Engine(target, _Returns(make, target.args.vocab_size), config=EngineConfig(k=3, sampling=sampling))
    with pytest.raises(DrafterError) as err:
        engine.generate([[5, 6, 7], [8, 9]], max_new_tokens=4, generator=torch.Generator().manual_seed(0))
    assert "returns-bad" in str(err.value) and needle in str(err.value), str(err.value)


def test_good_probabilities_pass(target):
    v = target.args.vocab_size
    make = lambda b, k, v: Draft(tokens=torch.full((b, k), 3), probs=_uniform(b, k, v))  # noqa: E731
    engine = Engine(target, _Returns(make, v), config=EngineConfig(k=2, sampling=SamplingConfig(temperature=1.0)))
    out = engine.generate([[5, 6, 7]], max_new_tokens=4, generator=torch.Generator().manual_seed(0))
    assert len(out.tokens[0]) == 4


def test_the_check_survives_python_O():
    """No assert does the checking: ``python -O`` strips asserts and must still refuse too many tokens."""
    code = ("import torch; from refspec.drafter_check import check_draft; from refspec.drafting import Draft, "
            "DrafterError\ntry:\n    check_draft(Draft(tokens=torch.zeros(1, 5, dtype=torch.long)), name='x', batch=1, "
            "k=2, vocab_size=10, sampling=False)\nexcept DrafterError:\n    print('refused')")
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "refused", out.stderr[-2000:]
