#!/usr/bin/env python3
"""The end-to-end decode peer: Hugging Face transformers, random bf16 weights of a named
shape, a bf16 StaticCache filled with random values to the context, SDPA attention; one
decode token per sequence per step, timed with CUDA events (median of --iters after
warm-up), eager and torch.compile(mode="reduce-overhead"). Each step writes the same
position (steady state, as our benchmark's replays do).

Usage: peer_hf_e2e.py --out FILE [--cases smollm2-135m:1:8192,llama-8b:8:32768]
                      [--compiled smollm2-135m:64:8192] [--iters 20]
"""
import argparse, json, statistics, sys, time

import torch

SHAPES = {
    # layers, heads, kv heads, head dim, ffn, vocab, rope base, tied
    "smollm2-135m": (30, 9, 3, 64, 1536, 49152, 100000.0, True),
    "llama-8b": (32, 32, 8, 128, 14336, 128256, 500000.0, False),
}


def build(name, max_len):
    from transformers import LlamaConfig, LlamaForCausalLM
    L, hq, hkv, d, f, v, base, tied = SHAPES[name]
    cfg = LlamaConfig(vocab_size=v, hidden_size=hq * d, intermediate_size=f, num_hidden_layers=L,
                      num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d,
                      max_position_embeddings=max(max_len, 8192), rope_theta=base, tie_word_embeddings=tied,
                      attn_implementation="sdpa")
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    return model.eval(), cfg


def make_cache(cfg, b, s):
    from transformers import StaticCache
    try:
        return StaticCache(config=cfg, max_cache_len=s + 8, max_batch_size=b, device="cuda", dtype=torch.bfloat16)
    except TypeError:
        return StaticCache(config=cfg, max_cache_len=s + 8)


def cache_tensors(cache):
    if hasattr(cache, "layers"):
        out = []
        for layer in cache.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                if isinstance(t, torch.Tensor):
                    out.append(t)
        return out
    return list(cache.key_cache) + list(cache.value_cache)


def time_case(name, b, s, iters, compiled):
    model, cfg = build(name, s + 8)
    cache = make_cache(cfg, b, s)
    ids = torch.randint(0, cfg.vocab_size, (b, 1), device="cuda")
    fwd = model.forward
    if compiled:
        fwd = torch.compile(model.forward, mode="reduce-overhead", fullgraph=False)
    with torch.no_grad():
        # A first step at position 0 initializes the cache's tensors; then fill them (random,
        # never zeros) as a prefill to s tokens would have.
        model(input_ids=ids, past_key_values=cache, cache_position=torch.tensor([0], device="cuda"), use_cache=True)
        for t in cache_tensors(cache):
            t.normal_()
        pos = torch.tensor([s], device="cuda")
        pid = torch.full((b, 1), s, device="cuda", dtype=torch.long)

        def step():
            return fwd(input_ids=ids, past_key_values=cache, cache_position=pos, position_ids=pid, use_cache=True).logits

        t0 = time.time()
        for _ in range(5 if compiled else 3):
            step()
        torch.cuda.synchronize()
        warm_s = time.time() - t0
        times = []
        for _ in range(iters):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            step()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1))
    peak = torch.cuda.max_memory_allocated() / 2**30
    del model, cache
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    ms = statistics.median(times)
    return {"model": name, "b": b, "s": s, "mode": "compiled" if compiled else "eager", "step_ms": ms,
            "step_ms_min": min(times), "step_ms_max": max(times), "tokens_per_s": b * 1000.0 / ms,
            "peak_gib": peak, "warmup_s": warm_s, "iters": iters}


def parse(spec):
    out = []
    for c in filter(None, spec.split(",")):
        n, b, s = c.split(":")
        out.append((n, int(b), int(s)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="smollm2-135m:1:8192,smollm2-135m:64:8192,llama-8b:8:32768,llama-8b:1:131072")
    ap.add_argument("--compiled", default="smollm2-135m:1:8192,smollm2-135m:64:8192,llama-8b:8:32768")
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    import transformers
    rows = []
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "transformers": transformers.__version__, "rows": rows}
    for compiled, spec in ((False, a.cases), (True, a.compiled)):
        for n, b, s in parse(spec):
            try:
                r = time_case(n, b, s, a.iters, compiled)
            except Exception as e:  # report and go on: one shape must not hide the others
                r = {"model": n, "b": b, "s": s, "mode": "compiled" if compiled else "eager", "error": repr(e)[:300]}
                torch.cuda.empty_cache()
            print(json.dumps(r), flush=True)
            rows.append(r)
            json.dump(meta, open(a.out, "w"), indent=1)  # after every case: a timeout keeps the rest


if __name__ == "__main__":
    sys.exit(main())
