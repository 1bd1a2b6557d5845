"""`capture-service generate`: run prompts of token ids through the engine and print outputs."""

from __future__ import annotations

import argparse
import json
import logging

from service.cli.args import engine_config_from_args
from service.errors import ConfigError
from service.sampling import SamplingParams


def parse_prompt_ids(values: list[str]) -> list[list[int]]:
    prompts = []
    for text in values:
        try:
            prompts.append([int(t) for t in text.split(",") if t.strip()])
        except ValueError:
            raise ConfigError(
                f"--prompt-ids {text!r} is not a comma-separated list of token ids"
            ) from None
    return prompts


def run_generate(args: argparse.Namespace) -> int:
    from service.logs import setup_logging

    setup_logging(logging.WARNING if args.json else logging.INFO)
    from service.engine import Engine

    prompts = parse_prompt_ids(args.prompt_ids)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    engine = Engine(engine_config_from_args(args))
    try:
        outputs = engine.generate(prompts, sampling)
    finally:
        engine.shutdown()
    if args.json:
        print(
            json.dumps(
                {
                    "outputs": [
                        {"output_ids": o.output_ids, "text": o.text, "meta_info": o.meta_info}
                        for o in outputs
                    ],
                    "attention_backend": engine.resolved.limits.attention.to_json(),
                    "prefill_backend": engine.resolved.plan.backend,
                    "buckets": list(engine.resolved.plan.bucket_sizes),
                }
            )
        )
    else:
        for i, o in enumerate(outputs):
            graphs = ", ".join(
                ("hit " + f"{r['bucket']} ({r['graph_kind']})")
                if r["graph_hit"]
                else f"miss ({r['miss_reason']})"
                for r in o.meta_info["prefill_batches"]
            )
            print(f"[{i}] output_ids: {o.output_ids}")
            if o.text is not None:
                print(f"[{i}] text: {o.text!r}")
            print(f"[{i}] prefill graph: {graphs}")
    return 0
