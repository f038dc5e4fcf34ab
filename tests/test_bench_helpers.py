"""The benchmark helpers report figures of one and the same run."""
import time

from refspec.eval.bench_timing import interleaved


def test_interleaved_keeps_the_result_of_the_fastest_run():
    # warm-up, then three timed runs sleeping 60, 5 and 40 ms: the 5 ms run (call 2) is the best
    sleeps = iter([0.0, 0.06, 0.005, 0.04])
    calls = []

    def fn():
        calls.append(len(calls))
        time.sleep(next(sleeps))
        return calls[-1]

    best = interleaved({"f": fn}, repeats=3)
    wall, result = best["f"]
    assert result == 2, "the result must come from the run whose wall time is reported"
    assert 0.005 <= wall < 0.04



class _FakeGeneration:
    def __init__(self, tokens, accepted):
        self.tokens, self.accepted_per_step = tokens, accepted


class _FakeEngine:
    """generate() returns one token list per prompt (the prompt's first token, tagged) after ``sleep_s``."""

    def __init__(self, tag, sleep_s, accepted=((1, 0),)):
        self.tag, self.sleep_s, self.accepted = tag, sleep_s, [list(a) for a in accepted]

    def generate(self, chunk, max_new_tokens):
        time.sleep(self.sleep_s)
        return _FakeGeneration([[self.tag, p[0]] for p in chunk], self.accepted)


def test_timed_chunks_times_every_engine_and_counts_taus_of_spec():
    from refspec.eval.bench import _timed_chunks

    engines = {"plain": _FakeEngine(0, 0.002), "spec": _FakeEngine(1, 0.001, accepted=((2, -1),)),
               "spec_compiled": _FakeEngine(2, 0.0005)}
    t, tokens, taus = _timed_chunks(engines, None, {}, [[10], [11], [12]], 2, 4, repeats=1)
    assert set(t) == {"plain", "spec", "spec_compiled", "hf"} and t["hf"] == 0.0
    assert tokens["spec_compiled"] == [[2, 10], [2, 11], [2, 12]] and tokens["plain"][2] == [0, 12]
    assert taus == [3, 3]  # two chunks, one active row-step each (accepted 2: tau 3); -1 rows are done
    assert t["plain"] > t["spec_compiled"] > 0


def test_products_run_multiplies_every_matrix_of_a_step_once(tiny_models, monkeypatch):
    """The 'products alone' figure times one product per block matrix and the LM head, with the
    step's rows, through the model's own copies."""
    from refspec.eval import bench_timing
    from refspec.models import cpu_speed, gemm_forms

    model = tiny_models["llama"]
    seen = []
    real = gemm_forms.linear
    monkeypatch.setattr(gemm_forms, "linear",
                        lambda x, w, b=None, gemm=None: seen.append((x.shape, w.shape)) or real(x, w, b, gemm))
    outs = bench_timing.products_run(model, 3)()
    lins = cpu_speed.copied_linears(model)
    assert len(lins) == 1 + 4 * model.num_layers and len(outs) == len(seen) == len(lins)
    assert [w for _, w in seen] == [lin.weight.shape for lin in lins]
    assert all(x[0] == 3 for x, _ in seen) and outs[0].shape == (3, model.args.vocab_size)
