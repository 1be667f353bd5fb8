"""runtime.py and measure.py: the device, precision and peak FLOP/s every script shares, out-of-memory detection,
rank-0 failures that stop every rank, and a profiler that keeps the console clean. The GPU-only branches are
reached here by standing in for torch.cuda's answers; tests/test_gpu.py runs them for real."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from core import flops
from engine import trainer
from benchmarks import bench_generate, measure
import bench
from benchmarks import compare
from core import distributed, runtime
import sample
import train
from model import GPT, GPTConfig
from core.errors import UserError

# -- peak FLOP/s ----------------------------------------------------------------------------------------

# torch.cuda.get_device_name() as each GPU reports itself -> dense bf16/fp16 and fp32 (TF32) peak, TFLOP/s
DEVICE_NAMES = {
    "NVIDIA A100-SXM4-40GB": (312, 156), "NVIDIA A100-SXM4-80GB": (312, 156),
    "NVIDIA A100-PCIE-40GB": (312, 156), "NVIDIA A100 80GB PCIe": (312, 156),
    "NVIDIA H100 80GB HBM3": (989.4, 494.7), "NVIDIA H100 PCIe": (756.5, 378), "NVIDIA H100 NVL": (835.5, 417.5),
    "NVIDIA H200": (989.4, 494.7), "NVIDIA GH200 480GB": (989.4, 494.7), "NVIDIA H800": (989.4, 494.7),
    "NVIDIA B200": (2250, 1100), "NVIDIA L4": (121, 60), "NVIDIA L40S": (362, 183), "NVIDIA A10": (125, 62.5),
    "NVIDIA GeForce RTX 4090": (165.2, 82.6), "NVIDIA GeForce RTX 3090": (71, 35.6),
    "Tesla V100-SXM2-16GB": (125, 15.7), "Tesla V100-PCIE-32GB": (112, 14), "Tesla T4": (65, 8.1),
}


@pytest.mark.parametrize("name", DEVICE_NAMES)
def test_datasheet_peaks_match_the_names_gpus_really_report(name):
    half, fp32 = DEVICE_NAMES[name]
    assert flops.datasheet_peak_flops(name, "float16") == pytest.approx(half * 1e12)
    assert flops.datasheet_peak_flops(name, "float32") == pytest.approx(fp32 * 1e12)


def test_an_h100_sxm_is_not_read_as_the_pcie_part_nor_an_a10_as_an_a100():
    assert flops.datasheet_peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == pytest.approx(989.4e12)
    assert flops.datasheet_peak_flops("NVIDIA A10", "bfloat16") == pytest.approx(125e12)
    assert flops.datasheet_peak_flops("NVIDIA L40S", "bfloat16") != flops.datasheet_peak_flops("NVIDIA L4", "bfloat16")


def test_gpus_without_native_bf16_and_unlisted_gpus_have_no_datasheet_peak():
    assert flops.datasheet_peak_flops("Tesla T4", "bfloat16") is None  # emulated: measured instead
    assert flops.datasheet_peak_flops("NVIDIA A10G", "bfloat16") is None
    assert flops.datasheet_peak_flops("NVIDIA GeForce RTX 3090 Ti", "bfloat16") == pytest.approx(80e12)


def test_a_footprint_is_never_judged_against_less_bandwidth_than_a_larger_one_was_read_at(monkeypatch, tmp_path):
    """bench divides a decode step's GB/s by the bandwidth at its footprint: a 16 MiB reading below the
    64 MiB one (a busy moment, the measurement's own overhead) would give the smaller rows a larger share."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    rt, MiB = runtime.Runtime("cpu", "float32"), 2 ** 20
    readings = {64 * MiB: 41e9, 16 * MiB: 21e9, MiB: 90e9}
    monkeypatch.setattr(bench_generate, "best_read_rate", lambda rt, size, repeats: readings[size])
    bench_generate.measured_bandwidth.cache_clear()
    try:
        assert bench_generate.memory_bandwidth(rt, 64 * MiB) == 41e9
        assert bench_generate.memory_bandwidth(rt, 10 * MiB) == 41e9  # measured 21 at 16 MiB: 64 MiB's 41 stands
        assert bench_generate.memory_bandwidth(rt, MiB) == 90e9  # in cache: faster, kept
    finally:
        bench_generate.measured_bandwidth.cache_clear()


def test_mfu_is_against_a_datasheet_peak_and_a_cpu_or_a_mig_slice_has_none(monkeypatch):
    """A MIG slice has a share of the GPU's SMs: the whole H100's 989 TFLOP/s would read its MFU up to 7x low; a CPU
    has no datasheet, and its line says why no MFU is shown."""
    assert flops.datasheet_peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4e12
    assert flops.datasheet_peak_flops("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "bfloat16") is None
    cpu = runtime.Runtime("cpu", "float32")
    assert flops.peak_flops(cpu) is None
    assert flops.peak_line(cpu, None).startswith("mfu not shown: no datasheet peak for ")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3 MIG 1g.10gb")
    assert flops.peak_flops(runtime.Runtime("cuda:0", "bfloat16")) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert flops.peak_flops(runtime.Runtime("cuda:0", "bfloat16")) == 989.4e12


def test_a_cpu_training_log_has_no_mfu_and_measures_no_peak(char_data, tmp_path, capsys):
    from conftest import TINY, metrics
    args = TINY + [f"--data_dir={char_data}", "--max_iters=3", "--eval_interval=3", f"--out_dir={tmp_path / 'o'}"]
    assert train.main(args) == 0
    assert metrics(tmp_path / "o", "ms_per_iter") and not metrics(tmp_path / "o", "mfu")
    assert "mfu not shown: no datasheet peak for " in capsys.readouterr().out
    assert not (Path(os.environ["XDG_CACHE_HOME"]) / "nanogpt-attn" / "peak_flops.json").exists()


# -- device and precision ----------------------------------------------------------------------------

@pytest.fixture()
def fake_cuda(monkeypatch):
    """torch.cuda answering as a machine with 2 GPUs of the given bf16 support would; set_device recorded."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # Ampere or later
    return calls


def test_dtype_auto_on_a_gpu_that_only_emulates_bf16_picks_fp16(fake_cuda, monkeypatch):
    # a V100 or T4: torch says bf16 is "supported" when emulation counts, and not otherwise
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert runtime.pick_dtype("auto", "cuda:0") == "float16"
    assert compare.reduced_dtype(runtime.Runtime("cuda:0", "float32")) == "float16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # an A100
    assert runtime.pick_dtype("auto", "cuda:0") == "bfloat16"


def test_cuda_n_becomes_the_current_device_so_nothing_lands_on_gpu_0(fake_cuda):
    assert runtime.resolve_runtime("cuda:1", "float32").device == "cuda:1"
    assert fake_cuda == ["cuda:1"]
    assert runtime.pick_device("cuda") == "cuda:0"  # always with its index
    with pytest.raises(UserError, match=r"device 'cuda:5' does not exist: this machine has 2 GPU\(s\)"):
        runtime.pick_device("cuda:5")


def test_tf32_is_set_in_one_place_that_every_script_goes_through(monkeypatch, tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    runtime.resolve_runtime("cpu", "float32")
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32

    class Resolved(Exception):
        pass

    def resolve_runtime(device, dtype, muon_dtype="auto", distributed=False, threads=0, backend="auto", width=0):
        raise Resolved
    monkeypatch.setattr(runtime, "resolve_runtime", resolve_runtime)
    for script in (train, sample, bench):
        with pytest.raises(Resolved):
            script.main([f"--out_dir={tmp_path}"])


# -- out of memory ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
])
def test_every_flavour_of_running_out_of_device_memory_is_recognised(error):
    assert measure.is_out_of_memory(error)


def test_other_errors_are_not_taken_for_out_of_memory():
    assert not measure.is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not measure.is_out_of_memory(ValueError("out of memory"))  # not a device error


# -- rank 0 failing -------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_when_rank_0_fails_to_prepare_every_rank_stops_with_it(two_rank_runs):
    """Two real ranks (gloo, under torchrun): tests/rank_probe.py gathers what each raised."""
    assert two_rank_runs.report["rank_0_fails"] == [
        "preparing dataset 'x' failed", "rank 0 stopped with an error (rank 0 prints it); the other ranks stop with it."]


@pytest.mark.parametrize("rank", [0, 1])
def test_on_master_runs_the_work_on_rank_0_alone_and_a_failure_there_stops_every_rank(monkeypatch, rank):
    """on_master's two sides in one process: the process group answers as it would for `rank` of two, rank 0 telling
    the others (through the mean of 'failed') whether its work raised. The slow test above runs two real ranks."""
    from core import distributed
    ran = []

    def work(fails: bool):
        def run():
            ran.append(rank)
            if fails:
                raise UserError("preparing dataset 'x' failed")
        return run
    monkeypatch.setattr(runtime.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(runtime.dist, "get_rank", lambda: rank)
    for rank_0_fails in (False, True):
        other = float(rank_0_fails) if rank == 1 else 0.0  # the other rank's 'my work failed': rank 0's, rank 1's
        monkeypatch.setattr(distributed, "mean_across_ranks", lambda mine, device: (mine + other) / 2)
        if not rank_0_fails:
            runtime.on_master(work(fails=False), "cpu")
            continue
        expected = ("preparing dataset 'x' failed" if rank == 0 else
                    "rank 0 stopped with an error (rank 0 prints it); the other ranks stop with it.")
        with pytest.raises(UserError) as stopped:
            runtime.on_master(work(fails=True), "cpu")
        assert str(stopped.value) == expected
    assert ran == ([0, 0] if rank == 0 else [])  # the work runs on rank 0 only


def test_ddp_does_not_broadcast_the_derived_buffers_before_every_forward(tmp_path):
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = GPT(GPTConfig(block_size=16, vocab_size=11, n_layer=1, n_head=2, n_embd=8))
        assert torch.nn.parallel.DistributedDataParallel(model).will_sync_module_buffers()  # DDP's default
        assert not distributed.wrap_ddp(model, runtime.Runtime("cpu", "float32")).will_sync_module_buffers()
    finally:
        torch.distributed.destroy_process_group()


def test_gradient_accumulation_reduces_across_ranks_only_on_the_last_micro_step(tmp_path):
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = GPT(GPTConfig(block_size=16, vocab_size=11, n_layer=1, n_head=2, n_embd=8))
        ddp = distributed.wrap_ddp(model, runtime.Runtime("cpu", "float32"))
        with trainer.gradient_sync(ddp, sync=False):
            assert not ddp.require_backward_grad_sync
        with trainer.gradient_sync(ddp, sync=True):
            assert ddp.require_backward_grad_sync
        with trainer.gradient_sync(model, sync=False):  # one process: nothing to hold back
            pass
    finally:
        torch.distributed.destroy_process_group()


# -- the profiler ---------------------------------------------------------------------------------------------

def test_the_profiler_banner_stays_off_the_console_and_other_stderr_lines_get_through(capfd):
    def call():
        torch.ones(10) + 1
        os.write(2, b"a real warning\n")
    ops, _ = measure.profiled_run(call, runtime.Runtime("cpu", "float32"))
    err = capfd.readouterr().err
    assert "aten::add" in ops
    assert "USDT" not in err and "a real warning" in err


def test_batches_reach_a_gpu_from_pinned_memory_without_the_host_waiting(monkeypatch):
    # CUDA stood in for: each host batch is pinned, then copied with non_blocking=True, so the copy queues behind the
    # step already launched and the host goes on; a CPU run copies plainly (pinning needs a GPU)
    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: calls.append("pin") or t)
    monkeypatch.setattr(torch.Tensor, "to", lambda t, device, non_blocking=False: calls.append(
        (device, non_blocking)) or t)
    x, y = torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long)
    assert runtime.Runtime("cuda:0", "bfloat16").to_device(x, y) == (x, y)
    assert calls == ["pin", ("cuda:0", True), "pin", ("cuda:0", True)]
    calls.clear()
    runtime.Runtime("cpu", "float32").to_device(x, y)
    assert calls == [("cpu", False), ("cpu", False)]
    calls.clear()  # a batch already on the GPU (bench.py's rows keep theirs there) is used as it is: no pinning
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    assert runtime.Runtime("cuda:0", "bfloat16").to_device(x) == (x,) and calls == []




# -- CPU threads: set once at start -------------------------------------------------------------------

@pytest.fixture()
def keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_threads_come_from_the_setting_then_omp_num_threads_then_torchs_default(monkeypatch, keep_threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    runtime.set_threads(0)
    assert torch.get_num_threads() == 1  # OMP_NUM_THREADS's count, set (MKL_NUM_THREADS could say otherwise)
    runtime.set_threads(2)
    assert torch.get_num_threads() == 2  # --threads= wins
    for value in ("0", "abc", "-1", ""):  # not a count: torch's own default stands
        monkeypatch.setenv("OMP_NUM_THREADS", value)
        runtime.set_threads(0)
        assert torch.get_num_threads() == 2


@pytest.mark.parametrize("where", ["--threads", "OMP_NUM_THREADS"])
def test_a_thread_count_no_machine_runs_is_one_sentence_not_a_hang(where, monkeypatch, keep_threads):
    """OpenMP starts every thread asked for (10,000 hang the run; 100,000 segfault): refused before torch sees it,
    whether typed or in the environment."""
    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "10000" if where == "OMP_NUM_THREADS" else "1")
    with pytest.raises(UserError, match=rf"{where}=10000 is more threads than the \d+ CPU\(s\).*at most \d+"):
        runtime.set_threads(10000 if where == "--threads" else 0)
    assert torch.get_num_threads() == threads


@pytest.mark.parametrize("value", ["0", "abc", "-1"])
def test_an_omp_num_threads_no_machine_runs_is_named_once_with_what_runs_instead(monkeypatch, capsys, value,
                                                                                 keep_threads):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    before = torch.get_num_threads()
    runtime.set_threads(0)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"note: OMP_NUM_THREADS={value!r} is not a positive whole number, so it is not used: this run "
                     f"takes torch's default of {before} threads (set it to a count, or pass --threads=N)."]
    assert torch.get_num_threads() == before


def test_a_compile_cache_folder_that_cannot_be_written_is_one_line_before_any_work(char_data, tmp_path, monkeypatch):
    import train
    from core.errors import UserError
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "a_file" / "cache"))
    out = tmp_path / "out"
    with pytest.raises(UserError, match=rf"^TORCHINDUCTOR_CACHE_DIR {tmp_path / 'a_file' / 'cache'} cannot be written "
                                        r"to \(Not a directory\); torch.compile writes its code there: set it to a "
                                        r"writable folder, unset it, or pass --compile=False\.$"):
        train.main(["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=32", "--device=cpu", "--compile=True",
                    f"--data_dir={char_data}", f"--out_dir={out}"])
    assert not out.exists()
