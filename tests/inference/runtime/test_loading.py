"""Every family of the README's table loads straight to the host store from a saved checkpoint
(:func:`expertcast.inference.runtime.loading.load_offloaded`) and decodes the same greedy tokens as the
full-load model, batch 1 and batch 2 (left padded), at the smallest capacity (top-K slots per layer,
so experts are loaded and evicted all along). Shared experts (Qwen2-MoE, DeepSeek-V3) and the first
dense layers stay resident. Also: sharded checkpoints (index json), fused-expert checkpoints, the
memory-mapped store, and the errors of a checkpoint that does not match its config.

Loading straight to the host store holds no second copy of the model (CPU-measurable proof).

A random-weight Qwen3-MoE whose routed experts total >= 1 GiB (fp32, 3 layers x 60 experts x 6.3 MB)
is saved with ``save_pretrained`` to a temporary folder. In one subprocess it is offloaded at 25%
with :func:`~expertcast.inference.runtime.loading.load_offloaded`; in another it is loaded whole
(``from_pretrained``) as the full-load reference. The offloaded process's peak RSS (``VmHWM``: Linux
carries ``ru_maxrss`` over ``execve``, so a child of the large test process would report its parent's peak)
stays below its RSS before loading + non-expert weights + experts + slots + 300 MB, so no second
full copy of the experts (nor the checkpoint's pages) ever existed, its runtime memory report
matches the plan, and its greedy tokens equal the full-load run's.

The peak RSS both reports give (``LoadReport.peak_rss_bytes``, ``MemoryReport.process_peak_rss``) is the
process's own: a process exec'd by one that had touched 1 GiB reports its own peak, not the inherited
``ru_maxrss``.

The ``gpu`` test does the same on CUDA under ``torch.cuda.set_per_process_memory_fraction`` set below
the model's size: the model does not fit the device and still runs, token-identical.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from expertcast.inference.policies import make_policy
from expertcast.inference.runtime.loading import (
    checkpoint_tensors,
    load_offloaded,
    plan_offload,
)
from expertcast.models.backbone import load_moe_model, save_tiny
from expertcast.models.tokenizer import byte_level_tokenizer
from expertcast.utils.errors import UsageError
from safetensors.torch import save_file

torch.set_num_threads(1)
NEW = 8

FAMILIES = {  # README table -> tiny preset
    "qwen3_moe": "qwen3_moe-tiny",
    "qwen2_moe": "qwen2_moe-tiny",
    "mixtral": "mixtral-tiny",
    "olmoe": "olmoe-tiny",
    "deepseek_v2": "deepseek_v2-tiny",
    "deepseek_v3": "deepseek_v3-tiny",
    "gpt_oss": "gpt_oss-tiny",
}


def _batches():
    """Batch 1 and a left-padded batch 2 (the second prompt 3 tokens shorter)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 500, (2, 9), generator=g)
    am = torch.ones_like(ids)
    am[1, :3] = 0
    ids[1, :3] = 0
    return [(ids[:1], am[:1]), (ids, am)]


def _greedy(model, ids, am):
    return model.generate(ids, attention_mask=am, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                          pad_token_id=0)


FORMATS = ("bfloat16", "int8", "int4")
"""Expert formats (docs/design.md, "Expert formats"): a quantized run is compared with a full load of the same
quantized model (every expert resident in its format, the same kernels), in bfloat16 so torch's int kernels run."""


def _check_identical(model_dir, expert_dtype="bfloat16", **load_kw):
    """Full load vs offloaded load of ``model_dir`` (experts in ``expert_dtype``): same tokens for batch 1 and 2;
    returns the runtime."""
    from expertcast.inference.runtime.experts import quantize_model_experts

    if expert_dtype != "bfloat16":
        load_kw = {"dtype": "bfloat16", "expert_dtype": expert_dtype, **load_kw}
        full = quantize_model_experts(load_moe_model(model_dir, dtype="bfloat16")[0], expert_dtype)
    else:
        full, _ = load_moe_model(model_dir)
    refs = [_greedy(full, ids, am) for ids, am in _batches()]
    K = full.config.num_experts_per_tok
    del full
    om, tok, report = load_offloaded(model_dir, make_policy("lru"), K, **load_kw)  # int: K slots per layer
    assert om.layout.fmt == report.plan.expert_format == expert_dtype
    assert tok is not None and report.source == "checkpoint"
    for (ids, am), ref in zip(_batches(), refs, strict=True):
        out = om.generate(ids, am, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
        assert torch.equal(out.sequences, ref), (model_dir, ids.shape[0])
    assert om.stats.D > 0, "top-K slots per layer must cause demand loads"
    mem = om.memory_report()
    assert mem.device_expert_param_bytes == 0
    assert mem.host_expert_bytes == report.plan.expert_bytes_total
    assert mem.device_non_expert_bytes == report.plan.non_expert_bytes
    assert mem.num_slots == report.plan.num_slots == K * om.L
    return om, report


@pytest.mark.parametrize("expert_dtype", FORMATS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_offloads_from_checkpoint_token_identical(family, expert_dtype, tmp_path):
    d = save_tiny(FAMILIES[family], tmp_path / family, seed=0)
    om, report = _check_identical(d, expert_dtype)
    expected_layout = "fused" if family == "gpt_oss" else "per-expert"  # save_pretrained un-fuses the others
    assert report.plan.checkpoint_layout == expected_layout
    assert report.unused_checkpoint_keys == []
    names = {n for n, _ in om.model.named_parameters()}
    if family in ("qwen2_moe", "deepseek_v2", "deepseek_v3"):
        shared = [n for n in names if "shared_expert" in n]
        assert shared, "shared experts are resident parameters"
        for n in shared:
            assert om.model.get_parameter(n).device.type == "cpu" and om.model.get_parameter(n).numel() > 0
        dense = om.model.model.layers[0].mlp  # first-k dense (DeepSeek-V3) / mlp_only_layers=[0] (Qwen2-MoE)
        assert not hasattr(dense, "experts") and all(p.numel() > 0 for p in dense.parameters())
        assert om.L == om.model.config.num_hidden_layers - 1


def test_sharded_checkpoint_with_renamed_keys(tmp_path):
    """Mixtral saved in several shards (``block_sparse_moe.experts.N.w1`` keys, an index json)."""
    model, tok = load_moe_model("mixtral-tiny", seed=2)
    d = tmp_path / "sharded"
    model.save_pretrained(d, max_shard_size="200KB")
    tok.save_pretrained(d)
    assert (d / "model.safetensors.index.json").is_file()
    files = {e.file.name for e in checkpoint_tensors(d).values()}
    assert len(files) > 2
    _, report = _check_identical(d)
    assert report.plan.checkpoint_files == sorted(files)


@pytest.mark.parametrize("expert_dtype", FORMATS)
def test_fused_checkpoint_and_mmap_store(expert_dtype, tmp_path):
    """A checkpoint holding transformers-5 fused tensors (``experts.gate_up_proj`` [E, 2I, H]) is read one
    expert slice at a time; the store is streamed into a memory-mapped file."""
    d = save_tiny("qwen3_moe-tiny", tmp_path / "fused", seed=4)
    model, _ = load_moe_model(d)
    (d / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    assert any(k.endswith("experts.gate_up_proj") for k in checkpoint_tensors(d))
    om, report = _check_identical(d, expert_dtype, mmap_path=tmp_path / "store" / "experts.safetensors")
    assert report.plan.checkpoint_layout == "fused"
    assert om.store.mmap_path is not None and om.memory_report().host_mmap


def test_bf16_load_of_fp32_checkpoint_matches_bf16_full_load(tmp_path):
    """dtype conversion on load: the store rows are bf16, and decode equals a bf16 full load."""
    d = save_tiny("olmoe-tiny", tmp_path / "olmoe", seed=5)
    full, _ = load_moe_model(d, dtype="bfloat16")
    ids, am = _batches()[1]
    ref = _greedy(full, ids, am)
    om, _, report = load_offloaded(d, make_policy("lru"), 0.5, dtype="bfloat16")
    assert om.store.rows.dtype == torch.bfloat16 and report.plan.dtype == "bfloat16"
    assert torch.equal(om.generate(ids, am, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0).sequences, ref)


def test_checkpoint_that_does_not_match_its_config_is_refused(tmp_path):
    d = save_tiny("qwen3_moe-tiny", tmp_path / "m", seed=0)
    cfg = json.loads((d / "config.json").read_text())
    cfg["moe_intermediate_size"] = 48
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UsageError, match=r"experts\.\d+\..*has shape .* per expert"):
        load_offloaded(d, make_policy("lru"), 0.5)
    d2 = save_tiny("mixtral-tiny", tmp_path / "m2", seed=0)
    model, _ = load_moe_model(d2)
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "model.norm.weight"}
    save_file(sd, str(d2 / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UsageError, match="lacks model.norm.weight"):
        load_offloaded(d2, make_policy("lru"), 0.5)
    from safetensors.torch import load_file  # half of expert 3's gate_up (its w3 = up) is missing

    sd = {k: v for k, v in load_file(str(d / "model.safetensors")).items() if "experts.3.up_proj" not in k}
    cfg["moe_intermediate_size"] = 32
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UsageError, match=r"lacks expert weights of MoE layer 0 .*\('gate_up_proj', 3\)"):
        load_offloaded(d, make_policy("lru"), 0.5)


def test_plan_refuses_slots_that_do_not_fit_and_experts_the_host_cannot_hold(tmp_path):
    d = save_tiny("qwen3_moe-tiny", tmp_path / "m", seed=0)
    plan = plan_offload(d, 0.5)
    assert plan.expert_bytes_total == 4 * 16 * plan.expert_bytes and plan.num_slots == 32
    assert plan.slot_bytes == (32 + 2) * plan.expert_bytes and plan.full_load_fits
    plan.device, plan.device_free = "cuda:0", plan.non_expert_bytes + plan.slot_bytes - 1
    with pytest.raises(UsageError, match=r"slots do not fit cuda:0: 32 slots \+ 2 temporary .*lower --capacity"):
        plan.check_fits(mmap=False)
    assert not plan.full_load_fits
    plan.device_free, plan.host_available = None, plan.expert_bytes_total - 1
    with pytest.raises(UsageError, match="host memory cannot hold the experts.*--mmap-store"):
        plan.check_fits(mmap=False)
    plan.check_fits(mmap=True)  # the memory-mapped store needs no host copy


def test_tiny_preset_name_is_built_in_host_memory_then_offloaded():
    """A preset has no checkpoint to stream: built in host memory, then offloaded (report says so)."""
    full, _ = load_moe_model("deepseek_v3-tiny", seed=3)
    ids, am = _batches()[1]
    ref = _greedy(full, ids, am)
    om, tok, report = load_offloaded("deepseek_v3-tiny", make_policy("lru"), 0.5, seed=3)
    assert report.source == "host" and report.plan.num_slots == om.cache.num_slots == 16
    assert torch.equal(om.generate(ids, am, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0).sequences, ref)


def test_tied_embeddings_checkpoint(tmp_path):
    """save_pretrained omits a tied lm_head: the loader ties it to the loaded embeddings."""
    from expertcast.models.presets import build_tiny

    d = tmp_path / "tied"
    build_tiny("olmoe-tiny", seed=6, tie_word_embeddings=True).save_pretrained(d)
    byte_level_tokenizer(model_max_length=512).save_pretrained(d)
    assert "lm_head.weight" not in checkpoint_tensors(d)
    om, _ = _check_identical(d)
    assert om.model.lm_head.weight is om.model.model.embed_tokens.weight


MB = 1 << 20
BIG = dict(hidden_size=512, moe_intermediate_size=1024, num_experts=60, num_hidden_layers=3)
"""3 MoE layers x 60 experts x (3 x 512 x 1024 fp32 = 6.29 MB) = 1.13 GB of routed experts."""

CHILD = r"""
import json, sys, torch
torch.set_num_threads(1)
from expertcast.inference.policies import make_policy
from expertcast.inference.runtime.loading import load_offloaded, peak_rss_bytes as rss
from expertcast.models.backbone import load_moe_model
import transformers.models.qwen3_moe.modeling_qwen3_moe  # imported before the baseline RSS is read

mode, model_dir, device = sys.argv[1], sys.argv[2], sys.argv[3]
ids = torch.tensor([[0, 0, 0, 17, 99, 250, 31, 77, 140], [12, 45, 300, 5, 88, 61, 203, 19, 7]], device=device)
am = (torch.arange(9, device=device) >= torch.tensor([[3], [0]], device=device)).long()
out = {"base_rss": rss()}
if mode == "full":
    model, _ = load_moe_model(model_dir, device=device)
    seq = model.generate(ids, attention_mask=am, max_new_tokens=6, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
else:
    if device == "cuda":
        torch.cuda.set_per_process_memory_fraction(float(sys.argv[4]))
    om, _, report = load_offloaded(model_dir, make_policy("lru"), 0.25, device=device)
    seq = om.generate(ids, am, max_new_tokens=6, eos_token_id=None, pad_token_id=0).sequences
    out["report"] = report.to_dict()
    out["memory"] = om.memory_report().to_dict()
    out["misses"] = int(om.stats.D)
out["tokens"] = seq.tolist()
out["peak_rss"] = rss()
print("RESULT " + json.dumps(out))
"""


EXEC_PARENT = r"""
import os, sys
big = b"\x01" * int(sys.argv[1])  # touched: resident
del big
os.execv(sys.executable, [sys.executable, "-c", sys.argv[2]])
"""

EXEC_CHILD = r"""
import json, resource, torch
torch.set_num_threads(1)
from expertcast.inference.policies import make_policy
from expertcast.inference.runtime.loading import load_offloaded
om, _, report = load_offloaded("qwen3_moe-tiny", make_policy("lru"), 0.5)
print("RESULT " + json.dumps({"load": report.peak_rss_bytes, "memory": om.memory_report().process_peak_rss,
                              "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def test_peak_rss_is_the_process_own_not_an_exec_parents():
    parent_peak = 1 << 30
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", EXEC_PARENT, str(parent_peak), EXEC_CHILD], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")).removeprefix("RESULT "))
    assert r["ru_maxrss"] >= parent_peak  # the premise: Linux carried the parent's peak over execve
    assert 0 < r["load"] <= r["memory"] < parent_peak, r  # both reports give the child's own high-water mark


def _run_children(model_dir: Path, runs: list[list[str]]) -> list[dict]:
    """Run the CHILD script once per argument list, concurrently; their parsed RESULT lines."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, a[0], str(model_dir), *a[1:]], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for a in runs]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
        results.append(json.loads(line.removeprefix("RESULT ")))
    return results


@pytest.fixture(scope="module")
def big_checkpoint(write_tiled_checkpoint):
    d = Path(tempfile.mkdtemp(prefix="expertcast-big-", dir="/tmp" if Path("/tmp").is_dir() else None))
    try:
        write_tiled_checkpoint(d, **BIG)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _check_offloaded(off: dict, full: dict) -> dict:
    """Assertions shared by the CPU and CUDA runs; returns the figures."""
    plan, mem = off["report"]["plan"], off["memory"]
    experts, non_expert, slots = plan["expert_bytes_total"], plan["non_expert_bytes"], plan["slot_bytes"]
    assert experts >= 1 << 30, experts
    assert plan["checkpoint_layout"] == "per-expert"
    assert plan["num_slots"] == round(0.25 * 3 * 60)
    assert mem["device_expert_param_bytes"] == 0 and mem["host_expert_bytes"] == experts
    assert mem["device_non_expert_bytes"] == non_expert and mem["device_slot_bytes"] == slots
    assert off["misses"] > 0
    bound = off["base_rss"] + non_expert + experts + slots + 300 * MB
    assert off["peak_rss"] < bound, (off["peak_rss"] / MB, bound / MB)
    assert off["tokens"] == full["tokens"]
    return {"expert_bytes": experts, "non_expert_bytes": non_expert, "slots": plan["num_slots"],
            "slot_bytes": slots, "base_rss": off["base_rss"], "peak_rss": off["peak_rss"],
            "peak_rss_minus_base": off["peak_rss"] - off["base_rss"], "bound": bound,
            "device_peak_bytes": off["report"]["device_peak_bytes"], "full_load_peak_rss": full["peak_rss"]}


def test_offload_of_1gb_model_holds_one_host_copy_and_matches_full_load(big_checkpoint):
    full, off = _run_children(big_checkpoint, [["full", "cpu"], ["offload", "cpu"]])
    figures = _check_offloaded(off, full)
    # the full load holds at least the whole model: the offloaded peak is well below base + 2 copies
    assert off["peak_rss"] - off["base_rss"] < 2 * figures["expert_bytes"]
    print("FIGURES " + json.dumps(figures))


@pytest.mark.gpu
def test_offload_on_cuda_below_model_size(big_checkpoint):
    """The device may hold less than the model: non-expert weights + slots + 512 MB of workspace, KV cache
    and CUDA context. Offloading still runs, token-identical to a full load (on the unconstrained device)."""
    full, = _run_children(big_checkpoint, [["full", "cuda"]])
    from expertcast.inference.runtime.loading import plan_offload

    plan = plan_offload(big_checkpoint, 0.25, device="cuda")
    allowed = plan.non_expert_bytes + plan.slot_bytes + 512 * MB
    model_bytes = plan.non_expert_bytes + plan.expert_bytes_total
    assert allowed < model_bytes
    total = torch.cuda.get_device_properties(0).total_memory
    off, = _run_children(big_checkpoint, [["offload", "cuda", str(allowed / total)]])
    figures = _check_offloaded(off, full)
    device_peak = max(figures["device_peak_bytes"], off["memory"]["device_peak_allocated"])  # load, generate
    assert device_peak <= allowed, (device_peak / MB, allowed / MB)
    assert off["memory"]["host_pinned"]
    print("FIGURES " + json.dumps({**figures, "device_peak_bytes": device_peak, "device_allowed_bytes": allowed,
                                   "model_bytes": model_bytes}))
