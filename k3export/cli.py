"""The `k3export` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time

from k3export.accounting import COMPONENTS, parameter_report
from k3export.checkpoint import CheckpointError
from k3export.config import PRESETS, ConfigError, K3Config


def _add_model_source(parser: argparse.ArgumentParser, default_preset: str | None = None) -> None:
    source = parser.add_mutually_exclusive_group(required=default_preset is None)
    source.add_argument("--preset", choices=list(PRESETS), default=default_preset,
                        help="a built-in configuration")
    source.add_argument("--config", metavar="PATH", help="an HF config.json (text_config is read)")


def _config(args: argparse.Namespace) -> K3Config:
    return K3Config.from_json(args.config) if args.config else K3Config.from_preset(args.preset)


def _human(n: float, unit: str = "") -> str:
    """2.7795T parameters, 104.19B active; bytes as TB/GB/MB/KB."""
    billion = "G" if unit else "B"
    for scale, suffix in ((1e12, "T"), (1e9, billion), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.5g}{suffix}{unit}"
    return f"{n:.5g}{unit}"


def cmd_info(args: argparse.Namespace) -> int:
    config = _config(args)
    report = parameter_report(config)
    cache = report.cache(args.context)
    if args.json:
        print(json.dumps({
            "parameters": {"total": report.total, "active_per_token": report.active,
                           "by_component": report.params},
            "weight_bytes": {"all_in_model_dtype": report.weight_bytes,
                             "routed_experts_mxfp4": report.weight_bytes_mxfp4_experts},
            "decode_cache_bytes": cache,
        }, indent=2))
        return 0
    n_mla = len(config.mla_layers)
    print(f"{config.num_hidden_layers} layers: {config.num_hidden_layers - n_mla} KDA, {n_mla} MLA "
          f"(1-based {config.linear_attn_config.full_attn_layers}); weights {config.torch_dtype}")
    print(f"parameters: {_human(report.total)} total, {_human(report.active)} active per token "
          "(counting the LM head, not the embedding lookup)")
    for comp in COMPONENTS:
        print(f"  {comp:<20} {_human(report.params[comp]):>10}  {report.params[comp] / report.total:7.2%}")
    print(f"weights: {_human(report.weight_bytes, 'B')} in {config.torch_dtype}; "
          f"{_human(report.weight_bytes_mxfp4_experts, 'B')} with routed experts in MXFP4 (4.25 bits)")
    ratio = cache["plain_mha_per_token"] / cache["mla_latent_per_token"]
    print(f"decode cache per token: {_human(cache['mla_latent_per_token'], 'B')} MLA latent rows "
          f"({n_mla} x {config.latent_dim}); plain multi-head attention with the same head dims "
          f"would hold {_human(cache['plain_mha_per_token'], 'B')} ({ratio:.1f}x)")
    print(f"decode cache per sequence: KDA state {_human(cache['kda_state_per_sequence'], 'B')} (float32) "
          f"+ conv tails {_human(cache['kda_conv_per_sequence'], 'B')}, fixed; "
          f"{_human(cache['per_sequence_at_context'], 'B')} in all at {args.context} tokens")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from k3export.demo import run_demo

    return run_demo(args.seed, args.prompt_len, args.steps)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k3export", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="parameters, active parameters, cache and weight bytes")
    _add_model_source(info)
    info.add_argument("--context", type=int, default=131072, help="tokens for the per-sequence cache")
    info.add_argument("--json", action="store_true")
    info.set_defaults(run=cmd_info)

    demo = sub.add_parser("demo", help="k3-tiny with seeded weights: prefill, then greedy decode")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--prompt-len", type=int, default=80)
    demo.add_argument("--steps", type=int, default=8)
    demo.set_defaults(run=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    try:
        code = args.run(args)
    except (ConfigError, CheckpointError) as e:
        print(f"k3export: error: {e}", file=sys.stderr)
        return 2
    if not getattr(args, "json", False):
        print(f"({args.command} took {time.perf_counter() - started:.1f} s)", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
