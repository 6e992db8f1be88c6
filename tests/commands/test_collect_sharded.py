"""Sharded collection: two concurrent `expertcast collect` ranks (one by --shard, one by torchrun's env)
write one trace set equal, sequence for sequence, to a one-process collect."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from expertcast.commands.collect import PARTS_DIR, collect_traces, launch_shard
from expertcast.data.trace_format import sequences_fingerprint
from expertcast.data.traces import load_traces, read_manifest
from expertcast.recipes.collect import CollectConfig
from expertcast.utils.errors import UsageError

MODEL = "qwen3_moe-tiny"
ARGS = ["--model", MODEL, "--benchmark", "gsm8k", "--split", "test", "--limit", "5", "--max-new-tokens", "4",
        "--batch-size", "2", "--shard-size", "2", "--device", "cpu", "--threads", "1", "--no-progress"]


def _rank(out, data_dir, shard: str | None, env_rank: int | None) -> subprocess.Popen:
    env = {**os.environ, "EXPERTCAST_DATA_DIR": str(data_dir)}
    if env_rank is not None:
        env.update(RANK=str(env_rank), WORLD_SIZE="2", LOCAL_RANK=str(env_rank))
    cmd = [sys.executable, "-m", "expertcast.cli", "collect", *ARGS, "--out", str(out)]
    cmd += ["--shard", shard] if shard else []
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_two_ranks_equal_one_process(tmp_path, data_dir):
    """Two `expertcast collect` processes at once (one --shard 0/2, one torchrun-style RANK=1 WORLD_SIZE=2) and a
    one-process collect of the same command: same sequences, none lost or twice, same tokens and routing."""
    out = tmp_path / "sharded"
    procs = [_rank(out, data_dir, "0/2", None), _rank(out, data_dir, None, 1)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    assert sum("trace set complete" in log for log in logs) >= 1, logs

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    ref = CollectConfig(model=MODEL, out=str(tmp_path / "one"), benchmark="gsm8k", split="test", limit=5,
                        max_new_tokens=4, batch_size=2, shard_size=2, data_dir=str(data_dir), device="cpu",
                        progress=False)
    try:
        collect_traces(ref)
        # a rerun of a rank resumes: nothing to write, the set stays complete and unchanged
        before = read_manifest(out)["shards"]
        again = collect_traces(CollectConfig(**{**ref.__dict__, "out": str(out), "shard": (1, 2)}))
    finally:
        torch.set_num_threads(n)
    assert (again.shards_written, again.shards_skipped, again.complete) == (0, 1, True)

    manifest = read_manifest(out)
    assert manifest["complete"] and sorted(manifest["shards"]) == ["00000", "00001", "00002"]
    assert manifest["run"] == read_manifest(ref.out)["run"]
    assert not (out / PARTS_DIR).exists()  # every part merged and removed
    _, sharded = load_traces(out)
    _, single = load_traces(ref.out)
    ids = [s.seq_id for s in sharded]
    assert len(ids) == len(set(ids)) == 5 and ids == [s.seq_id for s in single]  # none lost, none twice
    for a, b in zip(sharded, single, strict=True):
        assert a.prompt_len == b.prompt_len
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_array_equal(a.expert_ids, b.expert_ids)
        np.testing.assert_array_equal(a.expert_weights, b.expert_weights)
    assert sequences_fingerprint(sharded) == sequences_fingerprint(single)
    assert manifest["shards"] == before


def test_launch_shard_from_flag_or_torchrun_env():
    assert launch_shard("3/8", env={}) == (3, 8)
    assert launch_shard(None, env={"RANK": "1", "WORLD_SIZE": "4"}) == (1, 4)
    assert launch_shard(None, env={"RANK": "0", "WORLD_SIZE": "1"}) is None
    assert launch_shard(None, env={}) is None
    with pytest.raises(UsageError, match="--shard must be i/n"):
        launch_shard("2", env={})
    for bad in [(2, 2), (-1, 2)]:
        with pytest.raises(UsageError, match="--shard must be i/n with 0 <= i < n"):
            CollectConfig(model=MODEL, out="x", shard=bad).validate()
    with pytest.raises(UsageError, match="--overwrite cannot be combined with --shard"):
        CollectConfig(model=MODEL, out="x", shard=(0, 2), overwrite=True).validate()


def test_one_process_collect_refuses_unmerged_parts(tmp_path, data_dir):
    out = tmp_path / "t"
    cfg = CollectConfig(model=MODEL, out=str(out), benchmark="gsm8k", split="test", limit=2, max_new_tokens=2,
                        shard_size=1, data_dir=str(data_dir), device="cpu", progress=False)
    # rank 0 of 2 alone: its shard is merged, rank 1's is missing, so the set is not complete yet
    res = collect_traces(CollectConfig(**{**cfg.__dict__, "shard": (0, 2)}))
    assert not res.complete and sorted(read_manifest(out)["shards"]) == ["00000"]
    (out / PARTS_DIR / "rank-00001-of-00002").mkdir(parents=True)  # a rank that has started
    with pytest.raises(UsageError, match="unmerged parts of a sharded collect"):
        collect_traces(cfg)
    with pytest.raises(UsageError, match="another number of ranks"):
        collect_traces(CollectConfig(**{**cfg.__dict__, "shard": (0, 3)}))
