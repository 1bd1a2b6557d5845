"""`capture-service generate`: run prompts of token ids through the engine and print outputs."""

from __future__ import annotations

import argparse
import json
import logging

from service.buckets import PlanError
from service.config import EngineConfig, GraphConfig
from service.sampling import SamplingParams


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model_path=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        tp=args.tp,
        context_length=args.context_length,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        graph=GraphConfig(
            backend=args.backend,
            buckets=args.prefill_buckets,
            full_request_slots=args.full_request_slots,
            max_padding_fraction=args.max_padding_fraction,
        ),
        seed=args.seed,
        ray_address=args.ray_address,
        executor=args.executor,
        attention_backend=args.attention_backend,
        flashinfer_kernel=args.flashinfer_kernel,
    )


def parse_prompt_ids(values: list[str]) -> list[list[int]]:
    prompts = []
    for text in values:
        try:
            prompts.append([int(t) for t in text.split(",") if t.strip()])
        except ValueError:
            raise PlanError(
                f"--prompt-ids {text!r} is not a comma-separated list of token ids"
            ) from None
    return prompts


def run_generate(args: argparse.Namespace) -> int:
    from service.logs import setup_logging

    setup_logging(logging.WARNING if args.json else logging.INFO)
    from service.engine import Engine
    from service.model.arch_config import CheckpointError
    from service.scheduler import RequestError

    prompts = parse_prompt_ids(args.prompt_ids)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    try:
        engine = Engine(engine_config_from_args(args))
    except CheckpointError as exc:
        raise PlanError(str(exc)) from None
    try:
        outputs = engine.generate(prompts, sampling)
    except RequestError as exc:
        raise PlanError(str(exc)) from None
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
                    "attention_backend": engine.resolved.attention,
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
