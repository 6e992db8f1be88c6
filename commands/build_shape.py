"""``expertcast build-shape``: write a random-weight checkpoint of a real MoE configuration (docs/design.md,
"Real shapes"; library: :func:`expertcast.inference.runtime.real_shapes.build_shape`).

The model is never held in RAM: the skeleton lives on the meta device, each tensor is generated (seeded by
its name) and streamed into safetensors shards with ``model.safetensors.index.json``, config.json,
generation_config.json, a byte-level tokenizer and the provenance ``build_shape.json``, in a temporary folder
renamed into place. The free disk space is checked first.

    expertcast build-shape deepseek-v2-lite --out /data/ds-v2-lite [--layers N] [--seed 0] [--dtype bfloat16]
    expertcast build-shape qwen3-30b-a3b --out /data/qwen3-30b-shape --layers 4
    expertcast build-shape deepseek-v2-lite --out /data/ds-fp8 --layers 2 --expert-dtype fp8   # FP8 block-scaled
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from expertcast.commands.common import CommandParser, add_config_arg, parse_and_run, positive_int
from expertcast.utils.errors import UsageError

PROG = "expertcast build-shape"


def build_parser() -> CommandParser:
    from expertcast.models.presets import list_presets

    ap = CommandParser(prog=PROG, description="write a random-weight checkpoint of a real MoE configuration, "
                                              "shard by shard, without holding the model in RAM")
    ap.add_argument("shape", help=f"configuration: {', '.join(list_presets('real'))} (or a tiny preset)")
    ap.add_argument("--out", required=True, help="output model folder (new; --overwrite replaces an earlier build)")
    ap.add_argument("--layers", type=positive_int, default=None,
                    help="keep the first N decoder layers (None = all), for runs that fit in RAM")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights (with each tensor's name)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"), help="weights' dtype")
    ap.add_argument("--expert-dtype", default="bfloat16", choices=("bfloat16", "fp8"),
                    help="fp8: write a block-scaled FP8 checkpoint (e4m3 projections + weight_scale_inv 128x128 "
                         "blocks, as DeepSeek-V3 ships; built at --dtype, then converted)")
    ap.add_argument("--set", dest="overrides", action="append", default=None, metavar="KEY=VALUE",
                    help="replace a config field (VALUE read as JSON, else as text), e.g. hidden_size=256 for a "
                         "reduced-width variant; recorded in the provenance")
    ap.add_argument("--shard-gb", type=float, default=4.0, help="shard size at most, in GB (1e9 bytes)")
    ap.add_argument("--overwrite", action="store_true", help="replace --out when it holds an earlier build-shape output")
    add_config_arg(ap)
    return ap


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--set {item!r}: expected KEY=VALUE")
        try:
            out[key.strip()] = json.loads(text)
        except json.JSONDecodeError:
            out[key.strip()] = text
    return out


def _count(n: int) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e9 else f"{n / 1e6:.3f} M"


def run(args: Any) -> int:
    from expertcast.inference.runtime.real_shapes import build_shape

    if not args.shard_gb > 0:
        raise UsageError(f"--shard-gb {args.shard_gb}: must be positive")
    overrides = parse_overrides(args.overrides)
    fp8 = getattr(args, "expert_dtype", "bfloat16") == "fp8"
    out = Path(args.out)
    if fp8 and out.exists() and not args.overwrite:
        raise UsageError(f"--out {out} exists (--overwrite replaces an earlier build)")
    build_to = out.with_name(f".{out.name}.unquantized") if fp8 else out
    r = build_shape(args.shape, build_to, layers=args.layers, seed=args.seed, dtype=args.dtype, overrides=overrides,
                    shard_bytes=int(args.shard_gb * 1e9), overwrite=args.overwrite or fp8, progress=True)
    if fp8:
        from expertcast.inference.runtime.quant_checkpoint import write_fp8_checkpoint

        try:
            write_fp8_checkpoint(build_to, out, overwrite=args.overwrite)
        finally:
            shutil.rmtree(build_to, ignore_errors=True)
        print(f"fp8: {out} holds e4m3 projections with 128x128 weight_scale_inv blocks (quantization_config fp8)")
    print(f"built {r.shape} -> {r.out}: {r.checkpoint_bytes / 1e9:.2f} GB in {r.num_shards} shard(s), "
          f"{r.seconds:.1f} s")
    print(f"parameters: {_count(r.num_params)} total, {_count(r.routed_expert_params)} in routed experts "
          f"({r.num_moe_layers} MoE layers x {r.num_experts} experts x {r.expert_bytes / 1e6:.2f} MB), "
          f"{_count(r.non_expert_params)} non-expert, {_count(r.active_params_per_token)} active per token "
          f"(top-{r.top_k})")
    return 0


def main(argv: list[str] | None = None) -> int:
    return parse_and_run(build_parser(), argv, PROG, run)
