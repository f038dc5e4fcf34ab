"""Tensor parallelism (issue 38): sharding arithmetic, launch checks, the interconnect roofline,
and 2 CPU processes with gloo: every family and drafter decodes as TP 1 does, the CLI's ledger
gives each rank's energy, and a bad ``--tp`` or a dying rank ends every rank with one line.

The multi-process tests start their ranks as torchrun does (tests/tp_procs.py), one thread each.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from refspec.config import ModelArgs
from refspec.energy.model.architectures import arch
from refspec.energy.model.hardware import H200_SXM
from refspec.energy.model.roofline import predict_step
from refspec.energy.model.work import ForwardShape
from refspec.models.tp.group import check_launch
from refspec.models.tp.interconnect import crossovers, predict_tp_step, tp_forward
from refspec.models.tp.plan import TPError, shard_plan
from tiny import TINY_HF, save_hf, save_tokenizer
from tp_procs import REPO, error_lines, launch

SMOLLM2 = dict(family="llama", vocab_size=64, hidden_size=72, intermediate_size=96, num_layers=2, num_heads=9,
               num_kv_heads=3, head_dim=8)


# ---- sharding and launch arithmetic ---------------------------------------------------------------
@pytest.mark.parametrize("heads, kv, size, want", [
    ((4, 2), None, 2, [((0, 2), (0, 1)), ((2, 4), (1, 2))]),  # whole groups
    ((9, 3), None, 2, [((0, 6), (0, 2)), ((6, 9), (2, 3))]),  # SmolLM2: 2 + 1 groups
    ((4, 1), None, 2, [((0, 2), (0, 1)), ((2, 4), (0, 1))]),  # one K/V head, replicated, its queries split
    ((8, 2), None, 4, [((0, 2), (0, 1)), ((2, 4), (0, 1)), ((4, 6), (1, 2)), ((6, 8), (1, 2))]),
])
def test_each_rank_keeps_whole_groups_or_a_share_of_a_replicated_head(heads, kv, size, want):
    args = ModelArgs(**{**SMOLLM2, "num_heads": heads[0], "num_kv_heads": heads[1]})
    plans = [shard_plan(args, size, r) for r in range(size)]
    assert [(p.q_heads, p.kv_heads) for p in plans] == want
    assert sum(p.intermediate for p in plans) == args.intermediate_size  # every MLP column on one rank


def test_heads_the_ranks_cannot_share_and_moe_are_refused():
    with pytest.raises(TPError, match="3 query heads in 1 key/value groups cannot be shared by 2 ranks"):
        shard_plan(ModelArgs(**{**SMOLLM2, "num_heads": 3, "num_kv_heads": 1}), 2, 0)
    with pytest.raises(TPError, match="mixture-of-experts"):
        shard_plan(arch("qwen3-30b-a3b"), 2, 0)


@pytest.mark.parametrize("tp, env, devices, message", [
    (2, None, 8, "needs 2 processes: start it with torchrun --nproc-per-node 2"),
    (2, dict(rank=0, size=4, local_rank=0, local_size=4), 8, "torchrun started 4 processes"),
    (1, dict(rank=0, size=2, local_rank=0, local_size=2), 8, "--tp 1 but torchrun started 2"),
    (4, dict(rank=0, size=4, local_rank=0, local_size=4), 2, "4 ranks on this node but only 2 GPUs"),
])
def test_launches_that_cannot_work_say_how_to_start(tp, env, devices, message):
    with pytest.raises(TPError, match=message):
        check_launch(tp, env, device_type="cuda", devices=devices)
    check_launch(2, dict(rank=1, size=2, local_rank=1, local_size=2), device_type="cuda", devices=2)


def test_the_sbatch_of_a_tp_sweep_runs_torchrun_on_n_gpus_of_one_node(tmp_path):
    from refspec.eval.sweep import sbatch_script

    text = sbatch_script(sweep_argv=["--tp", "4", "--batch", "1"], num_tasks=3, out_dir=tmp_path, tp=4)
    assert "#SBATCH --gpus-per-task=4" in text and "#SBATCH --ntasks=1" in text and "--gres" not in text
    assert 'torchrun --standalone --nproc-per-node 4 -m refspec.eval sweep --tp 4 --batch 1 --task-index' in text


def test_print_sbatch_of_a_tp_sweep_needs_no_torchrun(tmp_path, capsys):
    from refspec.eval import cli

    rc = cli.main(["sweep", "--model", "x", "--corpus", "code", "--batch", "1", "--tp", "2", "--print-sbatch",
                   "--out", str(tmp_path / "s")])
    assert rc == 0, capsys.readouterr().err
    assert "--nproc-per-node 2" in (tmp_path / "s" / "sweep.sbatch").read_text()


# ---- the interconnect roofline ----------------------------------------------------------------------
def _verify(args: ModelArgs, batch: int, k: int, context: int = 512) -> ForwardShape:
    return ForwardShape(args=args, rows=batch, tokens_per_row=k + 1, context_tokens=batch * (context + k + 1),
                        dtype_bytes=2)


def test_one_gpu_is_the_single_device_roofline():
    target = arch("llama-3.1-70b")
    for b, k in ((1, 0), (8, 3), (64, 7)):
        one = predict_tp_step(target, H200_SXM, tp=1, batch=b, k=k, context=512, acceptance=0.7)
        ref = predict_step(target, H200_SXM, batch=b, k=k, context=512, acceptance=0.7)
        assert math.isclose(one.step_time_s, ref.step_time_s, rel_tol=1e-12)
        assert math.isclose(one.j_per_token, ref.j_per_token, rel_tol=1e-12)


def test_all_reduces_move_two_n_minus_one_over_n_of_each_tensor_per_layer_twice():
    target, b, k = arch("llama-3.1-70b"), 8, 3
    for tp in (2, 4, 8):
        f = tp_forward(_verify(target, b, k), H200_SXM, tp)
        tensor = b * (k + 1) * target.hidden_size * 2
        assert f.collectives == 2 * target.num_layers and f.tensor_bytes == tensor
        assert math.isclose(f.link_bytes, 2 * target.num_layers * 2 * (tp - 1) / tp * tensor)
        assert math.isclose(f.comm_s, f.link_bytes / H200_SXM.link_Bps + f.collectives * H200_SXM.link_latency_s)
        lm_head = target.vocab_size * target.hidden_size * 2
        whole = tp_forward(_verify(target, b, k), H200_SXM, 1).gpu.weight_bytes
        assert math.isclose(f.gpu.weight_bytes - lm_head, (whole - lm_head) / tp, rel_tol=0.01)  # blocks over N


def test_tp_leaves_the_compute_bound_batch_and_pulls_the_token_bound_one_down():
    target = arch("llama-3.1-70b")
    for k in (0, 3, 7):
        found = [crossovers(target, H200_SXM, tp=tp, k=k, context=512) for tp in (1, 2, 4, 8)]
        compute, token = [c for c, _ in found], [t for _, t in found]
        assert max(compute) - min(compute) <= 2, compute  # FLOPs and HBM bytes both shrink by N
        assert token[0] == compute[0] and token == sorted(token, reverse=True) and token[3] < token[1], token


def test_roofline_cli_prints_the_crossovers_per_tp_and_refuses_a_tp_the_heads_cannot_share(capsys):
    from refspec.eval import roofline_cli

    assert roofline_cli.main(["--model", "llama-3.1-70b", "--tp", "1,2,4,8", "--batch", "1,64", "--k", "3"]) == 0
    out = capsys.readouterr().out
    assert all(f"  tp={n}: each GPU holds" in out for n in (1, 2, 4, 8)) and "compute-bound at B" in out
    assert roofline_cli.main(["--model", "smollm2-135m", "--tp", "4"]) == 2
    assert error_lines(capsys.readouterr().err) == [
        "error: --tp 4: 9 query heads in 3 key/value groups cannot be shared by 4 ranks (each rank needs whole "
        "groups, or 4 must be a multiple of 3 that splits a group's 3 query heads evenly); use --tp 1, 2, 3, 9"]


# ---- two CPU ranks with gloo -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tp_models")
    for family in TINY_HF:
        save_hf(family, root / family)
    return root


def test_tp2_decodes_every_family_and_drafter_token_for_token_like_tp1(models, tmp_path):
    out = tmp_path / "results.json"
    ranks = launch(["tests/tp_worker.py", str(out), str(models)], 2)
    assert [r.returncode for r in ranks] == [0, 0], ranks[0].stderr[-2000:] + ranks[1].stderr[-2000:]
    results = json.loads(out.read_text())
    families = {case.split("/")[0] for case in results}
    assert families == set(TINY_HF)
    assert {case.split("/")[1] for case in results} >= {"none", "ngram", "draft-model-self", "draft-model-replicated",
                                                        "eagle"}
    assert any("/sampled/" in c for c in results) and any(c.endswith("/serve") for c in results)
    differ = [case for case, r in results.items() if r["tp1"] != r["tpn"]]
    assert not differ, differ
    assert all(any(len(row) > 1 for row in r["tp1"]) for r in results.values())  # something was decoded


def _tokenizer_model(models: Path) -> Path:
    save_tokenizer(models / "llama")
    return models / "llama"


def _prompts(folder: Path) -> Path:
    path = folder / "prompts.jsonl"
    with open(path, "w") as fh:
        for i in range(5):
            fh.write(json.dumps({"prompt": " ".join(f"w{3 + (j * (i + 2)) % 20}" for j in range(10 + i)),
                                 "kind": "code"}) + "\n")
    return path


def _eval_args(model: Path, prompts: Path, out: Path) -> list[str]:
    return ["--model", str(model), "--corpus", str(prompts), "--max-new-tokens", "6", "--batch", "2", "--requests", "4",
            "--drafter", "ngram", "--meter", "roofline", "--no-progress", "--no-warmup", "--out", str(out)]


@pytest.fixture(scope="module")
def tp_run(models, tmp_path_factory) -> dict:
    """The same evaluation at TP 1 (in-process) and TP 2 (torchrun, two gloo ranks)."""
    from refspec.eval import cli

    root = tmp_path_factory.mktemp("tp_cli")
    model, prompts = _tokenizer_model(models), _prompts(root)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        assert cli.main(_eval_args(model, prompts, root / "tp1")) == 0
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", REFSPEC_GEMM_PLAN="reference", REFSPEC_TP_TIMEOUT_S="60")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "refspec.eval", *_eval_args(model, prompts, root / "tp2"), "--tp", "2"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    read = lambda d: [json.loads(x) for x in (root / d / "records.jsonl").read_text().splitlines()]  # noqa: E731
    ledger = [json.loads(x) for x in (root / "tp2" / "ledger.jsonl").read_text().splitlines()]
    return {"tp1": read("tp1"), "tp2": read("tp2"), "ledger": ledger, "stdout": done.stdout}


def test_tp2_cli_serves_every_request_as_tp1_and_rank0_alone_reports(tp_run):
    outputs = lambda recs: [[o["tokens"] for o in r["request_outputs"]] for r in recs]  # noqa: E731
    assert outputs(tp_run["tp2"]) == outputs(tp_run["tp1"])
    assert all(r["config"]["tp"] == 2 and "tp" not in r1["config"] for r, r1 in zip(tp_run["tp2"], tp_run["tp1"]))
    assert tp_run["stdout"].count("wrote ") == 1  # one rank printed the table and what it wrote


def test_tp2_ledger_gives_each_rank_energy_summing_to_the_phase_and_the_run(tp_run):
    phases = [r for r in tp_run["ledger"] if r["kind"] == "phase"]
    assert phases and all(r["ranks"] == 2 and len(r["rank_energy_j"]) == 2 for r in phases)
    assert all(math.isclose(sum(r["rank_energy_j"]), r["energy_j"], rel_tol=1e-12) for r in phases)
    assert all(r["time_s"] == max(r["rank_time_s"]) for r in phases)
    for rec in tp_run["tp2"]:
        mine = [r for r in phases if r["run_id"] in rec["run_ids"]]
        per_rank = [sum(r["rank_energy_j"][i] for r in mine) for i in range(2)]
        assert math.isclose(sum(per_rank), sum(rec["phase_energy_j"].values()), rel_tol=1e-9)
    verify = [r for r in phases if r["phase"] == "verify"]
    assert all(0 < r["comm_share"] < 1 and min(r["rank_comm_s"]) > 0 for r in verify)  # the all-reduces were timed
    models = [r for r in tp_run["ledger"] if r["kind"] == "model"]
    assert {m["args"]["num_heads"] for m in models} == {2}  # forwards report the rank's share


def _quiet_rank(r: subprocess.CompletedProcess) -> bool:
    return not error_lines(r.stderr) and not r.stdout.strip()


def test_a_tp_the_heads_cannot_share_ends_every_rank_with_one_line_and_nothing_written(tmp_path):
    model = tmp_path / "three_heads"
    cfg = dict(TINY_HF["llama"], num_attention_heads=3, num_key_value_heads=1, hidden_size=48, head_dim=16)
    import transformers

    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg)).save_pretrained(model)
    save_tokenizer(model)
    out = tmp_path / "out"
    ranks = launch(["tests/tp_cli_worker.py", *_eval_args(model, _prompts(tmp_path), out), "--tp", "2"], 2)
    assert [r.returncode for r in ranks] == [2, 2]
    assert len(error_lines(ranks[0].stderr)) == 1 and "cannot be shared by 2 ranks" in ranks[0].stderr
    assert _quiet_rank(ranks[1]) and not out.exists()


def test_more_ranks_than_cores_ends_every_rank_with_one_line(models, tmp_path):
    one_core = min(os.sched_getaffinity(0))
    out = tmp_path / "out"
    ranks = launch(["tests/tp_cli_worker.py", *_eval_args(_tokenizer_model(models), _prompts(tmp_path), out), "--tp",
                    "2", "--device", "cpu"], 2, preexec=lambda: os.sched_setaffinity(0, {one_core}))
    assert [r.returncode for r in ranks] == [2, 2]
    assert error_lines(ranks[0].stderr) == ["error: --tp 2: 2 ranks on this node but only 1 CPU core (one rank per "
                                            "core); lower --tp or --nproc-per-node"]
    assert _quiet_rank(ranks[1]) and not out.exists()


def test_tp_without_torchrun_is_one_line(models, tmp_path, capsys, monkeypatch):
    from refspec.eval import cli

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "out"
    assert cli.main([*_eval_args(_tokenizer_model(models), _prompts(tmp_path), out), "--tp", "2"]) == 2
    assert error_lines(capsys.readouterr().err) == [
        "error: --tp 2 needs 2 processes: start it with torchrun --nproc-per-node 2 -m refspec.eval ... --tp 2"]
    assert not out.exists()


@pytest.mark.parametrize("dying", [1, 0])
def test_a_rank_that_dies_ends_the_other_with_one_line_and_no_record(models, tmp_path, dying):
    out = tmp_path / "out"
    ranks = launch(["tests/tp_cli_worker.py", *_eval_args(_tokenizer_model(models), _prompts(tmp_path), out), "--tp",
                    "2"], 2, extra_env={"TP_TEST_DIE_RANK": str(dying), "TP_TEST_DIE_AFTER": "40"})
    survivor = ranks[1 - dying]
    assert ranks[dying].returncode == 3 and survivor.returncode == 2, survivor.stderr[-2000:]
    lines = error_lines(survivor.stderr)
    assert len(lines) == 1 and f"tensor-parallel rank {1 - dying} of 2: a collective failed" in lines[0], lines
    if dying == 1:  # rank 0 kept the user's directory: its ledger says the run was aborted, no record names it
        assert not (out / "records.jsonl").exists()
        ends = [json.loads(x) for x in (out / "ledger.jsonl").read_text().splitlines() if '"kind": "end"' in x]
        assert ends and all(e["status"] == "aborted" for e in ends)


@pytest.mark.gpu
def test_tp2_on_two_gpus_decodes_like_one_gpu_eager_and_in_cuda_graphs(models, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs for NCCL tensor parallelism; this machine has {torch.cuda.device_count()}")
    out = tmp_path / "results.json"
    ranks = launch(["tests/tp_worker.py", str(out), str(models), "cuda"], 2)
    assert [r.returncode for r in ranks] == [0, 0], ranks[0].stderr[-2000:]
    results = json.loads(out.read_text())
    assert any(c.endswith("/graphs") for c in results)
    differ = [case for case, r in results.items() if r["tp1"] != r["tpn"]]
    assert not differ, differ
