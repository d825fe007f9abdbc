#!/usr/bin/env python3
"""Bounded load test of `veloxquant serve` on loopback (standard library only).

Modes:
  load      N concurrent streaming clients, R requests with prompt lengths log-uniform in
            [min, max] tokens, a fraction disconnecting mid-stream; every request must end
            with its tokens or a clean error, none may hang; afterwards /metrics must show
            zero running sequences and zero live KV bytes. Reports p50/p99 latency, time to
            first token and total tokens/s; samples the server's resident memory.
  batching  the same 16 short-prompt requests one at a time, then all at once: decode
            tokens/s of each and their ratio.
  prefix    16 requests sharing a 1,024-token prefix, prefix sharing on vs off
            (--max-prefixes 0): KV bytes at the peak and prompt tokens computed.
  greedy    `veloxquant generate` (--generate-args: the server's model, device, method) on a
            few text prompts, then the same prompts through the server at temperature 0,
            one at a time and all together (each 4 times): the texts must be equal.

The server is started from --binary (and stopped with SIGTERM, which must exit 0), or an
already running one is used with --url. Prompts are token-id arrays (exact lengths).
Only 127.0.0.1 is ever contacted; every loop is bounded in count and time.
"""

import argparse
import asyncio
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request


def percentile(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def http_get(base, path, timeout=10):
    with urllib.request.urlopen(f"{base}{path}", timeout=timeout) as r:
        return r.read().decode()


def metrics(base):
    out = {}
    for line in http_get(base, "/metrics").splitlines():
        if line.startswith("veloxquant_"):
            k, v = line.split()
            out[k[len("veloxquant_"):]] = int(float(v))
    return out


async def one_request(host, port, body, disconnect_after, timeout):
    """Streams one completion. Returns a dict: outcome, status, latency, ttft, tokens."""
    t0 = time.monotonic()
    res = {"outcome": None, "status": None, "latency": None, "ttft": None, "tokens": 0, "prompt": len(body["prompt"])}
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
    except Exception as e:  # noqa: BLE001 - report, don't crash the run
        res["outcome"] = f"connect error: {e}"
        return res
    payload = json.dumps(body).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: load\r\nConnection: close\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    try:
        await writer.drain()

        async def run():
            status_line = await reader.readline()
            res["status"] = int(status_line.split()[1])
            headers = {}
            while True:
                line = (await reader.readline()).decode().strip()
                if not line:
                    break
                k, _, v = line.partition(":")
                headers[k.lower()] = v.strip()
            if res["status"] != 200:
                body_bytes = await reader.read(65536)
                try:
                    err = json.loads(body_bytes)
                except Exception:  # noqa: BLE001
                    err = body_bytes[:200].decode(errors="replace")
                res["outcome"] = f"http {res['status']}"
                res["error"] = err
                return
            buf, events = b"", 0
            while True:
                size_line = await reader.readline()
                if not size_line:
                    res["outcome"] = "closed early"
                    return
                size = int(size_line.strip() or b"0", 16)
                if size == 0:
                    res["outcome"] = res["outcome"] or "no [DONE]"
                    return
                buf += await reader.readexactly(size + 2)
                while b"\n\n" in buf:
                    ev, buf = buf.split(b"\n\n", 1)
                    ev = ev.strip(b"\r\n")
                    if not ev.startswith(b"data: "):
                        continue
                    data = ev[len(b"data: "):]
                    if data == b"[DONE]":
                        res["outcome"] = "ok" if res["outcome"] is None else res["outcome"]
                        return
                    obj = json.loads(data)
                    if "error" in obj:
                        res["outcome"] = f"error event: {obj['error'].get('code') or obj['error'].get('message')}"
                        continue
                    events += 1
                    ch = obj["choices"][0]
                    if ch.get("text") and res["ttft"] is None:
                        res["ttft"] = time.monotonic() - t0
                    if "usage" in obj:
                        res["tokens"] = obj["usage"]["completion_tokens"]
                    if disconnect_after is not None and events >= disconnect_after:
                        res["outcome"] = "disconnected"
                        return

        await asyncio.wait_for(run(), timeout)
    except asyncio.TimeoutError:
        res["outcome"] = "HUNG (timeout)"
    except Exception as e:  # noqa: BLE001
        res["outcome"] = f"client error: {type(e).__name__}: {e}"
    finally:
        res["latency"] = time.monotonic() - t0
        writer.close()
    return res


async def run_requests(host, port, specs, clients, timeout):
    queue = asyncio.Queue()
    for s in specs:
        queue.put_nowait(s)
    results = []

    async def worker():
        while True:
            try:
                body, disc = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            results.append(await one_request(host, port, body, disc, timeout))

    t0 = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return results, time.monotonic() - t0


def prompt_ids(rng, n, vocab=(300, 40000)):
    return [rng.randrange(*vocab) for _ in range(n)]


class ServerProc:
    """A `veloxquant serve` child on a loopback port; RSS sampled from /proc."""

    def __init__(self, binary, port, extra):
        self.port = port
        cmd = [binary, "serve", "--port", str(port)] + extra
        print("starting:", " ".join(cmd), file=sys.stderr)
        # The server's stderr goes to a file (a pipe nobody reads could fill and block it).
        self.log_path = f"/tmp/veloxquant-serve-{port}-{os.getpid()}.log"
        self.log = open(self.log_path, "w")
        env = dict(os.environ, RUST_BACKTRACE="1")
        self.p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, env=env)
        self.base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise SystemExit(f"server exited: {self.log_tail()}")
            try:
                http_get(self.base, "/health", timeout=1)
                return
            except Exception:  # noqa: BLE001
                time.sleep(0.25)
        self.p.kill()
        raise SystemExit("server did not come up")

    def rss_mib(self):
        try:
            with open(f"/proc/{self.p.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            return None
        return None

    def log_tail(self, n=4000):
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-n:]

    def stop(self, grace=60):
        self.p.send_signal(signal.SIGTERM)
        try:
            code = self.p.wait(grace)
        except subprocess.TimeoutExpired:
            self.p.kill()
            return "killed after SIGTERM timeout"
        return code


async def sample_server(srv, base, stop, out):
    """Every 0.5 s: the server's RSS (when we started it) and its running sequences; every
    10 s a progress line on stderr (so a run that times out still says where it was)."""
    t0 = last = time.monotonic()
    keys = ["sequences_running", "queue_length", "steps_total", "step_rows_total", "prefill_tokens_total",
            "generated_tokens_total", "forward_micros_total", "forward_micros_max", "admit_micros_total", "output_micros_total",
            "publish_micros_total", "decode_steps_total", "decode_micros_total", "requests_failed_total"]
    while not stop.is_set():
        if time.monotonic() - last >= 10:
            last = time.monotonic()
            try:
                m = await asyncio.to_thread(metrics, base)
                print("progress %.0fs " % (last - t0) + " ".join("%s=%s" % (k, m.get(k)) for k in keys),
                      file=sys.stderr, flush=True)
            except Exception as e:  # noqa: BLE001
                print("progress: metrics failed: %s" % e, file=sys.stderr, flush=True)
        r = srv.rss_mib() if srv else None
        if r is not None:
            out["rss"].append(r)
        try:
            m = await asyncio.to_thread(metrics, base)
            out["running"].append(m["sequences_running"])
            out["kv"].append(m["kv_bytes_in_use"] + m["kv_bytes_cached"])
        except Exception:  # noqa: BLE001 - a sample missed under load is not a failure
            pass
        await asyncio.sleep(0.5)


def wait_drained(base, seconds=60):
    deadline = time.monotonic() + seconds
    m = metrics(base)
    while time.monotonic() < deadline:
        m = metrics(base)
        if m["sequences_running"] == 0 and m["kv_bytes_in_use"] == 0 and m["queue_length"] == 0:
            return True, m
        time.sleep(0.2)
    return False, m


def summarize(results, wall):
    ok = [r for r in results if r["outcome"] == "ok"]
    lat = [r["latency"] for r in ok]
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    outcomes = {}
    for r in results:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    return {
        "requests": len(results),
        "outcomes": outcomes,
        "wall_s": wall,
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall if wall else None,
        "latency_p50_s": percentile(lat, 0.5),
        "latency_p99_s": percentile(lat, 0.99),
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
    }


async def mode_load(a, base, host, port, srv):
    rng = random.Random(a.seed)
    specs = []
    for i in range(a.requests):
        n = int(round(math.exp(rng.uniform(math.log(a.min_prompt), math.log(a.max_prompt)))))
        body = {"prompt": prompt_ids(rng, n), "max_tokens": a.max_tokens, "temperature": 0.8, "seed": i, "stream": True}
        disc = rng.randint(1, 4) if rng.random() < a.disconnect else None
        specs.append((body, disc))
    stop, samples = asyncio.Event(), {"rss": [], "running": [], "kv": []}
    sampler = asyncio.create_task(sample_server(srv, base, stop, samples))
    results, wall = await run_requests(host, port, specs, a.clients, a.timeout)
    stop.set()
    await sampler
    drained, m = wait_drained(base)
    s = summarize(results, wall)
    s.update({
        "clients": a.clients, "max_tokens": a.max_tokens, "prompt_tokens_range": [a.min_prompt, a.max_prompt],
        "disconnect_fraction": a.disconnect, "disconnected": sum(1 for _, d in specs if d is not None),
        "drained": drained, "metrics_after": m,
        "rss_mib_max": max(samples["rss"]) if samples["rss"] else None,
        "sequences_running_max": max(samples["running"]) if samples["running"] else None,
        "kv_bytes_max_sampled": max(samples["kv"]) if samples["kv"] else None,
    })
    bad = {k: v for k, v in s["outcomes"].items() if k not in ("ok", "disconnected") and not str(k).startswith("http 503")}
    s["pass"] = drained and not bad and all(r["outcome"] is not None for r in results)
    return s


async def mode_batching(a, base, host, port, srv):
    rng = random.Random(a.seed)
    specs = [({"prompt": prompt_ids(rng, 32), "max_tokens": a.max_tokens, "temperature": 0, "stream": True}, None)
             for _ in range(16)]
    m0 = metrics(base)
    seq, wall1 = await run_requests(host, port, specs, 1, a.timeout)
    m1 = metrics(base)
    par, wall16 = await run_requests(host, port, specs, 16, a.timeout)
    m2 = metrics(base)

    def decode_rate(res, wall, ma, mb):
        toks = sum(r["tokens"] for r in res)
        # Decode time: wall minus each request's time to first token when one at a time;
        # all at once, the span from the last first token to the end.
        return toks, wall, (mb["steps_total"] - ma["steps_total"])

    t1, _, st1 = decode_rate(seq, wall1, m0, m1)
    t16, _, st16 = decode_rate(par, wall16, m1, m2)
    dec1 = t1 / (wall1 - sum(r["ttft"] or 0 for r in seq))
    dec16 = t16 / (wall16 - max(r["ttft"] or 0 for r in par))
    return {
        "one_at_a_time": {"tokens": t1, "wall_s": wall1, "steps": st1, "total_tokens_per_s": t1 / wall1,
                          "decode_tokens_per_s": dec1},
        "sixteen_at_once": {"tokens": t16, "wall_s": wall16, "steps": st16, "total_tokens_per_s": t16 / wall16,
                            "decode_tokens_per_s": dec16},
        "total_speedup": (t16 / wall16) / (t1 / wall1),
        "decode_speedup": dec16 / dec1,
        "same_token_counts": t1 == t16,
    }


GREEDY_PROMPTS = [
    "The lighthouse keeper had lived alone on the island for twenty years. One stormy night,",
    "Photosynthesis is the process by which",
    "def fibonacci(n):",
    "The three most important things to remember when learning a new language are",
]


def completion_text(base, prompt, max_tokens, timeout):
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())["choices"][0]["text"].rstrip("\n")


def generate_text(a, prompt):
    """`veloxquant generate`'s completion of `prompt`: its output before the summary line."""
    cmd = [a.binary, "generate", "--prompt", prompt, "--max-tokens", str(a.max_tokens)] + a.generate_args.split()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, check=True).stdout
    body = out.rstrip("\n").rsplit("\n", 1)[0]  # the last line is the summary
    assert body.startswith(prompt), f"generate's output does not start with the prompt: {body[:80]!r}"
    return body[len(prompt):].rstrip("\n")


async def mode_greedy(a, base, host, port, srv):
    import concurrent.futures

    want = [generate_text(a, p) for p in GREEDY_PROMPTS]
    alone = [completion_text(base, p, a.max_tokens, a.timeout) for p in GREEDY_PROMPTS]
    batch = GREEDY_PROMPTS * 4
    with concurrent.futures.ThreadPoolExecutor(len(batch)) as ex:
        together = list(ex.map(lambda p: completion_text(base, p, a.max_tokens, a.timeout), batch))
    rows = []
    for i, p in enumerate(GREEDY_PROMPTS):
        got = together[i::len(GREEDY_PROMPTS)]
        rows.append({"prompt": p, "generate": want[i], "alone_equal": alone[i] == want[i],
                     "together_equal": sum(g == want[i] for g in got), "together_runs": len(got),
                     "alone": alone[i] if alone[i] != want[i] else None,
                     "together_differing": [g for g in got if g != want[i]][:1] or None})
    ok = all(r["alone_equal"] and r["together_equal"] == r["together_runs"] for r in rows)
    for r in rows:
        print("%-40.40s alone %s, together %d/%d" % (r["prompt"], "equal" if r["alone_equal"] else "DIFFERENT",
                                                      r["together_equal"], r["together_runs"]), file=sys.stderr)
    return {"rows": rows, "pass": ok, "max_tokens": a.max_tokens, "generate_args": a.generate_args}


async def mode_prefix(a, base, host, port, srv):
    rng = random.Random(a.seed)
    shared = prompt_ids(rng, 1024)
    specs = [({"prompt": shared + prompt_ids(rng, 32), "max_tokens": a.max_tokens, "temperature": 0, "stream": True},
              None) for _ in range(16)]
    m0 = metrics(base)
    res, wall = await run_requests(host, port, specs, 16, a.timeout)
    drained, m1 = wait_drained(base)
    return {
        "requests": len(res), "outcomes": summarize(res, wall)["outcomes"], "wall_s": wall,
        "prompt_tokens": m1["prompt_tokens_total"] - m0["prompt_tokens_total"],
        "prefill_tokens": m1["prefill_tokens_total"] - m0["prefill_tokens_total"],
        "prefix_hits": m1["prefix_cache_hits_total"] - m0["prefix_cache_hits_total"],
        "kv_bytes_peak": m1["kv_bytes_peak"], "drained": drained,
    }


def markdown(out):
    """The report as a Markdown table (what README's Serving section shows)."""
    f = lambda x, d=2: "–" if x is None else (f"{x:.{d}f}" if isinstance(x, float) else str(x))  # noqa: E731
    rows = []
    if out["mode"] == "load":
        rows.append("| run | requests | outcomes | p50 / p99 latency s | p50 / p99 TTFT s | tokens/s | max running | "
                    "drained | RSS MiB max | SIGTERM exit |")
        rows.append("|---|---|---|---|---|---|---|---|---|---|")
        for r in out["runs"]:
            oc = ", ".join(f"{k} {v}" for k, v in sorted(r["outcomes"].items()))
            rows.append(f"| {r['label']} {r['server_args']} | {r['requests']} | {oc} | {f(r['latency_p50_s'])} / "
                        f"{f(r['latency_p99_s'])} | {f(r['ttft_p50_s'])} / {f(r['ttft_p99_s'])} | "
                        f"{f(r['tokens_per_s'], 1)} | {f(r.get('sequences_running_max'))} | {r['drained']} | "
                        f"{f(r.get('rss_mib_max'), 0)} | {r.get('sigterm_exit_code')} |")
    elif out["mode"] == "batching":
        r = out["runs"][0]
        rows.append("| requests | one at a time: decode tokens/s | 16 at once: decode tokens/s | decode speedup | "
                    "total tokens/s (1 → 16) | total speedup |")
        rows.append("|---|---|---|---|---|---|")
        a, b = r["one_at_a_time"], r["sixteen_at_once"]
        rows.append(f"| 16 × {a['tokens'] // 16} tokens | {f(a['decode_tokens_per_s'], 1)} | "
                    f"{f(b['decode_tokens_per_s'], 1)} | {f(r['decode_speedup'])}× | "
                    f"{f(a['total_tokens_per_s'], 1)} → {f(b['total_tokens_per_s'], 1)} | {f(r['total_speedup'])}× |")
    elif out["mode"] == "greedy":
        rows.append("| prompt | server alone = generate | server, 16 at once = generate |")
        rows.append("|---|---|---|")
        for r in out["runs"][0]["rows"]:
            rows.append(f"| {r['prompt'][:40]} | {r['alone_equal']} | {r['together_equal']}/{r['together_runs']} |")
    else:
        rows.append("| prefix sharing | prompt tokens | prefill tokens computed | prefix hits | KV bytes at peak | wall s |")
        rows.append("|---|---|---|---|---|---|")
        for r in out["runs"]:
            rows.append(f"| {r['label']} | {r['prompt_tokens']} | {r['prefill_tokens']} | {r['prefix_hits']} | "
                        f"{r['kv_bytes_peak']} | {f(r['wall_s'], 1)} |")
        if "kv_bytes_ratio" in out:
            rows.append("")
            rows.append(f"on / off: KV bytes {out['kv_bytes_ratio']:.3f}, prefill tokens "
                        f"{out['prefill_tokens_ratio']:.3f} (targets ≤ 0.25)")
    return "\n".join(rows) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["load", "batching", "prefix", "greedy", "md"])
    ap.add_argument("--generate-args", default="", help="mode greedy: `generate` arguments (model, device, method)")
    ap.add_argument("--from-json", help="mode md: render this saved report")
    ap.add_argument("--binary", help="veloxquant binary to start (else --url)")
    ap.add_argument("--url", help="an already running server, http://127.0.0.1:PORT")
    ap.add_argument("--port", type=int, default=18123)
    ap.add_argument("--server-args", default="", help="extra `serve` arguments, one string")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--disconnect", type=float, default=0.10)
    ap.add_argument("--timeout", type=float, default=900, help="seconds before a request counts as hung")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--md", help="write the report as a Markdown table here")
    a = ap.parse_args()
    if a.mode == "greedy" and not a.binary:
        ap.error("mode greedy runs `veloxquant generate`: it needs --binary")
    if a.mode == "md":
        with open(a.from_json) as f:
            text = markdown(json.load(f))
        if a.md:
            with open(a.md, "w") as f:
                f.write(text)
        print(text, end="")
        return
    runs = []
    if a.mode == "prefix" and a.binary:
        variants = [("sharing on", a.server_args), ("sharing off", a.server_args + " --max-prefixes 0")]
    else:
        variants = [(a.mode, a.server_args)]
    for label, extra in variants:
        srv = ServerProc(a.binary, a.port, extra.split()) if a.binary else None
        base = srv.base if srv else a.url.rstrip("/")
        host, port = base.split("//")[1].split(":")
        assert host in ("127.0.0.1", "localhost"), "loopback only"
        fn = {"load": mode_load, "batching": mode_batching, "prefix": mode_prefix, "greedy": mode_greedy}[a.mode]
        rep = asyncio.run(fn(a, base, host, int(port), srv))
        rep["label"] = label
        rep["server_args"] = extra
        if srv:
            rep["rss_mib_end"] = srv.rss_mib()
            rep["sigterm_exit_code"] = srv.stop()
            rep["server_log_tail"] = srv.log_tail()
        runs.append(rep)
        print(json.dumps(rep, indent=1, default=str))
    out = {"mode": a.mode, "runs": runs, "date": time.strftime("%Y-%m-%d"), "host_cpus": os.cpu_count()}
    if a.mode == "prefix" and len(runs) == 2:
        on, off = runs
        out["kv_bytes_ratio"] = on["kv_bytes_peak"] / off["kv_bytes_peak"]
        out["prefill_tokens_ratio"] = on["prefill_tokens"] / off["prefill_tokens"]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    if a.md:
        with open(a.md, "w") as f:
            f.write(markdown(out))
    ok = all(r.get("pass", True) and r.get("drained", True) for r in runs)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
