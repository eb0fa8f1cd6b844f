"""``fastpar plan``: JSON schema, the table, errors (exit 2, one message), calibration."""
import dataclasses
import json

import pytest

from fastpar.cli import main

KEYS = {"tp", "pp", "dp", "virtual_stages", "micro_batch_size", "schedule", "recompute",
        "step_time_s", "tflops_per_gpu", "mfu", "memory_gb_per_gpu"}
SMALL = ["plan", "--layers", "8", "--hidden", "1024", "--heads", "16", "--seq-len", "1024",
         "--global-batch-size", "32", "--gpus", "16", "--hardware", "a100-80gb"]


def test_one_configuration_json(capsys):
    assert main(SMALL + ["--tp", "2", "--pp", "2", "--micro-batch-size", "2",
                         "--schedule", "zb-h1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert isinstance(out, dict) and KEYS <= set(out)
    assert (out["tp"], out["pp"], out["dp"], out["schedule"]) == (2, 2, 4, "zb-h1")
    assert out["fits"] and out["step_time_s"] > 0


def test_search_json_is_a_list_best_first(capsys):
    assert main(SMALL + ["--top", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert isinstance(out, list) and len(out) == 3
    assert all(KEYS <= set(row) for row in out)
    assert [r["step_time_s"] for r in out] == sorted(r["step_time_s"] for r in out)


def test_table_says_why(capsys):
    assert main(SMALL + ["--pp", "2", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "TFLOP/s" in out and "best:" in out and "bubble" in out and "exposed TP" in out


def test_memory_rejection_exit_1(capsys):
    assert main(["plan", "--model", "70b", "--gpus", "8", "--hardware", "a100-40gb",
                 "--tp", "8", "--pp", "1", "--seq-len", "4096", "--global-batch-size", "8"]) == 1
    assert "rejected: needs" in capsys.readouterr().out


@pytest.mark.parametrize("args, words", [
    (["--tp", "3", "--pp", "1", "--gpus", "3", "--gpus-per-node", "3"], ["n_heads=16", "tp=3"]),
    (["--gpus", "12", "--gpus-per-node", "8"], ["gpus=12", "gpus_per_node=8"]),
    (["--hardware", "tpu-v9"], ["unknown hardware 'tpu-v9'"]),
    (["--global-batch-size", "30", "--tp", "1", "--pp", "1"], ["global batch 30", "1 x 16"]),
])
def test_bad_input_exits_2_with_one_message(capsys, args, words):
    base = [a for a in SMALL]
    for flag, value in zip(args[::2], args[1::2]):
        if flag in base:
            base[base.index(flag) + 1] = value
        else:
            base += [flag, value]
    assert main(base) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fastpar plan: error:") and len(err.splitlines()) == 1
    for w in words:
        assert w in err


def test_calibrate_writes_a_profile(tmp_path, capsys, monkeypatch):
    from fastpar.plan import calibrate as cal
    from fastpar.plan import load_hardware

    # Keep it fast: two GEMM shapes, one attention size; the rest is measured.
    monkeypatch.setattr(cal, "measure_matmul",
                        lambda d, t: (1e10, 5e-6, [(1e6, 5e9), (1e8, 1e10)]))
    monkeypatch.setattr(cal, "measure_attention", lambda d, t, o: [(1e6, 3e9)])
    monkeypatch.setattr(cal, "CPU_ROUNDS", 2)       # medians of rounds, in fewer of them
    assert main(["plan", "--calibrate", "--out", str(tmp_path / "cpu.json")]) == 0
    hw = load_hardware(tmp_path / "cpu.json")
    assert hw.peak_tflops == pytest.approx(0.01) and hw.bytes_per_element == 4
    assert hw.hbm_gbps > 0 and hw.name == "cpu" and hw.kind == "cpu"
    assert hw.matmul_curve == ((1e6, 0.5), (1e8, 1.0)) and hw.attention_efficiency == 0.3
    assert len(hw.memory_curve) >= 2 and hw.kernel_overhead_us >= 5.0
    # measured on fastpar's own layer: a forward's and a backward's per-operator overhead
    assert hw.forward_overhead_us >= 5.0 and hw.concurrent_ranks >= 1
    # a zero-bubble split backward's autograd calls, measured against a plain backward
    assert hw.split_call_us > 0
    # a training forward's writes of what it saves, against the same forward unrecorded
    assert hw.saved_gbps > 0
    # An existing profile is not replaced unasked; --overwrite replaces it (with a profile
    # measured as above: the file handling is what is tested here).
    monkeypatch.setattr(cal, "measure",
                        lambda name, repeats: dataclasses.replace(hw, name=f"again{repeats}"))
    before = (tmp_path / "cpu.json").read_bytes()
    capsys.readouterr()
    assert main(["plan", "--calibrate", "--out", str(tmp_path / "cpu.json")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "is an existing file: pass --overwrite" in err
    assert (tmp_path / "cpu.json").read_bytes() == before
    assert main(["plan", "--calibrate", "--out", str(tmp_path / "cpu.json"), "--overwrite"]) == 0
    assert load_hardware(tmp_path / "cpu.json").name == "again1"
    # --calibrate-repeats reaches the measurement; below 1 it is refused, the file kept
    assert main(["plan", "--calibrate", "--out", str(tmp_path / "cpu.json"), "--overwrite",
                 "--calibrate-repeats", "4"]) == 0
    assert load_hardware(tmp_path / "cpu.json").name == "again4"
    capsys.readouterr()
    assert main(["plan", "--calibrate", "--out", str(tmp_path / "cpu.json"), "--overwrite",
                 "--calibrate-repeats", "0"]) == 2
    err = capsys.readouterr().err
    assert err == "fastpar plan: error: --calibrate-repeats=0 must be >= 1\n"
    assert load_hardware(tmp_path / "cpu.json").name == "again4"


@pytest.mark.parametrize("gpus,cp", [(8, 1), (16, 1), (8, 2)])
def test_search_prints_the_train_command_of_its_best_layout(capsys, monkeypatch, gpus, cp):
    import fastpar.train.cli as cli
    from fastpar.train import TrainConfig

    plan = ["plan", "--model", "1b", "--gpus", str(gpus), "--seq-len", "2048",
            "--global-batch-size", "64", "--top", "1"] + (["--cp", str(cp)] if cp > 1 else [])
    assert main(plan + ["--json"]) == 0
    best = json.loads(capsys.readouterr().out)[0]
    assert main(plan) == 0
    out = capsys.readouterr().out
    line = out.split("run it:\n", 1)[1].splitlines()[0].strip()
    # The dry run it prints checks that layout here: the same memory per GPU as the plan's.
    check = out.split("check it first, here", 1)[1].splitlines()[1].split()
    assert check[-3:-2] == ["--dry-run"] and main(check[1:]) == 0
    need = capsys.readouterr().out.split("needs ", 1)[1].split(" GB")[0]
    assert float(need) == pytest.approx(best["memory_gb_per_gpu"], abs=0.051)
    if gpus == 8:
        assert line.startswith("fastpar train --model 1b") and line.endswith(f"--nproc {gpus}")
        argv = line.split()[1:]
    else:                                  # two nodes of 8: a torchrun line per node
        assert line.startswith("torchrun --nnodes 2 --nproc-per-node 8")
        argv = line.split("-m fastpar ", 1)[1].split("#")[0].split()
    seen = {}

    def fake_train(args):                  # the train command's own parser and checks
        opts = {k: v for k, v in vars(args).items()
                if k not in ("command", "version", "nproc", "max_restarts", "dry_run",
                             "hardware")}
        cfg = TrainConfig(**opts)
        seen["dp"] = cfg.check_layout(gpus).dp
        seen["cfg"] = cfg
        return 0
    monkeypatch.setattr(cli, "run_train", fake_train)
    assert main(argv) == 0
    cfg = seen["cfg"]
    got = dict(tp=cfg.tp, pp=cfg.pp, dp=seen["dp"], micro_batch_size=cfg.micro_batch_size,
               recompute=cfg.recompute, sequence_parallel=cfg.sequence_parallel,
               zero=cfg.zero, virtual_stages=cfg.virtual_stages, cp=cfg.cp)
    assert got == {k: best[k] for k in got}
    assert cfg.pp == 1 or cfg.schedule == best["schedule"]
    assert (cfg.global_batch_size, cfg.seq_len, cfg.model) == (64, 2048, "1b")


def test_hardware_file_missing_fields_exits_2_naming_each(tmp_path, capsys):
    path = tmp_path / "half.json"
    path.write_text(json.dumps({"peak_tflops": 100.0, "matmul_efficiency": 0.5,
                                "intra_node_gbps": 100.0, "inter_node_gbps": 10.0}))
    assert main(SMALL[:-1] + [str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("fastpar plan: error:")
    assert f"hardware file '{path}' lacks field(s) hbm_gb, hbm_gbps " in err
    assert "required: peak_tflops, matmul_efficiency, hbm_gb, hbm_gbps" in err
    assert "TypeError" not in err and "__init__" not in err


def test_nothing_fits_says_the_smallest_need_and_the_limit(capsys):
    from fastpar.models import get_config
    from fastpar.plan import BUILTIN, Cluster, Workload, search

    assert main(["plan", "--model", "70b", "--gpus", "8", "--hardware", "a100-40gb",
                 "--seq-len", "4096", "--global-batch-size", "8"]) == 1
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1
    _, rejected = search(Workload(get_config("70b").replace(max_seq_len=4096), 4096, 8),
                         Cluster(8, 8, BUILTIN["a100-40gb"]))
    need = rejected["smallest"].memory_gb_per_gpu
    assert need > 40
    assert out.startswith(f"no configuration fits: the smallest memory need is {need:.1f} GB "
                          f"per GPU (tp=")
    assert "more than the 40 GB of a100-40gb" in out
    assert f"({rejected['memory']:,} configurations rejected for memory)" in out
    assert "optimizer" in out and "activations" in out


def test_tp_folded_into_ep_in_the_table_and_the_train_command(capsys):
    """``--ep-fold-tp`` evaluates the folded layout (the table's fold column), refuses it
    without SP in one line, and a search pinned to it prints a train command carrying it."""
    moe = ["plan", "--model", "8x7b", "--gpus", "64", "--seq-len", "4096",
           "--global-batch-size", "512", "--recompute", "full"]
    assert main(moe + ["--tp", "2", "--pp", "4", "--ep", "8", "--ep-fold-tp",
                       "--sequence-parallel"]) == 0
    header, row = capsys.readouterr().out.splitlines()[:2]
    assert row.split()[header.split().index("fold")] == "on"
    assert main(moe + ["--tp", "2", "--pp", "4", "--ep", "8", "--ep-fold-tp"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--sequence-parallel" in err
    assert main(moe + ["--tp", "2", "--ep", "8", "--ep-fold-tp", "--top", "1",
                       "--schedule", "1f1b", "--micro-batch-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "--ep 8 --ep-fold-tp --sequence-parallel" in out and "--dry-run" in out
