#!/usr/bin/env python3
"""Peer for `veloxquant-cuda-bench`: PyTorch scaled_dot_product_attention decode, bf16 K/V.

For each shape and the ragged case (one query token per sequence), time the flash and cuDNN backends with CUDA
events (median of --iters after warm-up, rotating among several K/V sets so L2 cannot help)
and keep the fastest, three ways as `veloxquant-cuda-bench` does: one synchronized call per
event pair, ten back-to-back calls, ten calls captured in a CUDA graph and replayed. Writes
{"rows": [{b, hq, hkv, d, s, backend, peer_us, stream_backend, peer_stream_us, graph_backend,
peer_graph_us, all}]}.
"""
import argparse, json, statistics
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [(1, 32, 8, 32768), (1, 32, 8, 131072), (8, 32, 8, 32768), (32, 32, 8, 8192), (1, 32, 32, 32768)]
# veloxquant-cuda-bench's ragged case (bench.rs RAGGED_LENS): eight unequal lengths, Hq 32, Hkv 8.
# Ours keeps 4 sinks and 128 recent tokens exact inside these lengths; here every token is bf16.
# The peer attends each sequence with its own call (no padding), so a step is eight calls.
RAGGED_LENS = [32768, 30103, 26001, 20517, 14339, 9001, 4099, 1031]
D = 128


def event_median(body, reps, per):
    """Median over `reps` of the CUDA-event-timed duration (us) of body(r), divided by `per`."""
    times = []
    for r in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        body(r)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / per)
    return statistics.median(times)


def time_backend(backend, qs, ks, vs, gqa, warm, iters):
    """qs[j], ks[j], vs[j]: set j's lists of per-call tensors (one call for a uniform batch, one
    per sequence for the ragged case)."""
    def call(i):
        j = i % len(ks)
        return [F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa) for q, k, v in zip(qs[j], ks[j], vs[j])]

    with sdpa_kernel([backend]):
        for i in range(warm):
            call(i)
        torch.cuda.synchronize()
        single = event_median(call, iters, 1)
        # back-to-back: 10 calls between the events (the host runs ahead, as in a decode loop)
        streamed = event_median(lambda r: [call(r * 10 + i) for i in range(10)], iters, 10)
        # graph: 10 calls captured once into a CUDA graph, replayed (no host launch cost)
        graph = None
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for i in range(3):
                    call(i)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for i in range(10):
                    call(i)
            g.replay()
            torch.cuda.synchronize()
            graph = event_median(lambda r: g.replay(), iters, 10)
        except Exception as e:  # backend not capturable
            print(f"peer graph capture failed: {type(e).__name__}: {str(e)[:80]}")
    return single, streamed, graph


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="peer.json")
    ap.add_argument("--iters", type=int, default=100)
    a = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    cases = [(b, hq, hkv, [s] * b, "uniform") for (b, hq, hkv, s) in SHAPES]
    cases.append((len(RAGGED_LENS), 32, 8, RAGGED_LENS, "ragged"))
    for (b, hq, hkv, lens, case) in cases:
        s = max(lens)
        kv_bytes = 2 * hkv * sum(lens) * D * 2
        n_sets = max(1, min(4, -(-(256 << 20) // kv_bytes)))
        # a uniform batch is one call; the ragged case one call per sequence
        groups = [(b, s)] if case == "uniform" else [(1, n) for n in lens]
        qs = [[torch.randn(g, hq, 1, D, device="cuda", dtype=torch.bfloat16) for g, _ in groups] for _ in range(n_sets)]
        ks = [[torch.randn(g, hkv, n, D, device="cuda", dtype=torch.bfloat16) for g, n in groups] for _ in range(n_sets)]
        vs = [[torch.randn(g, hkv, n, D, device="cuda", dtype=torch.bfloat16) for g, n in groups] for _ in range(n_sets)]
        res = {}
        for name, be in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]:
            try:
                res[name] = time_backend(be, qs, ks, vs, hq != hkv, 10, a.iters)
            except Exception as e:  # backend refuses this shape
                res[name] = None
                print(f"peer {name} B={b} Hq={hq} Hkv={hkv} S={s} {case}: unavailable ({type(e).__name__}: {str(e)[:80]})")
        ok = {k: v for k, v in res.items() if v is not None}
        best = min(ok, key=lambda k: ok[k][0])
        us = ok[best][0]
        best_s = min(ok, key=lambda k: ok[k][1])
        us_s = ok[best_s][1]
        okg = {k: v[2] for k, v in ok.items() if v[2] is not None}
        best_g = min(okg, key=okg.get) if okg else None
        us_g = okg[best_g] if okg else None
        print(f"peer B={b:2d} Hq={hq} Hkv={hkv} S={s:6d} {case}: {us:8.1f} us ({best}) {kv_bytes / us / 1e6:5.2f} TB/s"
              f"  streamed {us_s:8.1f} us ({best_s})  graph {us_g} us ({best_g})  all={res}", flush=True)
        rows.append({"b": b, "hq": hq, "hkv": hkv, "d": D, "s": s, "case": case, "lens": lens, "backend": best, "peer_us": us,
                     "stream_backend": best_s, "peer_stream_us": us_s, "graph_backend": best_g,
                     "peer_graph_us": us_g, "all": res, "kv_bytes": kv_bytes})
        del qs, ks, vs
        torch.cuda.empty_cache()
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
