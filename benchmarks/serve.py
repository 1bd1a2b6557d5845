"""End-to-end serving benchmark: drive a running server over HTTP as operators do.

Workloads: synthetic (fixed or uniformly random prompt and output lengths, a Poisson request
rate or a fixed concurrency, a seed) or a CSV trace (columns ``arrival_s,prompt_tokens,
output_tokens``). Prompts are random token ids of the asked lengths and every request sets
``ignore_eos``, so each produces exactly its output length. Requests stream (server-sent events,
one event per generated token), which gives time to first token (TTFT) and inter-token latency
(ITL) per request.

Reports request throughput, input and output tokens/s, TTFT p50/p90/p99, ITL p50/p99, end-to-end
latency, failures by status, and, read from ``/metrics`` before and after, the prefill graph hit
ratio, the padded share of prefill tokens and the decode graph hit ratio. Prints progress, writes
one JSON result, and is bounded in time (``--max-seconds``) and requests (``--num-requests``).

    python benchmarks/serve.py --url http://127.0.0.1:30000 --num-requests 64 \\
        --input-len 256 --output-len 128 --concurrency 1 --out result.json
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx


@dataclass(frozen=True)
class Job:
    arrival_s: float  # offset from the start (0 for closed-loop concurrency)
    prompt_tokens: int
    output_tokens: int


@dataclass
class Outcome:
    prompt_tokens: int
    output_tokens: int = 0
    status: str = "ok"  # "ok", an HTTP status code, or an exception name
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None


def synthetic_jobs(args: argparse.Namespace, rng: random.Random) -> list[Job]:
    def length(mean: int, spread: float) -> int:
        return max(1, round(rng.uniform(mean * (1 - spread), mean * (1 + spread))))

    jobs, t = [], 0.0
    for _ in range(args.num_requests):
        if args.request_rate:
            t += rng.expovariate(args.request_rate)
        jobs.append(
            Job(
                t if args.request_rate else 0.0,
                length(args.input_len, args.range_ratio),
                length(args.output_len, args.range_ratio),
            )
        )
    return jobs


def trace_jobs(path: Path, limit: int) -> list[Job]:
    with path.open() as f:
        rows = list(csv.DictReader(f))
    missing = {"arrival_s", "prompt_tokens", "output_tokens"} - set(rows[0] if rows else ())
    if missing:
        raise SystemExit(f"{path}: the trace lacks columns {sorted(missing)}")
    jobs = [
        Job(float(r["arrival_s"]), int(r["prompt_tokens"]), int(r["output_tokens"])) for r in rows
    ]
    return sorted(jobs, key=lambda j: j.arrival_s)[:limit]


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def metric_sum(m: dict[str, float], name: str, **labels: str) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in m.items() if k.split("{")[0] == name and all(w in k for w in want))


async def run_one(
    client: httpx.AsyncClient, url: str, job: Job, vocab: int, rng: random.Random
) -> Outcome:
    out = Outcome(job.prompt_tokens)
    body = {
        "input_ids": [rng.randrange(vocab) for _ in range(job.prompt_tokens)],
        "sampling_params": {"max_new_tokens": job.output_tokens, "temperature": 0,
                            "ignore_eos": True},
        "stream": True,
    }  # fmt: skip
    t0 = time.perf_counter()
    last = t0
    try:
        async with client.stream("POST", url + "/generate", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                out.status = str(r.status_code)
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.status = "stream_error"
                    return out
                n = len(event.get("output_ids", ()))
                if n > out.output_tokens:
                    now = time.perf_counter()
                    if out.ttft_s is None:
                        out.ttft_s = now - t0
                    else:  # tokens that arrive together share the gap
                        out.itl_s += [(now - last) / (n - out.output_tokens)] * (
                            n - out.output_tokens
                        )
                    last = now
                    out.output_tokens = n
    except httpx.HTTPError as exc:
        out.status = type(exc).__name__
        return out
    out.e2e_s = time.perf_counter() - t0
    return out


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


async def drive(args: argparse.Namespace, jobs: list[Job]) -> tuple[list[Outcome], float]:
    rng = random.Random(args.seed + 1)
    limits = httpx.Limits(max_connections=max(64, args.concurrency or 0))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits,
                                 headers=headers) as client:  # fmt: skip
        info = (await client.get(args.url + "/server_info")).json()
        vocab = min(info.get("vocab_size", 256), args.max_token_id)
        sem = asyncio.Semaphore(args.concurrency or len(jobs) or 1)
        done = 0
        outcomes: list[Outcome] = []
        t_start = time.perf_counter()
        deadline = t_start + args.max_seconds

        async def one(job: Job) -> None:
            nonlocal done
            delay = t_start + job.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with sem:
                if time.perf_counter() > deadline:
                    outcomes.append(Outcome(job.prompt_tokens, status="not_sent_time_limit"))
                    return
                outcomes.append(await run_one(client, args.url, job, vocab, rng))
            done += 1
            if done % max(1, len(jobs) // 10) == 0 or done == len(jobs):
                print(f"  {done}/{len(jobs)} requests done, {time.perf_counter() - t_start:.1f} s",
                      file=sys.stderr, flush=True)  # fmt: skip

        tasks = [asyncio.ensure_future(one(j)) for j in jobs]
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=args.max_seconds + 30)
        except TimeoutError:
            for t in tasks:
                t.cancel()
        return outcomes, time.perf_counter() - t_start


def summarize(outcomes: list[Outcome], wall: float, before: dict, after: dict) -> dict:
    ok = [o for o in outcomes if o.status == "ok"]
    failures: dict[str, int] = {}
    for o in outcomes:
        if o.status != "ok":
            failures[o.status] = failures.get(o.status, 0) + 1

    def delta(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    def ratio(num: float, den: float) -> float | None:
        return round(num / den, 4) if den else None

    itl = [x for o in ok for x in o.itl_s]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    e2e = [o.e2e_s for o in ok if o.e2e_s is not None]
    ms = lambda v: None if v is None else round(v * 1e3, 2)  # noqa: E731
    prefill_hits = delta("capture_service_prefill_batches_total", result="hit")
    decode_hits = delta("capture_service_decode_steps_total", result="hit")
    return {
        "requests_sent": len(outcomes),
        "requests_ok": len(ok),
        "failures": failures,
        "wall_s": round(wall, 3),
        "request_throughput": round(len(ok) / wall, 3),
        "input_tokens": sum(o.prompt_tokens for o in ok),
        "output_tokens": sum(o.output_tokens for o in ok),
        "input_tokens_per_s": round(sum(o.prompt_tokens for o in ok) / wall, 1),
        "output_tokens_per_s": round(sum(o.output_tokens for o in ok) / wall, 1),
        "ttft_ms": {"p50": ms(pct(ttft, 50)), "p90": ms(pct(ttft, 90)), "p99": ms(pct(ttft, 99))},
        "itl_ms": {"p50": ms(pct(itl, 50)), "p99": ms(pct(itl, 99))},
        "e2e_ms": {"mean": ms(statistics.fmean(e2e)) if e2e else None, "p99": ms(pct(e2e, 99))},
        "prefill_graph_hit_ratio": ratio(
            prefill_hits, delta("capture_service_prefill_batches_total")
        ),
        "prefill_padded_share": ratio(
            delta("capture_service_prefill_padded_tokens_total"),
            delta("capture_service_prefill_tokens_total")
            + delta("capture_service_prefill_padded_tokens_total"),
        ),
        "decode_graph_hit_ratio": ratio(decode_hits, delta("capture_service_decode_steps_total")),
        "server_requests_finished": delta("capture_service_requests_total"),
        "server_generated_tokens": delta("capture_service_generated_tokens_total"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--range-ratio", type=float, default=0.0,
                    help="lengths uniform in [len*(1-r), len*(1+r)] (0: fixed)")  # fmt: skip
    ap.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="Poisson arrivals per second (default: all at once, --concurrency)",
    )
    ap.add_argument("--concurrency", type=int, default=None,
                    help="requests in flight at most (default: unbounded)")  # fmt: skip
    ap.add_argument("--trace", type=Path, default=None,
                    help="CSV with arrival_s,prompt_tokens,output_tokens")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-token-id", type=int, default=10**9,
                    help="draw prompt ids below this (default: the vocabulary)")  # fmt: skip
    ap.add_argument("--max-seconds", type=float, default=600.0)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    jobs = trace_jobs(args.trace, args.num_requests) if args.trace else synthetic_jobs(args, rng)
    before = parse_metrics(httpx.get(args.url + "/metrics", timeout=30).text)
    print(f"serve benchmark: {len(jobs)} requests against {args.url}", file=sys.stderr)
    outcomes, wall = asyncio.run(drive(args, jobs))
    after = parse_metrics(httpx.get(args.url + "/metrics", timeout=30).text)
    result = summarize(outcomes, wall, before, after)
    result["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result["workload"] = [asdict(j) for j in jobs[:1000]]
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text)
    short = {k: v for k, v in result.items() if k not in ("args", "workload")}
    print(json.dumps(short, indent=2))
    return 0 if not result["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
