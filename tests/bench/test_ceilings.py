"""The roofline's ceilings come from the GPU the bench runs on: the table by device name, flags first,
measured when asked or when the table does not know the GPU, and never the H200's on another GPU."""
import math
from types import SimpleNamespace

import pytest
import torch

from kvforge.bench import ceilings
from kvforge.bench.ceilings import (
    BANDWIDTH_EFFICIENCY,
    FLOPS_EFFICIENCY,
    TABLE,
    copy_traffic_bytes,
    lookup,
    matmul_flop_count,
    measure,
    rate,
    resolve,
)


@pytest.mark.parametrize("device_name, entry", [
    ("NVIDIA H200", "H200"), ("NVIDIA H100 80GB HBM3", "H100 80GB HBM3"),  # torch's names of the lent GPUs
    ("H100", "H100 80GB HBM3"), ("nvidia h200", "H200"),  # partial, and case does not matter
    ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H100 NVL", "H100 NVL"), ("NVIDIA H200 NVL", "H200 NVL"),
    ("NVIDIA A100-SXM4-80GB", "A100-SXM4-80GB"), ("NVIDIA A100-SXM4-40GB", "A100-SXM4-40GB"),
    ("NVIDIA A100 80GB PCIe", "A100 80GB PCIe"), ("NVIDIA A100-PCIE-40GB", "A100 40GB PCIe"),
    ("NVIDIA L40S", "L40S"), ("NVIDIA B200", "B200"),
])
def test_lookup_by_device_name(device_name, entry):
    assert lookup(device_name).name == entry


@pytest.mark.parametrize("device_name", ["NVIDIA GeForce RTX 4090", "NVIDIA GH200 480GB", "Tesla V100-SXM2-16GB",
                                         "NVIDIA H100 80GB HBM3 MIG 1g.10gb", ""])
def test_unknown_gpus_and_mig_slices_have_no_entry(device_name):
    assert lookup(device_name) is None  # a GH200 is not an H200, a MIG slice has a fraction of the GPU


def test_measured_entries_are_the_readme_figures_and_the_rest_say_they_are_estimates():
    h200, h100 = lookup("NVIDIA H200"), lookup("NVIDIA H100 80GB HBM3")
    assert (h200.bandwidth, h200.flops) == (4.25e12, 779e12) and h200.source == "table: H200"
    assert (h100.bandwidth, h100.flops) == (3.0e12, 790e12) and h100.source == "table: H100 80GB HBM3"
    for entry in TABLE:
        if entry.datasheet is None:
            assert "estimate" not in entry.source
            continue
        tb_s, tflops = entry.datasheet
        assert entry.source == f"table: {entry.name} (datasheet-scaled estimate)"
        assert entry.bandwidth == pytest.approx(tb_s * 1e12 * BANDWIDTH_EFFICIENCY)
        assert entry.flops == pytest.approx(tflops * 1e12 * FLOPS_EFFICIENCY)
    # the scale factors are the measured GPUs' own ratios to their datasheets (4.8 TB/s, 3.35; 989 TFLOP/s)
    assert BANDWIDTH_EFFICIENCY == pytest.approx((4.25 / 4.8 + 3.0 / 3.35) / 2, abs=0.005)
    assert FLOPS_EFFICIENCY == pytest.approx((779 / 989 + 790 / 989) / 2, abs=0.005)


class Measurer:
    def __init__(self, result=None, error=None):
        self.calls, self.result, self.error = 0, result or {"bandwidth": 1.5e12, "flops": 300e12}, error

    def __call__(self):
        self.calls += 1
        if self.error:
            raise self.error
        return self.result


def test_a_known_gpu_takes_its_row_of_the_table_without_measuring():
    m = Measurer()
    c = resolve(None, None, "cuda", "NVIDIA H100 80GB HBM3", measurer=m)
    assert (c.bandwidth, c.flops, c.source, m.calls) == (3.0e12, 790e12, "table: H100 80GB HBM3", 0)
    assert "NVIDIA H100 80GB HBM3: 3.00 TB/s copy, 790 TFLOP/s" in c.describe()
    assert "(table: H100 80GB HBM3)" in c.describe()


def test_an_unknown_gpu_is_measured_not_given_the_h200s():
    m = Measurer()
    c = resolve(None, None, "cuda", "NVIDIA GeForce RTX 4090", measurer=m)
    assert m.calls == 1 and (c.bandwidth, c.flops) == (1.5e12, 300e12) and c.measured == m.result
    assert c.source == "measured: NVIDIA GeForce RTX 4090 is not in the table"
    failed = resolve(None, None, "cuda", "NVIDIA GeForce RTX 4090", measurer=Measurer(error=RuntimeError("OOM")))
    assert not failed.ok and failed.bandwidth is None and "measuring the ceilings failed: OOM" in failed.describe()


def test_measure_ceilings_measures_a_known_gpu_too():
    m = Measurer()
    c = resolve(None, None, "cuda", "NVIDIA H200", measure_ceilings=True, measurer=m)
    assert m.calls == 1 and c.source == "measured" and c.bandwidth == 1.5e12


def test_explicit_flags_win():
    m = Measurer()
    both = resolve(2e12, 500e12, "cuda", "NVIDIA H200", measure_ceilings=True, measurer=m)
    assert (both.bandwidth, both.flops, both.source, m.calls) == (2e12, 500e12, "--bandwidth, --flops", 0)
    one = resolve(2e12, None, "cuda", "NVIDIA H100 80GB HBM3", measurer=m)
    assert (one.bandwidth, one.flops) == (2e12, 790e12)
    assert one.source == "bandwidth --bandwidth; flops table: H100 80GB HBM3"
    measured = resolve(None, 500e12, "cuda", "NVIDIA H100 80GB HBM3", measure_ceilings=True, measurer=m)
    assert (measured.bandwidth, measured.flops, m.calls) == (1.5e12, 500e12, 1)


def test_cpu_has_a_roofline_only_with_both_flags():
    m = Measurer()
    assert not resolve(None, None, "cpu", "CPU", measurer=m).ok
    assert resolve(None, None, "cpu", "CPU").describe() == "roofline n/a on CPU (give --bandwidth and --flops)"
    assert not resolve(1e10, None, "cpu", "CPU").ok
    asked = resolve(None, None, "cpu", "CPU", measure_ceilings=True, measurer=m)
    assert not asked.ok and "measures CUDA devices only" in asked.note and m.calls == 0
    assert resolve(1e10, 1e12, "cpu", "CPU").describe() == (
        "roofline ceilings of CPU: 0.01 TB/s copy, 1 TFLOP/s bf16 matmul (--bandwidth, --flops)")


def test_for_device_looks_up_torchs_name_of_the_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(ceilings, "measure", lambda device: pytest.fail("a known GPU was measured"))
    args = SimpleNamespace(bandwidth=None, flops=None, measure_ceilings=False)
    cuda = SimpleNamespace(type="cuda")
    assert ceilings.for_device(args, cuda).source == "table: H100 80GB HBM3"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Future GPU")
    monkeypatch.setattr(ceilings, "measure", lambda device: {"bandwidth": 9e12, "flops": 2e15})
    assert ceilings.for_device(args, cuda).bandwidth == 9e12


def test_what_a_measurement_counts():
    # a copy reads and writes every byte: 1 GiB copied in 0.505 ms is the H200's 4.25 TB/s
    assert copy_traffic_bytes(1 << 30) == 2 << 30
    assert rate(copy_traffic_bytes(1 << 30), [0.505e-3]) == pytest.approx(4.25e12, rel=1e-3)
    # 2 n^3 FLOPs: 8192^3 in 1.411 ms is its 779 TFLOP/s
    assert matmul_flop_count(8192) == 2 * 8192 ** 3 == 1_099_511_627_776
    assert rate(matmul_flop_count(8192), [1.411e-3]) == pytest.approx(779e12, rel=1e-3)
    assert rate(100.0, [1.0, 4.0, 2.0]) == 50.0  # the median iteration, not the best


def test_measure_runs_on_cpu_at_a_small_size():
    m = measure(torch.device("cpu"), buffer_bytes=1 << 20, n=64, warmup=1, iters=3)
    assert m["buffer_bytes"] == 1 << 20 and m["matmul_n"] == 64
    assert m["bandwidth"] == pytest.approx(2 * (1 << 20) / m["copy_s_median"])
    assert m["flops"] == pytest.approx(2 * 64 ** 3 / m["matmul_s_median"])
    assert all(math.isfinite(m[k]) and m[k] > 0 for k in ("bandwidth", "flops"))


@pytest.mark.gpu
def test_measured_ceilings_agree_with_the_table_on_a_known_gpu():
    device = torch.device("cuda")
    m = measure(device)
    entry = lookup(torch.cuda.get_device_name(device))
    assert m["bandwidth"] > 1e11 and m["flops"] > 1e13
    if entry is not None:  # within a fifth of the table: it was measured (or scaled) the same way
        assert m["bandwidth"] == pytest.approx(entry.bandwidth, rel=0.2)
        assert m["flops"] == pytest.approx(entry.flops, rel=0.2)
