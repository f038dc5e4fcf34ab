"""The benchmark helpers report figures of one and the same run."""
import time

from refspec.eval.bench import _interleaved


def test_interleaved_keeps_the_result_of_the_fastest_run():
    # warm-up, then three timed runs sleeping 60, 5 and 40 ms: the 5 ms run (call 2) is the best
    sleeps = iter([0.0, 0.06, 0.005, 0.04])
    calls = []

    def fn():
        calls.append(len(calls))
        time.sleep(next(sleeps))
        return calls[-1]

    best = _interleaved({"f": fn}, repeats=3)
    wall, result = best["f"]
    assert result == 2, "the result must come from the run whose wall time is reported"
    assert 0.005 <= wall < 0.04

