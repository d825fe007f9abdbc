#!/usr/bin/env python3
"""Merge llama-bench `-o json` outputs and `veloxquant bench model --json` rows into one list
of rows (engine, cache, test, depth, tokens_per_s, batch, ...) and a Markdown table: test ×
depth rows, one column per engine/cache, then the ratios issue 17 asks about. Stdlib only;
called by peer_llamacpp.sh. Outputs are written to a temporary file and renamed."""

import argparse
import json
import os
import statistics


def llama_rows(path):
    """llama-bench's rows in our shape; tokens_per_s is the median of its per-rep samples."""
    with open(path) as f:
        data = json.load(f)
    rows = []
    for r in data:
        samples = r["samples_ts"]
        test = f"pp{r['n_prompt']}" if r["n_prompt"] > 0 else f"tg{r['n_gen']}"
        rows.append({
            "engine": "llama.cpp",
            "cache": f"{r['type_k']}/{r['type_v']}",
            "test": test,
            "depth": r["n_depth"],
            "tokens_per_s": statistics.median(samples),
            "batch": 1,
            "reps": len(samples),
            "min": min(samples),
            "max": max(samples),
            "samples_ts": samples,
            "avg_ts": r["avg_ts"],
            "stddev_ts": r["stddev_ts"],
            "threads": r["n_threads"],
            "flash_attn": r["flash_attn"],
            "build_commit": r["build_commit"],
            "cpu_info": r["cpu_info"],
            "model": os.path.basename(r["model_filename"]),
        })
    return rows


def column(r):
    name = "ours" if r["engine"] == "veloxquant" else r["engine"]
    b = f" B={r['batch']}" if r["batch"] != 1 else ""
    fa = " -fa 0" if r.get("flash_attn") == 0 else ""
    return f"{name} {r['cache']}{fa}{b}"


def write_atomic(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def test_key(t):
    return (0 if t.startswith("pp") else 1, int(t[2:]))


def render(rows, a):
    ours = [r for r in rows if r["engine"] == "veloxquant"]
    default = next((r["cache"] for r in ours if r["cache"] != "fp16"), None)
    cols = []
    order = lambda r: (r["engine"] != "llama.cpp", r["batch"], r["cache"] not in ("f16/f16", "fp16"),
                       r["cache"], r.get("flash_attn") == 0)
    for r in sorted(rows, key=order):
        if column(r) not in cols:
            cols.append(column(r))
    cell = {(r["test"], r["depth"], column(r)): r for r in rows}
    points = sorted({(r["test"], r["depth"]) for r in rows}, key=lambda p: (test_key(p[0]), p[1]))
    # Other work before the run, or beyond the run's own threads at its end (a 2-thread
    # benchmark itself lifts the 1-minute load average toward 2).
    load1 = lambda s: float(s.split("load average:")[1].split(",")[0])
    load_high = load1(a.load_before) > 1 or load1(a.load_after) > int(a.threads) + 1
    cpu = next((r["cpu_info"] for r in rows if "cpu_info" in r), "?")
    model = next((r["model"] for r in ours), os.path.basename(a.model))
    weights = next((r["weights"] for r in ours if "weights" in r), "?")
    out = [
        "# CPU model throughput: veloxquant vs llama.cpp (llama-bench)",
        "",
        f"{model} on {cpu}, {a.threads} threads, median of {a.reps} reps (min–max and samples in the JSON). "
        f"llama.cpp: llama-bench from the llama.cpp vendored in llama-cpp-python {a.llama_version} "
        f"(build {next((r['build_commit'] for r in rows if 'build_commit' in r), '?')}), `-fa 1`, "
        f"KV cache `-ctk/-ctv` (f16 also with `-fa 0`); built once in {a.build_seconds} s (Release, native ISA flags without AMX, `-j2`, under `nice`). "
        f"ours: `veloxquant bench model` (commit {a.commit}), `--weights {weights}`; "
        f"the default compressed cache is `{default}`.",
        "",
        "Both: random token ids, the depth filled untimed, one warm-up, every rep from the same "
        "filled state (llama.cpp restores a saved state; ours copies the filled cache). "
        "Run one after the other: llama.cpp f16 (-fa 1, 0), q4_0, then ours (tg, then pp)."
        + (f" **Here the llama.cpp rows are reused from an earlier run** ({a.llama_rows_note}); only ours ran now."
           if a.llama_rows else ""),
        "",
        f"Load before the run: `{a.load_before.strip()}`",
        "",
        f"Load after the run: `{a.load_after.strip()}`",
        "",
    ]
    if load_high:
        out += ["**Preliminary:** the load average was above 1 before the run, or above its threads + 1 after (the 2 cores are shared with other work), "
                "so both engines ran slower and noisier than on an idle machine.", ""]
    out += ["| test | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    beyond = False
    for t, d in points:
        cells = []
        for c in cols:
            r = cell.get((t, d, c))
            if r is not None:
                cells.append(f"{r['tokens_per_s']:.1f}")
            elif c.startswith("ours") and d + int(t[2:]) > a.n_ctx:
                cells.append("–¹")
                beyond = True
            else:
                cells.append("–")
        name = f"{t} @ d{d}" if d else t
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    if beyond:
        out += ["", f"¹ depth + N beyond the model's {a.n_ctx}-token context: ours refuses it, "
                "llama.cpp runs past its training context."]
    out += ["", "Ratios (tokens/s, ours ÷ llama.cpp):", "", "| ours | llama.cpp | test | ratio |", "|---|---|---|---:|"]

    def get(engine, cache, t, d):
        """Batch 1; llama.cpp with flash attention unless the cache names `-fa 0`."""
        cache, _, fa = cache.partition(" -fa ")
        r = next((r for r in rows if r["engine"] == engine and r["cache"] == cache and r["test"] == t
                  and r["depth"] == d and r["batch"] == 1
                  and (engine != "llama.cpp" or r.get("flash_attn") == int(fa or 1))), None)
        return r and r["tokens_per_s"]

    tg = sorted({r["test"] for r in rows if r["test"].startswith("tg")}, key=test_key)
    pp = sorted({r["test"] for r in rows if r["test"].startswith("pp")}, key=test_key)
    depths = sorted({r["depth"] for r in rows})
    pairs = []
    for t in tg:
        for d in depths:
            if d > 0:
                pairs += [(default, "q4_0/q4_0", t, d), (default, "f16/f16", t, d), (default, "f16/f16 -fa 0", t, d)]
        pairs += [("fp16", "f16/f16", t, 0), ("fp16", "f16/f16 -fa 0", t, 0)]
    for t in pp:
        for d in depths:
            pairs += [("fp16", "f16/f16", t, d), ("fp16", "f16/f16 -fa 0", t, d), (default, "q4_0/q4_0", t, d)]
    for o, l, t, d in pairs:
        x, y = get("veloxquant", o, t, d), get("llama.cpp", l, t, d)
        if x and y:
            out.append(f"| {o} | {l} | {t} @ d{d} | {x / y:.2f}× |")
    return "\n".join(out) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--llama", nargs="*", default=[])
    p.add_argument("--llama-rows", help="reuse the llama.cpp rows of an earlier merged JSON (LLAMA_ROWS)")
    p.add_argument("--llama-rows-note", default="", help="when and how those rows were measured")
    p.add_argument("--ours", nargs="+", required=True)
    p.add_argument("--load-before", required=True)
    p.add_argument("--load-after", required=True)
    p.add_argument("--threads", required=True)
    p.add_argument("--reps", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--llama-version", required=True)
    p.add_argument("--build-seconds", required=True)
    p.add_argument("--commit", required=True)
    p.add_argument("--n-ctx", type=int, default=8192)
    p.add_argument("--json", required=True)
    p.add_argument("--md", required=True)
    a = p.parse_args()
    rows = [r for f in a.llama for r in llama_rows(f)]
    if a.llama_rows:
        with open(a.llama_rows) as fh:
            rows += [dict(r, reused_from=os.path.basename(a.llama_rows)) for r in json.load(fh) if r["engine"] == "llama.cpp"]
    for f in a.ours:
        with open(f) as fh:
            rows += json.load(fh)
    md = render(rows, a)
    write_atomic(a.json, json.dumps(rows, indent=1) + "\n")
    write_atomic(a.md, md)
    print(md)


if __name__ == "__main__":
    main()
