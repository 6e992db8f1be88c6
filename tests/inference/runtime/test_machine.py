"""The machine's figures of the disk benchmark: the disk read leaves no file behind and reports the I/O mode that ran,
RAM copy bandwidth and one expert's GEMM rate are positive, the CPU flags are among the ones asked for."""

from __future__ import annotations

from expertcast.inference.runtime.disk_store import BUFFERED, DIRECT
from expertcast.inference.runtime.machine import (
    CPU_FLAGS,
    cpu_info,
    disk_bandwidth,
    gemm_rate,
    ram_bandwidth,
)
from expertcast.inference.runtime.stats import reset_peak_rss


def test_disk_bandwidth_reads_a_temporary_file_and_deletes_it(tmp_path):
    gbps, mode = disk_bandwidth(tmp_path, size_mb=2, block=5000, readers=2)
    assert gbps > 0 and mode in (DIRECT, BUFFERED)
    assert list(tmp_path.iterdir()) == []


def test_ram_cpu_and_gemm_figures():
    from expertcast.inference.runtime.store import HostExpertStore, find_experts_modules
    from expertcast.models.presets import build_tiny

    assert ram_bandwidth(mb=4) > 0
    model_name, flags = cpu_info()
    assert isinstance(model_name, str) and set(flags) <= set(CPU_FLAGS)
    assert isinstance(reset_peak_rss(), bool)
    model = build_tiny("qwen3_moe-tiny", seed=0)
    refs = find_experts_modules(model)
    weights = HostExpertStore.from_model(model, refs=refs).views(0, 0)
    gflops, ms = gemm_rate(refs[0].module, weights, model.config.hidden_size, tokens=4, reps=3)
    assert gflops > 0 and ms > 0
