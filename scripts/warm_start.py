#!/usr/bin/env python3
"""How long a kvrouter that starts late takes to know what an engine already cached.

A kvsim replica publishes KV events and serves vLLM's replay socket; N blocks are cached before
any router listens. Then two routers start side by side, one with `kv_events.replay` and one
without, and this polls each one's `/debug/endpoints` until it tracks the engine blocks a warm
router would (all N), or a deadline passes. Repeated `rounds` times on fresh processes; prints
each round and the median with the range.

Usage: scripts/warm_start.py [blocks] [rounds] [deadline_s]   (needs `make release`;
BIN=target/debug to use a debug build)
"""
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / os.environ.get("BIN", "target/release")
BLOCK = 16
PER_REQUEST = 64  # blocks per request (1024 tokens)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, timeout=2.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def wait_ok(url, deadline_s=30.0):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            get(url, 0.5)
            return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"{url} not ready within {deadline_s} s")


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status


def endpoint_row(admin, address):
    table = json.loads(get(f"http://{admin}/debug/endpoints"))
    for e in table["endpoints"]:
        if e["address"] == address:
            return e
    sys.exit(f"no endpoint {address} in {table}")


def one_round(blocks, deadline_s, seed):
    procs = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            http, pub, replay = free_port(), free_port(), free_port()
            address = f"127.0.0.1:{http}"
            procs.append(subprocess.Popen(
                [BIN / "kvsim", "--name", "r0", "--listen", address, "--model", "m",
                 "--time-scale", "1000", "--block-size", str(BLOCK),
                 "--num-gpu-blocks", str(2 * blocks + 1024),
                 "--kv-events", f"tcp://127.0.0.1:{pub}", "--kv-events-bind",
                 "--kv-events-replay", f"tcp://127.0.0.1:{replay}"],
                stdout=subprocess.DEVNULL, stderr=open(f"{tmp}/kvsim.log", "w")))
            wait_ok(f"http://{address}/health")
            # Distinct prompts of token ids, PER_REQUEST blocks each: nothing shared.
            for i in range(0, blocks, PER_REQUEST):
                n = min(PER_REQUEST, blocks - i) * BLOCK
                prompt = [(seed * 1_000_003 + i * BLOCK + k) % 50_000 + 1 for k in range(n)]
                assert post(f"http://{address}/v1/completions",
                            {"model": "m", "prompt": prompt, "max_tokens": 1}) == 200
            routers = {}
            for name, replay_line in (("with replay", f', replay: "tcp://127.0.0.1:{replay}"'),
                                      ("without", "")):
                grpc, admin = free_port(), free_port()
                cfg = Path(tmp) / f"{name.replace(' ', '-')}.yaml"
                cfg.write_text(
                    f"server: {{grpc_listen: 127.0.0.1:{grpc}, admin_listen: 127.0.0.1:{admin}}}\n"
                    f"envoy: {{eds_path: {tmp}/{name.replace(' ', '-')}-eds.json}}\n"
                    "pools:\n  - name: p\n    models: [m]\n    endpoints:\n"
                    f"      - address: {address}\n"
                    f'        kv_events: {{connect: "tcp://127.0.0.1:{pub}"{replay_line}}}\n')
                started = time.monotonic()
                procs.append(subprocess.Popen(
                    [BIN / "kvrouter", "serve", "-c", str(cfg)],
                    stdout=subprocess.DEVNULL, stderr=open(f"{cfg}.log", "w")))
                routers[name] = (f"127.0.0.1:{admin}", started)
            for admin, _ in routers.values():
                wait_ok(f"http://{admin}/readyz")
            out = {}
            end = time.monotonic() + deadline_s
            pending = dict(routers)
            while pending and time.monotonic() < end:
                for name, (admin, started) in list(pending.items()):
                    row = endpoint_row(admin, address)
                    if row["kv_events"].get("engine_blocks", 0) >= blocks:
                        out[name] = (time.monotonic() - started, row["kv_events"].get("state"))
                        del pending[name]
                time.sleep(0.02)
            for name, (admin, _) in pending.items():
                row = endpoint_row(admin, address)
                out[name] = (None, row["kv_events"].get("state"),
                             row["kv_events"].get("engine_blocks", 0))
            return out
    finally:
        for p in procs:
            p.kill()
            p.wait()


def main():
    blocks = int(sys.argv[1]) if len(sys.argv) > 1 else 3200
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    deadline_s = float(sys.argv[3]) if len(sys.argv) > 3 else 15.0
    took = []
    for r in range(rounds):
        out = one_round(blocks, deadline_s, r + 1)
        w, wo = out["with replay"], out["without"]
        line = f"round {r + 1}: {blocks} blocks cached before the routers started; "
        line += (f"with replay: all known after {w[0]:.2f} s ({w[1]})" if w[0] is not None
                 else f"with replay: NOT all known within {deadline_s} s ({w[1]}, {w[2]} blocks)")
        line += ("; without: all known?! " if wo[0] is not None
                 else f"; without: {wo[2]} blocks known after {deadline_s} s ({wo[1]})")
        print(line, flush=True)
        if w[0] is not None:
            took.append(w[0])
    if took:
        print(f"with replay: median {statistics.median(took):.2f} s "
              f"[{min(took):.2f}, {max(took):.2f}] over {len(took)} of {rounds} rounds")


if __name__ == "__main__":
    main()
