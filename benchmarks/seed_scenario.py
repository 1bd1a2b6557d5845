"""The seed's scenario against a running server: two 1,301-token prompts prefilled together.

The original fix (../shared/seed/) was verified on DeepSeek-R1 with `breakable`, context 2048,
a request pool of 8 and chunked prefill 4096: the 4,096-token bucket is captured as two
2,048-token synthetic requests, and two 1,301-token prompts then prefill together through a
graph. This client sends those prompts (random token ids, 4 new tokens each, one /generate
call so that they share a prefill batch), reads /server_info, and prints what a user checks:
graph hit or miss, the bucket and its synthetic capture lengths, and the capture's seconds and
memory (the bucket hit, the 4,096-token bucket, and every bucket together).

    python benchmarks/seed_scenario.py --url http://127.0.0.1:30000 --out seed.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import urllib.request


def call(url: str, body: dict | None = None, timeout: float = 600.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--prompt-len", type=int, default=1301)
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    info = call(f"{args.url}/server_info")
    rng = random.Random(0)
    vocab = info["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(2)]
    t0 = time.perf_counter()
    outs = call(
        f"{args.url}/generate",
        {
            "input_ids": prompts,
            "sampling_params": {"max_new_tokens": args.new_tokens, "ignore_eos": True},
        },
    )
    seconds = time.perf_counter() - t0
    stats = {s["num_tokens"]: s for c in info["capture"] for s in c["buckets"]}
    buckets = {b["num_tokens"]: b for b in info["buckets"]}
    print(f"model {info['model']}  backend {info['prefill_backend']}  graphs {info['graph_kind']}")
    print(f"attention: {info['attention_backend']}")
    total = info["capture"][0]
    print(
        f"capture: {len(stats)} buckets in {total['seconds']:.2f} s, "
        f"{total['memory_bytes'] / 2**30:.2f} GiB (rank 0)"
    )
    ok = True
    for i, out in enumerate(outs):
        meta = out["meta_info"]
        for rec in meta["prefill_batches"]:
            b = rec["bucket"]
            lens = buckets.get(b, {}).get("capture_seq_lens")
            stat = stats.get(b, {})
            print(
                f"prompt {i}: cuda_graph {meta['cuda_graph']}  hit {rec['graph_hit']}  "
                f"tokens {rec['num_tokens']}  bucket {b} captured as {lens}  "
                f"capture {stat.get('seconds', 0):.2f} s {stat.get('memory_bytes', 0) / 2**30:.2f} "
                f"GiB  output {len(out['output_ids'])} tokens"
            )
        ok = ok and meta["cuda_graph"] is True and len(out["output_ids"]) == args.new_tokens
    if 4096 in stats:
        s = stats[4096]
        print(
            f"bucket 4096 captured as {buckets[4096]['capture_seq_lens']} in {s['seconds']:.2f} s, "
            f"{s['memory_bytes'] / 2**30:.2f} GiB"
        )
    print(f"request: {seconds:.2f} s end to end; {'PASS' if ok else 'FAIL'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"server_info": info, "outputs": outs, "seconds": seconds}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
