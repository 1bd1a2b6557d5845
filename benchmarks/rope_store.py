"""Rotary on q and k plus the K/V store: FlashInfer's rotary kernel then the indexed store (what
the model ran before session 31) against the one Triton kernel (service.model.rope_store_triton),
per token count and block size (GPU only).

Device us per call inside one CUDA graph of 20 calls (``gemm_shapes.graph_us``), Qwen2.5-1.5B's
shapes by default (12 q and 2 K/V heads of 128 per rank, q, k, v column slices of one qkv row);
the floor is the bytes the fused kernel must move (read q, k, v; write q, k and the cache's K and
V) at the measured copy rate. With ``--host``, the host time of one eager call of each: 200
calls queued back to back, no synchronisation inside, wall time per call.

    python benchmarks/rope_store.py --m 16,256,2048,8192 --out rope_store.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.gemm_shapes import graph_us
from service.model.rope_store_policy import block_tokens
from service.ranks.kv_pool import store_entries

BLOCKS = (8, 16, 32, 64)


def copy_rate() -> float:
    """Bytes per second of a 1 GiB device-to-device copy."""
    a = torch.empty(1 << 29, dtype=torch.int16, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() * a.element_size() / (graph_us(lambda: b.copy_(a), reps=5) * 1e-6)


def host_us(fn, calls: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e6 / calls


def measure(
    t: int, heads: tuple[int, int], d: int, table: torch.Tensor, rate: float, host: bool
) -> dict:
    """One token count: the pair, its parts, the kernel at each block size (device us)."""
    import flashinfer

    from service.model import rope_store_triton as rs

    hq, hkv = heads
    dev = table.device
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=dev).to(torch.bfloat16)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    positions = torch.arange(t, device=dev)
    loc = torch.arange(1, t + 1, device=dev)
    kv = torch.zeros(t + 1, 2, hkv, d, dtype=torch.bfloat16, device=dev)

    def rope() -> None:
        flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(positions, q, k, d, table, True)

    def store() -> None:
        store_entries(kv, loc, k.view(t, hkv, d), v.view(t, hkv, d))

    def pair() -> None:
        rope()
        store()

    def kernel(block: int | None = None):
        return lambda: rs.rope_store(qkv, heads, d, positions, table, kv, loc, block=block)

    moved = t * ((hq + 2 * hkv) * d + (hq + hkv) * d + 2 * hkv * d) * 2  # bytes
    row = {"tokens": t, "floor_us": moved / rate * 1e6, "rope_us": graph_us(rope),
           "store_us": graph_us(store), "pair_us": graph_us(pair),
           "blocks_us": {b: graph_us(kernel(b)) for b in BLOCKS},
           "policy_block": block_tokens(t)}  # fmt: skip
    row["policy_us"] = row["blocks_us"][row["policy_block"]]
    if host:
        row["host_pair_us"] = host_us(pair)
        row["host_kernel_us"] = host_us(kernel())
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default="16,64,256,1024,2048,4096,8192", help="token counts")
    ap.add_argument("--heads", default="12,2", help="q and K/V heads per rank")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--host", action="store_true", help="also the host us of one eager call")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    hq, hkv = (int(x) for x in args.heads.split(","))
    d = args.head_dim
    dev = torch.device("cuda")
    rate = copy_rate()
    table = torch.randn(32768, d, device=dev)
    rows = []
    print(f"copy {rate / 1e12:.2f} TB/s; heads {hq}/{hkv} of {d}")
    print(f"{'tokens':>7} {'floor':>7} {'rope':>7} {'store':>7} {'pair':>7} "
          + " ".join(f"{'bt' + str(b):>7}" for b in BLOCKS) + f" {'policy':>7} {'/pair':>6}"
          + ("  host us: pair / kernel" if args.host else ""))  # fmt: skip
    for t in [int(x) for x in args.m.split(",")]:
        row = measure(t, (hq, hkv), d, table, rate, args.host)
        rows.append(row)
        print(f"{t:>7} {row['floor_us']:>7.2f} {row['rope_us']:>7.2f} {row['store_us']:>7.2f} "
              f"{row['pair_us']:>7.2f} " + " ".join(f"{row['blocks_us'][b]:>7.2f}" for b in BLOCKS)
              + f" {row['policy_us']:>7.2f} {row['policy_us'] / row['pair_us']:>6.2f}"
              + (f"  {row['host_pair_us']:.1f} / {row['host_kernel_us']:.1f}" if args.host
                 else ""))  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps({"copy_bytes_per_s": rate, "rows": rows,
                                              "device": torch.cuda.get_device_name(),
                                              "args": vars(args)}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
