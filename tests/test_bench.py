"""bench.py: the sweep runs and reports every row, the kernel audit sees what really ran (and flags a silent
fallback), memory is measured per step, and fused attention fits a larger batch. No test asserts a speed."""

import functools
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path
from types import SimpleNamespace

import matplotlib.image
import pytest
import torch

import bench
from benchmarks import bench_train, measure
from core import flops, runtime
from core.configurator import Settings
from model import IMPLEMENTATIONS
from conftest import REPO, runnable_on_cpu, strict_recompile_limit, bench_file
from core.runtime import Runtime

ROOT = Path(__file__).resolve().parents[1]
# A tiny model that still runs a real training step of every CPU-trainable implementation in well under a second.
TINY = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--seq_len=64", "--batch_size=2", "--vocab_size=101",
        "--iters=2", "--warmup=1", "--dtype=float32", "--threads=1", "--auto=False"]  # auto's row: its own test
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Behaviour, not speed, is under test: one thread keeps OpenMP threads from waiting on a descheduled
    sibling at every op on a shared CI machine (10x faster there). bench.main sets threads process-wide: the
    count is put back when the module is done (module-scoped, so it is read before the module's own fixtures run
    bench, and later files train with the process's own count)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def run_bench(tmp_path: Path, *args: str) -> dict:
    """The results of one bench run into tmp_path (another run's there beside them)."""
    before = set(tmp_path.glob("*.json"))
    assert bench.main([*TINY, f"--out_dir={tmp_path}", *args]) == 0
    mode = next((a.split("=", 1)[1] for a in args if a.startswith("--mode=")), "train")
    written = [p for p in tmp_path.glob(f"{mode}-*.json") if p not in before]
    assert len(written) == 1, written
    return json.loads(written[0].read_text())


def rows_by(result: dict, *keys: str) -> dict:
    return {tuple(row[k] for k in keys): row for row in result["rows"]}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    with pytest.MonkeyPatch.context() as patch:  # a datasheet peak to show MFU over, as a listed GPU has
        patch.setattr(flops, "peak_flops", lambda rt: 1e12)
        result = run_bench(out)
    return out, result


def test_sweep_has_a_row_per_attn_and_padding_with_time_throughput_memory_and_kernel(sweep):
    _, result = sweep
    rows = rows_by(result, "attn", "pad_vocab")
    assert set(rows) == {(a, p) for a in IMPLEMENTATIONS for p in (False, True)}
    ran = [row for row in rows.values() if row["status"] == "ok"]
    assert [row["attn"] for row in ran if not row["pad_vocab"]] == runnable_on_cpu(training=True)
    for row in ran:
        assert len(row["ms_all"]) == 2 and all(ms > 0 for ms in row["ms_all"])
        assert row["tokens_per_s"] > 0 and 0 < row["mfu"] < 1 and row["mem/peak_gb"] > 0
        assert row["kernel"] and row["kernel_ok"]
        assert row["vocab"] == (128 if row["pad_vocab"] else 101)
    assert result["environment"]["torch"] == torch.__version__ and result["environment"]["device_name"]


def test_cuda_only_kernels_and_flex_training_are_skipped_on_cpu_with_a_reason(sweep):
    rows = rows_by(sweep[1], "attn", "pad_vocab")
    for attn, words in (("efficient", "CUDA-only"), ("cudnn", "CUDA-only"), ("varlen", "CUDA-only"),
                        ("flex", "no backward")):
        for pad in (False, True):
            assert rows[(attn, pad)]["status"] == "skipped"
            assert words in rows[(attn, pad)]["reason"]


def test_chart_is_a_png_that_matplotlib_can_read(sweep):
    out, _ = sweep
    path = bench_file(out, "train.png")
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_audit_names_the_cpu_flash_kernel_for_sdpa_and_flash_and_none_for_manual(sweep):
    rows = rows_by(sweep[1], "attn", "pad_vocab")
    for attn in ("sdpa", "flash"):
        assert rows[(attn, False)]["kernel"] == "flash"
        assert rows[(attn, False)]["kernel_ops"] == ["aten::_scaled_dot_product_flash_attention_for_cpu"]
    assert rows[("math", False)]["kernel"] == "math"
    assert rows[("manual", False)]["kernel"] == "none" and rows[("manual", False)]["kernel_ops"] == []


def test_audit_labels_and_expectations():
    assert measure.kernel_of({"aten::bmm", "aten::_softmax"}) == ("none", [])
    assert measure.kernel_of({"aten::_scaled_dot_product_efficient_attention", "aten::mm"})[0] == "efficient"


def test_a_row_is_judged_by_the_set_of_kernels_it_ran():
    """A bf16 sdpa generation row on CUDA runs flash for the prompt and efficient for the masked decode steps."""
    cuda_sdpa = measure.expected_kernels("sdpa", "cuda")
    both, _ = measure.kernel_of({"aten::_scaled_dot_product_flash_attention",
                                 "aten::_scaled_dot_product_efficient_attention"})
    assert both == "efficient+flash" and measure.ran_as_expected(both, cuda_sdpa)
    assert not measure.ran_as_expected(both, measure.expected_kernels("flash", "cuda"))  # forced flash ran another
    assert not measure.ran_as_expected("flash+math", cuda_sdpa)  # a silent fallback next to a fused kernel


def test_on_cuda_the_audit_names_the_kernel_that_ran_not_the_op_that_launched_it():
    """Kernel names as the profiler shows them on Hopper: attn=flash's op may run cuDNN's kernel (its first choice
    there), and FA3/FA4 registered in place of PyTorch's flash op would run under the same op."""
    flash_op = "aten::_scaled_dot_product_flash_attention"
    fa2 = "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, bf16>>"
    cudnn = "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64_4x1x1_kernel0_0"
    fa4 = "kernel_cutlass_flash_attn_FlashAttentionForwardSm90_object_at_0x7f"
    cudnn_op = "aten::_scaled_dot_product_cudnn_attention"
    assert measure.kernel_of({flash_op, fa2, "aten::mm"}) == ("flash", [flash_op, fa2])
    assert measure.kernel_of({cudnn_op, cudnn})[0] == "cudnn"
    assert measure.kernel_of({flash_op, fa4})[0] == "fa3_fa4"
    flash = measure.expected_kernels("flash", "cuda")
    assert measure.ran_as_expected("cudnn", flash) and measure.ran_as_expected("flash", flash)
    assert not measure.ran_as_expected("fa3_fa4", flash)  # not what the record says it runs: flagged
    assert measure.expected_kernels("flash2", "cuda") == {"flash"}
    assert measure.kernel_of({"aten::_scaled_dot_product_flash_attention_for_cpu"})[0] == "flash"  # a CPU: ops only
    # varlen runs FlashAttention's varlen kernel under its own op (seen on an H200, torch 2.11): still varlen, also
    # beside a decode step's SDPA call through cuDNN
    varlen = "torch_attn::_varlen_attn"
    assert measure.kernel_of({varlen, fa2})[0] == "varlen"
    assert measure.kernel_of({varlen, fa2, cudnn_op, cudnn})[0] == "cudnn+varlen"


@pytest.mark.slow  # compiles flex with inductor
def test_a_compiled_flex_call_is_audited_as_flex(monkeypatch):
    """CUDA always runs flex through torch.compile, whose call records no FlexAttention op: the audit reads the
    region model.py names instead. Run here by compiling CPU flex as CUDA would."""
    import model
    monkeypatch.setattr(model, "COMPILE_FLEX_OFF_CUDA", True)
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))  # (B, nh, T, hs)
    with torch.no_grad():
        IMPLEMENTATIONS["flex"](q, k, v, None, 0.0)  # compiles, unprofiled
        ops, _ = measure.profiled_run(lambda: IMPLEMENTATIONS["flex"](q, k, v, None, 0.0), Runtime("cpu", "float32"))
    assert "FlexAttentionAutogradOp" not in ops  # what the audit used to look for is not there when compiled
    assert measure.kernel_of(ops)[0] == "flex"


def test_sdpa_with_dropout_on_cpu_falls_back_to_math_and_is_flagged(tmp_path, capsys):
    result = run_bench(tmp_path, "--attn=sdpa,flash", "--padding=off", "--dropout=0.1")
    rows = rows_by(result, "attn")
    assert rows[("sdpa",)]["kernel"] == "math" and rows[("sdpa",)]["kernel_ok"] is False
    assert rows[("manual",)]["kernel_ok"] is True  # added as the baseline, and dropout changes nothing for it
    assert rows[("flash",)]["status"] == "skipped" and "dropout" in rows[("flash",)]["reason"]
    out = capsys.readouterr().out
    assert "! sdpa ran math" in out and "expected flash" in out


def test_cpu_step_memory_is_the_peak_of_live_tensor_bytes():
    def call():
        a = torch.ones(1_000_000)   # 4 MB
        b = torch.ones(1_000_000)   # 4 MB more: 8 MB live
        del a, b
        torch.ones(500_000)         # 2 MB after both were freed: the peak stays 8 MB
    _, added = measure.profiled_run(call, Runtime("cpu", "float32"))
    assert 8_000_000 <= added < 8_100_000


def test_max_batch_size_doubles_then_bisects_to_the_largest_that_fits():
    probes = []

    def fits_up_to(n):
        def fits(b):
            probes.append(b)
            return b <= n
        return fits
    assert measure.max_batch_size(fits_up_to(37), limit=256) == 37
    assert probes[:7] == [1, 2, 4, 8, 16, 32, 64] and len(probes) <= 12
    assert measure.max_batch_size(fits_up_to(1000), limit=48) == 48
    assert measure.max_batch_size(fits_up_to(0), limit=48) == 0


@pytest.mark.slow  # a real search: a dozen training steps at T=256 (the search itself is unit-tested above)
def test_sdpa_fits_a_larger_batch_than_manual_at_a_long_sequence_under_a_cpu_memory_budget(tmp_path):
    # At T=256 manual attention holds several (B, nh, T, T) score tensors per layer; the flash kernel holds
    # O(T) per head. The vocabulary is tiny so attention dominates memory.
    result = run_bench(tmp_path, "--attn=manual,sdpa", "--padding=off", "--seq_len=256", "--n_head=4",
                       "--vocab_size=64", "--max_batch=True", "--mem_budget_gb=0.012", "--max_batch_limit=64",
                       "--iters=1", "--warmup=0")
    rows = rows_by(result, "attn")
    assert 1 <= rows[("manual",)]["max_batch"] < rows[("sdpa",)]["max_batch"]


@pytest.mark.slow  # multi-second end to end: the whole suite runs it
def test_the_chunked_loss_row_takes_less_memory_and_fits_a_larger_batch_than_the_whole_logits(tmp_path):
    # a wide vocabulary at a narrow model: the (B*T, V) logits, their softmax and gradient are most of a step's memory
    result = run_bench(tmp_path, "--attn=manual", "--padding=on", "--loss=chunked,whole", "--vocab_size=8191",
                       "--max_batch=True", "--mem_budget_gb=0.05", "--max_batch_limit=64", "--iters=1", "--warmup=0")
    rows = rows_by(result, "loss")
    chunked, whole = rows[("chunked",)], rows[("whole",)]
    assert chunked["vocab"] == whole["vocab"] == 8192
    assert chunked["mem/peak_gb"] < 0.75 * whole["mem/peak_gb"]
    assert 1 <= whole["max_batch"] < chunked["max_batch"]


@pytest.mark.slow  # multi-second end to end: the whole suite runs it
def test_attention_mode_measures_forward_and_backward_and_manual_needs_more_memory(tmp_path):
    result = run_bench(tmp_path, "--mode=attention", "--attn=manual,flash,flex", "--attn_seq_lens=128",
                       "--attn_head_sizes=16", "--attn_heads=2")
    rows = rows_by(result, "attn", "backward")
    # uncompiled on a CPU, flex runs PyTorch's unfused reference: the audit names it, and it is what the row expects
    assert rows[("flex", False)]["status"] == "ok" and rows[("flex", False)]["kernel"] == "flex_eager"
    assert rows[("flex", False)]["kernel_ok"]
    assert rows[("flex", False)]["eager_reference"] and not rows[("flash", False)]["eager_reference"]
    assert rows[("flex", True)]["status"] == "skipped"  # no backward on CPU
    for backward in (False, True):
        assert rows[("flash", backward)]["kernel"] == "flash"
        # manual materialises (B, nh, T, T) scores: at least 2 * 128 * 128 floats more than flash
        assert rows[("manual", backward)]["mem/peak_gb"] - rows[("flash", backward)]["mem/peak_gb"] >= 131_072 / 1e9
    assert bench_file(tmp_path, "attention.png").read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.slow  # multi-second end to end: the whole suite runs it
def test_the_mask_axis_gives_a_row_per_mask_with_the_share_of_scores_each_kernel_computes(tmp_path):
    """Documents of 32 tokens in blocks of 128 (flex's block size): flex computes the 4 diagonal blocks of 16 and
    skips the rest; the mask lets through 33/64 of each 32 x 32 diagonal block."""
    result = run_bench(tmp_path, "--mode=attention", "--attn=manual,flash,flex,varlen", "--attn_seq_lens=128",
                       "--attn_head_sizes=16", "--attn_heads=2", "--mask=causal,doc,window", "--doc_len=32",
                       "--window=16")
    rows = rows_by(result, "attn", "backward", "mask")
    assert len(rows) == 4 * 2 * 3
    doc, causal = rows[("flex", False, "doc")], rows[("flex", False, "causal")]
    assert doc["status"] == "ok" and doc["kernel"] == "flex_eager" and doc["computed"] == 1.0  # one 128-block
    assert doc["visible"] == pytest.approx(4 * (32 * 33 / 2) / 128 ** 2)
    assert causal["visible"] == pytest.approx(128 * 129 / 2 / 128 ** 2)
    for mask in ("causal", "doc", "window"):
        assert rows[("manual", True, mask)]["computed"] == 1.0 and rows[("manual", True, mask)]["kernel"] == "none"
        assert rows[("flash", True, mask)]["kernel"] == "flash" and rows[("flash", True, mask)]["kernel_ok"]
        assert "CUDA-only" in rows[("varlen", False, mask)]["reason"]
    assert rows[("flash", True, "causal")]["computed"] == rows[("flash", True, "causal")]["visible"]
    assert rows[("flash", True, "doc")]["computed"] == 1.0  # an explicit mask: every score, then masked
    assert rows[("manual", True, "window")]["visible"] == pytest.approx(
        sum(min(i + 1, 16) for i in range(128)) / 128 ** 2)


def test_a_training_row_with_documents_takes_them_from_a_datasets_end_of_text(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    tokens = torch.randint(0, 50, (4000,))
    tokens[::100] = 50  # a document every 100 tokens
    tokens.numpy().astype("uint16").tofile(data / "train.bin")
    (data / "meta.json").write_text(json.dumps({"tokenizer": "gpt2", "vocab_size": 51, "eot_token": 50}))
    result = run_bench(tmp_path, "--attn=manual,sdpa,flex", "--padding=off", "--mask=causal,doc",
                       f"--doc_data={data}")
    rows = rows_by(result, "attn", "mask")
    assert rows[("sdpa", "doc")]["status"] == "ok" and rows[("sdpa", "doc")]["kernel"] == "flash"
    assert rows[("manual", "doc")]["speedup_vs_manual"] == 1.0
    # 2 blocks of 64 tokens, documents of 100: a block holds at most one boundary, so it sees no less than two
    # 32-token triangles (a boundary in the middle) and, here where one block or both cross one, less than causal
    assert 2 * (32 * 33 / 2) / 64 ** 2 <= rows[("sdpa", "doc")]["visible"] < rows[("sdpa", "causal")]["visible"]
    assert "no backward" in rows[("flex", "doc")]["reason"]


def test_bench_prints_the_table_and_writes_json_chart_and_chrome_trace(tmp_path, capsys):
    # in process: the command line's own wiring (exit codes, one-line errors) is the subprocess test below
    assert bench.main([*TINY, "--attn=manual,flash", "--padding=on", "--profile=True", f"--out_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "manual" in out and "flash" in out and "speedup" in out
    assert json.loads(bench_file(tmp_path, "train.json").read_text())["config"]["attn"] == ["manual", "flash"]
    assert bench_file(tmp_path, "train.png").read_bytes()[:8] == PNG_SIGNATURE
    trace = json.loads((tmp_path / "trace_train_flash_padded.json").read_text())
    assert any("flash_attention" in event.get("name", "") for event in trace["traceEvents"])


@pytest.mark.slow  # a fresh interpreter importing torch: what only the command line shows
def test_the_command_line_prints_a_bad_setting_as_one_line_on_stderr_and_exit_code_2(tmp_path):
    proc = subprocess.run([sys.executable, "bench.py", "--attn=fast", f"--out_dir={tmp_path}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: attn must be a comma list of 'all', "
                                                + ", ".join(map(repr, IMPLEMENTATIONS)) + ", got 'fast'; did you mean "
                                                "'flash'?"]


def test_the_auto_row_shows_what_attn_auto_picks_beside_the_fastest_row_of_the_same_run(tmp_path, capsys):
    # every implementation a CPU trains with: whatever auto measures fastest here, the sweep ran it too
    result = run_bench(tmp_path, "--attn=manual,sdpa_mask,sdpa,flash,math", "--padding=off", "--auto=True",
                       "--attn_auto_budget=1")
    auto = rows_by(result, "attn")[("auto",)]
    ran = {row["attn"]: row for row in result["rows"] if row["status"] == "ok" and row["attn"] != "auto"}
    assert auto["auto_pick"] in ran and auto["fastest"] == min(ran, key=lambda a: ran[a]["ms_per_iter"])
    assert auto["ms_per_iter"] == ran[auto["auto_pick"]]["ms_per_iter"]  # the pick's own row, measured here...
    assert auto["same_as"] == auto["auto_pick"]  # ...and said to be that row's, not a second measurement
    assert isinstance(auto["within_noise"], bool) and auto["pick_vs_fastest"] > 0
    assert auto["auto_line"].startswith("attn=auto: ") and ", training; " in auto["auto_line"]
    assert f"auto -> {auto['auto_pick']} (its row's timing)" in capsys.readouterr().out  # the table's row


@pytest.mark.parametrize("attn, loss", [("sdpa_mask", "chunked"), ("manual", "chunked,whole")])
def test_an_attn_list_without_autos_pick_ends_with_its_table_and_an_auto_row_that_says_so(tmp_path, capsys, attn,
                                                                                          loss, monkeypatch):
    monkeypatch.setattr(bench_train, "choose", lambda *args: SimpleNamespace(pick="flash"))  # a pick it did not run
    result = run_bench(tmp_path, f"--attn={attn}", f"--loss={loss}", "--auto=True", "--attn_auto_budget=1")
    autos = [row for row in result["rows"] if row["attn"] == "auto"]
    assert len(autos) == 2 * len(loss.split(",")) and all(row["status"] == "skipped" for row in autos)
    assert all(row["reason"] == "auto picked flash, which this sweep did not run" for row in autos)
    assert "auto -> flash" in capsys.readouterr().out and bench_file(tmp_path, "train.png").exists()


def test_speedup_pairs_iterations_so_drift_that_hits_every_row_cancels():
    manual = {"ms_all": [100.0, 1000.0, 100.0]}   # the machine got 10x slower during iteration 2
    fused = {"ms_all": [50.0, 500.0, 60.0]}
    assert bench.paired_speedup(manual, fused) == 2.0


# -- compiled rows ------------------------------------------------------------------------------------------

@pytest.fixture()
def no_recompile_fallback(monkeypatch):
    """Dynamo raises instead of silently running a row eagerly past its recompile limit; its eager backend keeps
    compilation fast (the recompile bookkeeping is dynamo's, whatever the backend)."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    with strict_recompile_limit():
        yield
    torch._dynamo.reset()


@pytest.mark.slow  # dynamo traces 18 flex variants
def test_a_compiled_attention_sweep_gives_every_row_its_own_recompile_budget(tmp_path, no_recompile_fallback):
    """Head sizes x lengths x masks: more flex variants than one compiled callable's limit (16). One callable for
    the whole sweep ran the later rows on flex's unfused reference, still labelled flex; with dynamo told to raise
    at the limit, such a sweep fails here."""
    result = run_bench(tmp_path, "--compile=True", "--mode=attention", "--attn=flex", "--attn_head_sizes=16,32",
                       "--attn_seq_lens=128,256,384", "--mask=causal,doc,window", "--doc_len=64", "--window=32",
                       "--attn_heads=2", "--iters=1", "--warmup=0")
    ran = [row for row in result["rows"] if row["status"] == "ok"]
    assert len([row for row in ran if row["attn"] == "flex"]) == 2 * 3 * 3  # forward only: no backward on a CPU
    assert all(row["recompile_limit_hits"] == 0 and row["graphs_compiled"] >= 1 for row in ran)  # manual's too


@pytest.mark.slow  # dynamo traces ten models
def test_a_compiled_sweep_runs_every_cpu_row_compiled(tmp_path, no_recompile_fallback, monkeypatch):
    """Each row's forward is compiled apart. A GPU sweeps 12 attns per padding and mask, past a shared forward's
    limit of 8; here 5 run per padding, so the limit is made 2 to stand for it."""
    monkeypatch.setattr(runtime, "compile_isolated", functools.partial(runtime.compile_isolated, recompile_limit=2))
    result = run_bench(tmp_path, "--compile=True")  # 5 trainable attns x 2 paddings
    ran = [row for row in result["rows"] if row["status"] == "ok"]
    assert len(ran) == 10 and all(row["kernel_ok"] and row["recompile_limit_hits"] == 0 for row in ran)


@pytest.mark.slow
def test_compiled_rows_are_audited_through_an_eager_twin_so_inductor_decompositions_are_not_fallbacks(tmp_path):
    result = run_bench(tmp_path, "--compile=True", "--attn=math,sdpa", "--padding=off", "--iters=1")
    rows = rows_by(result, "attn")
    assert rows[("math",)]["kernel"] == "math" and rows[("sdpa",)]["kernel"] == "flash"
    assert all(row["kernel_ok"] and row["kernel_audit"] == "eager twin" for row in rows.values())
    attention = run_bench(tmp_path, "--compile=True", "--mode=attention", "--attn=flex", "--attn_seq_lens=128",
                          "--attn_head_sizes=16", "--attn_heads=2", "--iters=1")
    flex = rows_by(attention, "attn", "backward")[("flex", False)]
    assert flex["status"] == "ok" and flex["kernel"] == "flex" and not flex["eager_reference"]
    torch._dynamo.reset()


# -- out of memory --------------------------------------------------------------------------------------------

def test_a_row_that_runs_out_of_memory_is_reported_and_the_others_finish(tmp_path, monkeypatch, capsys):
    step = bench_train.SharedTrainer.step

    def step_or_oom(self, attn):
        if attn == "math":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        step(self, attn)
    monkeypatch.setattr(bench_train.SharedTrainer, "step", step_or_oom)
    rows = rows_by(run_bench(tmp_path, "--attn=manual,math,sdpa", "--padding=off"), "attn")
    assert rows[("math",)]["status"] == "oom" and "Tried to allocate 9.00 GiB" in rows[("math",)]["reason"]
    assert rows[("manual",)]["status"] == rows[("sdpa",)]["status"] == "ok"
    assert "oom: out of memory" in capsys.readouterr().out


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_max_batch_takes_two_full_steps_catches_every_oom_flavour_and_frees_each_probe(monkeypatch, device):
    probes = []

    class Trainer:  # stands in for a real one: the second step (the first with AdamW's state) runs out
        def __init__(self, batch_size):
            self.batch_size, self.steps = batch_size, 0

        def step(self, attn):
            self.steps += 1
            if self.batch_size > 5 and self.steps == 2:
                raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
            if self.batch_size > 40:
                raise RuntimeError("CUDA error: out of memory")

        def resident_bytes(self):
            return 0

    def build_trainer(cfg, rt, attn, pad_vocab, batch_size, mask="causal", loss="chunked"):
        assert all(probe() is None for probe in probes)  # the previous probe's trainer is gone
        trainer = Trainer(batch_size)
        probes.append(weakref.ref(trainer))
        return trainer
    monkeypatch.setattr(bench_train, "build_trainer", build_trainer)  # what fits() builds each probe with
    cfg = Settings(mem_budget_gb=1.0)
    rt = bench.Runtime(device, "float32")
    assert measure.max_batch_size(lambda b: bench.fits(cfg, rt, "manual", False, b), limit=16) == 5
    assert len(probes) > 3


def test_max_batch_does_not_swallow_errors_that_are_not_out_of_memory(monkeypatch):
    def build_trainer(cfg, rt, attn, pad_vocab, batch_size, mask="causal", loss="chunked"):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    monkeypatch.setattr(bench_train, "build_trainer", build_trainer)  # what fits() builds each probe with
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        bench.fits(Settings(mem_budget_gb=1.0), bench.Runtime("cpu", "float32"), "manual", False, 4)


# -- generate mode ----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_generate_mode_times_every_attn_weights_and_cache_row_and_each_draws_the_cache_free_tokens(tmp_path,
                                                                                                 monkeypatch):
    from tools import decoding
    # untuned compiling: the same graphs in seconds (tuning and frozen weights are tested in test_generate.py)
    monkeypatch.setattr(decoding, "AUTOTUNE", False)
    # 1 + 24 tokens cross block_size 16, so the cache rows refill too
    result = run_bench(tmp_path, "--mode=generate", "--attn=sdpa", "--seq_len=16", "--new_tokens=24",
                       "--gen_batch=2", "--weights=float32,int8", "--iters=1")
    rows = rows_by(result, "attn", "weights", "cache")
    assert set(rows) == {(a, w, c) for a in ("manual", "sdpa") for w in ("float32", "int8")
                         for c in ("none", "cache", "compiled")}
    nanogpt = rows["sdpa", "float32", "none"]
    assert nanogpt["speedup_vs_nanogpt"] == 1.0  # the baseline, paired with itself
    for (attn, weights, cache), row in rows.items():
        assert row["status"] == "ok", row
        assert row["same_tokens_as_no_cache"] is True and len(row["tokens"]) == 2
        assert row["tokens_per_s"] == pytest.approx(2 * 24 / (row["ms_per_call"] / 1e3))
        assert 0 < row["prefill_ms"] < row["ms_per_call"] and row["ms_per_token"] > 0
        assert row["kernel_ok"], row["kernel"]
        # k and v of 1 layer: 2 x (batch 2, 2 heads, block 16, head size 16) fp32 values
        assert row["kv_cache_bytes"] == (0 if cache == "none" else 2 * (2 * 2 * 16 * 16) * 4)
        assert row["mem/peak_gb"] * 1e9 >= row["weight_bytes"] + row["kv_cache_bytes"]
        assert (row["compile_s"] is None) == (cache != "compiled")
    assert rows["sdpa", "int8", "cache"]["weight_bytes"] < 0.6 * rows["sdpa", "float32", "cache"]["weight_bytes"]
    assert bench_file(tmp_path, "generate.png").read_bytes().startswith(PNG_SIGNATURE)


def test_without_torchao_the_int8_rows_are_skipped_in_its_sentence_and_the_others_run(tmp_path, monkeypatch, capsys):
    """The GPU image has no torchao: the default generate sweep (int8 among its weights) still runs."""
    for name in ("torchao", "torchao.quantization"):
        monkeypatch.setitem(sys.modules, name, None)  # import torchao fails, as where it is not installed
    result = run_bench(tmp_path, "--mode=generate", "--attn=sdpa", "--seq_len=16", "--new_tokens=4",
                       "--weights=float32,int8", "--cache=none,cache", "--iters=1")
    rows = rows_by(result, "attn", "weights", "cache")
    assert {k: r["status"] for k, r in rows.items()} == {
        (a, w, c): "ok" if w == "float32" else "skipped" for a in ("manual", "sdpa") for w in ("float32", "int8")
        for c in ("none", "cache")}
    assert all(r["reason"] == "--quantize=int8 needs torchao; pip install torchao." for r in rows.values()
               if r["weights"] == "int8")


def test_an_interrupted_generate_sweep_keeps_the_rows_it_measured(tmp_path, monkeypatch, capsys):
    from benchmarks import bench_generate
    real = bench_generate.time_round_robin

    def ctrl_c_in_round_two(calls, iters, rt, bar, failed, after_round):
        def after(ms):
            after_round(ms)
            raise KeyboardInterrupt  # what Ctrl-C (or a timeout's SIGINT) raises, once round 1 is done
        return real(calls, iters, rt, bar, failed, after)
    monkeypatch.setattr(bench_generate, "time_round_robin", ctrl_c_in_round_two)
    args = [*TINY, "--mode=generate", "--attn=sdpa", "--seq_len=16", "--new_tokens=4", "--weights=float32",
            "--cache=none,cache", "--iters=3", f"--out_dir={tmp_path}"]
    assert bench.main(args) == 130
    assert capsys.readouterr().err.strip().endswith(f"interrupted; what was measured is in {bench_file(tmp_path, 'generate.json')}")
    saved = json.loads(bench_file(tmp_path, "generate.json").read_text())
    assert saved["complete"] is False and len(saved["rows"]) == 4  # manual and sdpa x no cache and cache
    for row in saved["rows"]:
        assert row["rounds"] == 1 and len(row["ms_all"]) == 1 and row["tokens_per_s"] > 0 and row["kernel_ok"]


@pytest.mark.parametrize("capability,weights", [("AVX2", ["float32", "int8"]),
                                                ("AVX512_BF16", ["float32", "bfloat16", "int8"])])
def test_generate_defaults_on_a_cpu_are_a_few_rows_with_bf16_only_where_it_is_native(monkeypatch, capability,
                                                                                       weights):
    monkeypatch.setattr(runtime, "cpu_capability", lambda: capability)
    cfg, rt = bench.settings(["--mode=generate", "--device=cpu"])
    assert cfg.attn == ["manual", "sdpa"] and cfg.weights == weights and cfg.cache == ["none", "cache", "compiled"]
    compiled = 2 * len(weights)
    assert bench.sweep_plan(cfg, rt).startswith(
        f"generate: {2 * len(weights) * 3} rows, {compiled} of them compiled, 2 timed rounds of 127 tokens; each "
        f"compiled row compiles once (20-60 s on 2 CPU cores at 6 x 384, nanoGPT's shakespeare_char size), so "
        f"compiling alone takes about {compiled * 20 / 60:.1f}-{compiled * 60 / 60:.1f} min")


def test_generate_defaults_on_a_gpu_compile_two_rows_and_say_how_long_that_takes_before_starting(monkeypatch):
    """A GPU's default generate sweep once compiled 9 rows of GPT-2 124M (7 minutes on an H200, 44-57 s a row): now
    the baselines' bf16 rows, 2 compiled, and the plan line says what compiling will cost. CUDA stood in for."""
    monkeypatch.setattr(bench.runtime, "resolve_runtime", lambda device, dtype, threads=0: Runtime("cuda:0", "bfloat16"))
    cfg, rt = bench.settings(["--mode=generate"])
    assert (cfg.attn, cfg.weights, cfg.cache, cfg.n_layer, cfg.new_tokens) == (
        ["manual", "sdpa"], ["bfloat16"], ["none", "cache", "compiled"], 12, 127)
    assert bench.sweep_plan(cfg, rt).startswith(
        "generate: 6 rows, 2 of them compiled, 3 timed rounds of 127 tokens; each compiled row compiles once (7-60 s "
        "on an H200 at GPT-2 124M), so compiling alone takes about 0.2-2.0 min")


def test_generate_mode_refuses_unknown_weights_and_caches_in_one_sentence(tmp_path):
    with pytest.raises(bench.UserError, match="weights must be a comma list of 'float32', 'bfloat16', 'int8', got 'int4'"):
        bench.main([*TINY, "--mode=generate", "--weights=int4", f"--out_dir={tmp_path}"])
    with pytest.raises(bench.UserError, match="cache must be a comma list of 'none', 'cache', 'compiled', got 'static'"):
        bench.main([*TINY, "--mode=generate", "--cache=static", f"--out_dir={tmp_path}"])


def test_the_train_chart_keeps_every_implementation_name_legible_at_a_gpus_full_sweep(tmp_path):
    """A GPU's default sweep: nine implementations and auto, padded and not (the H200's medians, issue 36). No
    two implementation names may overlap, and every name and value label lies inside the picture."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from types import SimpleNamespace
    from benchmarks.bench_report import chart, ms_chart
    h200 = {"manual": (73.7, 60.8), "sdpa_mask": (42.1, 29.4), "sdpa": (40.2, 27.2), "flash": (40.6, 27.7),
            "efficient": (42.9, 30.1), "cudnn": (39.5, 27.1), "math": (70.4, 57.8), "flex": (45.4, 32.1),
            "varlen": (43.0, 32.4), "auto": (40.2, 27.2)}
    rows = [dict(attn=a, pad_vocab=pad, mask="causal", loss="chunked", status="ok", ms_per_iter=ms[pad],
                 ms_p25=ms[pad] * 0.99, ms_p75=ms[pad] * 1.01) for a, ms in h200.items() for pad in (False, True)]
    cfg = SimpleNamespace(mode="train", mask=["causal"], padding=[False, True], loss=["chunked"], attn=list(h200),
                          n_layer=12, n_embd=768, batch_size=8, seq_len=1024, dtype="bfloat16", dropout=0.0)
    fig, ax = plt.subplots()
    ms_chart(ax, rows, cfg)
    fig.tight_layout()
    fig.canvas.draw()
    names = [t for t in ax.get_yticklabels() if t.get_text()]
    assert [t.get_text() for t in names] == list(h200)
    boxes = [t.get_window_extent() for t in names]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    picture = fig.bbox
    assert all(picture.x0 <= b.x0 and b.x1 <= picture.x1 for b in boxes + [t.get_window_extent() for t in ax.texts])
    plt.close(fig)
    chart(tmp_path / "train.png", rows, cfg, {"device_name": "NVIDIA H200"})
    assert (tmp_path / "train.png").read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.parametrize("mode", ["attention", "generate", "train"])
def test_every_chart_reads_lengths_from_zero_on_a_linear_axis_with_each_value_written(mode):
    """A log axis that starts near the shortest bar made 38 against 77 ms look 1:8 (issue 54): every mode's bars
    start at zero on a linear axis, each labelled with its value; a row whose kernel fell back says so."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from types import SimpleNamespace
    from benchmarks.bench_generate import generate_chart
    from benchmarks.bench_report import ms_chart
    fig, ax = plt.subplots()
    if mode == "generate":
        rows = [dict(attn=a, weights="float32", cache=c, pad_vocab=False, status="ok", tokens_per_s=s)
                for a, c, s in (("manual", "none", 52.0), ("manual", "cache", 431.0), ("sdpa", "none", 60.0))]
        generate_chart(ax, rows, SimpleNamespace(padding=[False], cache=["none", "cache"], n_layer=1, n_embd=8,
                                                 seq_len=16, new_tokens=4, prompt_len=2, gen_batch=1))
        low, high, scale, values = *ax.get_ylim(), ax.get_yscale(), ["52", "431", "60"]
    else:
        rows = [dict(attn=a, pad_vocab=False, mask="causal", loss="chunked", status="ok", ms_per_iter=ms,
                     ms_p25=ms, ms_p75=ms, head_size=16, seq_len=64, backward=True, kernel=kernel,
                     kernel_ok=kernel != "math") for a, ms, kernel in (("manual", 76.7, "none"), ("sdpa", 38.2, "math"))]
        ms_chart(ax, rows, SimpleNamespace(mode=mode, mask=["causal"], padding=[False], loss=["chunked"],
                                           attn=["manual", "sdpa"], n_layer=1, n_embd=8, batch_size=1, seq_len=64,
                                           dropout=0.1, attn_head_sizes=[16], attn_seq_lens=[64]))
        low, high, scale, values = *ax.get_xlim(), ax.get_xscale(), ["76.7", "38.2  ! ran math"]
    labels = [t.get_text() for t in ax.texts]
    assert scale == "linear" and low == 0 and high > max(431.0 if mode == "generate" else 76.7, 0)
    assert all(v in labels for v in values), labels
    plt.close(fig)


def test_the_generate_tables_baseline_is_named_for_what_it_is():
    """nanoGPT's generate runs SDPA's is_causal kernel wherever torch has it, with no cache: the column says so (it
    once read only "vs nanoGPT", which readers took for nanoGPT's manual attention)."""
    from benchmarks.bench_report import GENERATE_COLUMNS, format_table
    row = dict(attn="sdpa", weights="float32", cache="none", pad_vocab=False, vocab=65, status="ok",
               speedup_vs_nanogpt=1.0, tokens_per_s=10.0, ms_per_call=1.0, prefill_ms=0.1, ms_per_token=0.1,
               compile_s=None, weight_bytes=1, kv_cache_bytes=0, **{"mem/peak_gb": 0.1}, kernel="flash",
               kernel_ok=True, kernel_expected=["flash"], same_tokens_as_no_cache=True)
    header = format_table([row], GENERATE_COLUMNS).splitlines()[0]
    assert "vs nanoGPT (sdpa, no cache)" in header


def test_skipped_rows_share_a_numbered_reason_written_once_below_the_table():
    """A CPU sweep skips most of its rows for a few reasons (GPU-only kernels): an implementation's rows that share a
    reason are one line, and each reason is written out once."""
    from benchmarks.bench_report import TRAIN_COLUMNS, format_table
    cuda_only = "the cuDNN kernel is CUDA-only"
    rows = [dict(attn=a, pad_vocab=pad, vocab=8191 + pad, mask="causal", status="skipped", reason=cuda_only)
            for a in ("cudnn", "efficient") for pad in (False, True)]
    rows.append(dict(attn="flex", pad_vocab=False, vocab=8191, mask="causal", status="skipped", reason="no backward"))
    table = format_table(rows, TRAIN_COLUMNS).splitlines()
    assert [line.split() for line in table[2:5]] == [["cudnn", "2", "rows", "skipped", "(1)"],
                                                     ["efficient", "2", "rows", "skipped", "(1)"],
                                                     ["flex", "8191", "unpadded", "causal", "skipped", "(2)"]]
    assert table[5:7] == [f"(1) skipped: {cuda_only}", "(2) skipped: no backward"]
    assert table[7].startswith("paired speedup: the median over timed rounds of manual's ms / the row's in the same "
                               "round")  # the column says what it is, under the table itself


def test_a_row_whose_spread_swamps_its_median_shows_no_speedup():
    from benchmarks.bench_report import ATTENTION_COLUMNS, format_table
    row = dict(attn="sdpa", head_size=64, seq_len=512, backward=False, mask="causal", status="ok", ms_per_iter=2.0,
               ms_p25=1.0, ms_p75=9.0, **{"mem/peak_gb": 0.1}, speedup_vs_manual=3.91, computed=0.5, kernel="flash",
               kernel_ok=True)
    table = format_table([row, {**row, "ms_p75": 2.5}], ATTENTION_COLUMNS)
    assert "3.91x" in table.splitlines()[3] and "unreliable" in table.splitlines()[2] and "3.91x" not in \
        table.splitlines()[2]
    assert table.splitlines()[-1].startswith("unreliable: the row's spread (IQR) exceeds its median")


def test_runs_into_the_same_folder_each_write_their_own_results(tmp_path, capsys):
    first = run_bench(tmp_path, "--attn=manual", "--padding=off")
    second = run_bench(tmp_path, "--attn=sdpa", "--padding=off")
    saved = sorted(tmp_path.glob("train-*.json"))
    assert len(saved) == 2 and len(list(tmp_path.glob("train-*.png"))) == 2
    assert sorted(json.dumps(json.loads(p.read_text())["rows"]) for p in saved) == sorted(
        json.dumps(run["rows"]) for run in (first, second))
    assert first["rows"] != second["rows"]


def test_the_note_under_the_table_says_what_its_own_rows_say_of_padding():
    """A fixed sentence that padding 'costs the extra rows of lm_head' stood under tables whose padded rows ran
    faster: the note is counted from the rows."""
    from benchmarks.bench_report import padding_note
    rows = [dict(attn=a, mask="causal", loss="chunked", pad_vocab=p, status="ok", ms_per_iter=ms)
            for a, p, ms in (("manual", False, 10.0), ("manual", True, 9.0), ("sdpa", False, 5.0), ("sdpa", True, 6.0),
                             ("flash", False, 4.0), ("flash", True, 3.0))]
    assert padding_note(rows) == ("padded vocabulary faster in 2 of 3 pairs of rows here (median time ratio "
                                  "0.90x the unpadded row's); why PyTorch's post expects it on a GPU: docs/bench.md")
    assert "says nothing of padding" in padding_note(rows[:1] + rows[3:4])


def test_a_speedup_over_an_unreliable_baseline_reads_unreliable(tmp_path, capsys):
    """manual's IQR 190 ms over a median of 113: every row measured against it says 'unreliable', not a speedup;
    and a fallback seen in both paddings of one implementation is one `!` line, not two."""
    from benchmarks.bench_report import TRAIN_COLUMNS, format_table, speedup_cell
    assert speedup_cell(dict(ms_per_iter=50.0, ms_p25=49.0, ms_p75=51.0, speedup_vs_manual=None)) == "unreliable"
    assert speedup_cell(dict(ms_per_iter=50.0, ms_p25=49.0, ms_p75=51.0, speedup_vs_manual=2.26)) == "2.26x"
    assert bench.main([*TINY, "--attn=manual,sdpa", "--dropout=0.1", "--padding=off,on", f"--out_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert len([line for line in out.splitlines() if line.startswith("! sdpa ran math")]) == 1
    rows = json.loads(bench_file(tmp_path, "train.json").read_text())["rows"]
    manual = next(r for r in rows if r["attn"] == "manual" and not r["pad_vocab"])
    manual.update(ms_per_iter=113.0, ms_p25=50.0, ms_p75=240.0)
    sdpa = next(r for r in rows if r["attn"] == "sdpa" and not r["pad_vocab"])
    sdpa["speedup_vs_manual"] = None  # as train_sweep sets it against such a baseline
    table = format_table([manual, sdpa], TRAIN_COLUMNS)
    assert "unreliable" in table.splitlines()[3] and "or its baseline's does" in table


def test_an_attention_chart_over_lengths_100x_apart_draws_speedups_per_length_not_ms():
    """T=256 bars of ~2 ms beside T=4096 bars of ~400 ms vanish on a linear ms axis: each length is drawn against
    its own manual row, so every bar is readable and a ratio reads as the ratio."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from types import SimpleNamespace
    from benchmarks import bench_report
    cfg = SimpleNamespace(mode="attention", mask=["causal"], attn=["manual", "sdpa"], attn_head_sizes=[32],
                          attn_seq_lens=[256, 4096])
    rows = [dict(attn=a, status="ok", seq_len=T, head_size=32, backward=True, ms_per_iter=ms, ms_p25=ms, ms_p75=ms,
                 speedup_vs_manual=speedup)
            for a, T, ms, speedup in (("manual", 256, 2.8, 1.0), ("sdpa", 256, 1.8, 1.56), ("manual", 4096, 433.0, 1.0),
                                      ("sdpa", 4096, 120.0, 3.61))]
    fig, ax = plt.subplots()
    title = bench_report.ms_chart(ax, rows, cfg)
    assert "speedup over manual at each length" in title
    widths = sorted(round(bar.get_width(), 2) for bar in ax.patches)
    assert widths == [1.0, 1.0, 1.56, 3.61]  # no bar is in ms
    plt.close(fig)


def test_a_cell_the_table_calls_unreliable_is_drawn_as_the_word_not_as_a_bar():
    """sdpa hs=32 T=256 read 'unreliable' in the table (its IQR past its median) and a plain 1.23x bar in the chart:
    the chart now says what the table says, in the speedup chart and the ms chart alike."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from types import SimpleNamespace
    from benchmarks import bench_report
    cfg = SimpleNamespace(mode="attention", mask=["causal"], attn=["manual", "sdpa"], attn_head_sizes=[32],
                          attn_seq_lens=[256, 4096])
    rows = [dict(attn=a, status="ok", seq_len=T, head_size=32, backward=True, ms_per_iter=ms, ms_p25=ms * lo,
                 ms_p75=ms * hi, speedup_vs_manual=speedup)
            for a, T, ms, lo, hi, speedup in (("manual", 256, 2.8, 1, 1, 1.0), ("sdpa", 256, 2.3, 0.5, 2.8, 1.23),
                                              ("manual", 4096, 433.0, 1, 1, 1.0), ("sdpa", 4096, 120.0, 1, 1, 3.61))]
    assert bench_report.speedup_cell(rows[1]) == "unreliable"
    for seq_lens in ([256, 4096], [256]):  # speedups over several lengths; ms bars at one
        cfg.attn_seq_lens = seq_lens
        fig, ax = plt.subplots()
        bench_report.ms_chart(ax, rows, cfg)
        texts = [t.get_text() for t in ax.texts]
        assert sum("unreliable" in t for t in texts) == 1 and not any("1.23x" in t for t in texts), texts
        plt.close(fig)


def test_a_length_with_no_measured_row_has_no_legend_entry_and_the_title_says_why():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from types import SimpleNamespace
    from benchmarks import bench_report
    cfg = SimpleNamespace(mode="attention", mask=["causal"], attn=["manual", "sdpa"], attn_head_sizes=[32],
                          attn_seq_lens=[256, 512, 4096])
    rows = [dict(attn=a, status="ok", seq_len=T, head_size=32, backward=True, ms_per_iter=ms, ms_p25=ms, ms_p75=ms,
                 speedup_vs_manual=speedup)
            for a, T, ms, speedup in (("manual", 256, 2.8, 1.0), ("sdpa", 256, 1.8, 1.56), ("manual", 4096, 433.0, 1.0),
                                      ("sdpa", 4096, 120.0, 3.61))]
    rows += [dict(attn=a, status="oom", seq_len=512, head_size=32, backward=True) for a in ("manual", "sdpa")]
    fig, ax = plt.subplots()
    title = bench_report.ms_chart(ax, rows, cfg)
    assert title.endswith("\nT=512: no row measured (the table says why)")
    assert ax.get_legend_handles_labels()[1] == ["T=256", "T=4096"]
    plt.close(fig)


def test_a_max_batch_search_says_each_row_as_it_ends_and_a_stop_keeps_what_was_measured(tmp_path, monkeypatch,
                                                                                          capsys):
    """It once ran for minutes with no line (the bar is off where stderr is not a terminal) and a Ctrl-C kept
    nothing."""
    searched = []

    def fits(cfg, rt, attn, pad, batch, mask, loss):
        if searched and attn != searched[0]:
            raise KeyboardInterrupt  # Ctrl-C in the second row's search
        searched.append(attn)
        return batch <= 2
    monkeypatch.setattr(bench, "fits", fits)
    assert bench.main([*TINY, f"--out_dir={tmp_path}", "--attn=manual,sdpa", "--padding=off", "--max_batch=True",
                       "--max_batch_limit=4"]) == 130
    err = capsys.readouterr().err
    assert "max batch: manual_unpadded fits 2" in err.splitlines() and "what was measured is in" in err
    saved = json.loads(bench_file(tmp_path, "train.json").read_text())
    assert not saved["complete"] and {r["attn"]: r.get("max_batch") for r in saved["rows"]} == {"manual": 2,
                                                                                                "sdpa": None}


def test_what_was_measured_is_saved_when_stdout_closes_before_the_table(tmp_path, monkeypatch):
    """`python bench.py | head -n 1`: the reader goes after one line, and the results are written all the same."""
    from core import errors

    class Closed:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

        def fileno(self):
            return 1
    monkeypatch.setattr(sys, "stdout", Closed())
    monkeypatch.setattr(os, "dup2", lambda *args: None)  # exit_code points the real fd 1 at /dev/null: not here
    assert errors.exit_code(lambda: bench.main([*TINY, f"--out_dir={tmp_path}", "--attn=manual",
                                                "--padding=off"])) == 0
    saved = json.loads(bench_file(tmp_path, "train.json").read_text())
    assert saved["complete"] and [r["attn"] for r in saved["rows"]] == ["manual"]


@pytest.mark.slow
def test_runs_into_one_results_folder_at_once_each_keep_their_results(tmp_path):
    """Three bench.py at once into one folder: each one's results stay, under <mode>.json or its own name."""
    args = [sys.executable, "bench.py", *TINY, f"--out_dir={tmp_path}", "--padding=off", "--threads=1"]
    runs = [subprocess.Popen(args + [f"--attn={attn}"], cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True) for attn in ("manual", "sdpa", "math")]
    assert [run.wait(timeout=600) for run in runs] == [0, 0, 0], [run.stderr.read()[-2000:] for run in runs]
    results = [json.loads(p.read_text()) for p in tmp_path.glob("train*.json")]
    assert sorted(sorted({row["attn"] for row in r["rows"]}) for r in results if r["complete"]) == [
        ["manual"], ["manual", "math"], ["manual", "sdpa"]]  # each its own, with the baseline row beside it


def test_a_sweep_into_a_file_prints_its_progress_as_lines(tmp_path, monkeypatch, capsys):
    """`python bench.py > log 2>&1`: no bar (its redraws pile up), but lines as runs end, the last at the end."""
    from benchmarks import measure
    monkeypatch.setattr(measure.ProgressLines, "LINE_EVERY_S", 0.0)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    run_bench(tmp_path, "--attn=manual", "--padding=off")
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("bench: ")]
    assert lines and lines[-1].startswith("bench: 4/4 runs in ") and "\r" not in "".join(lines)
