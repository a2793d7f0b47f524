#!/usr/bin/env python3
"""Per run of a kvbench results.json: the router's, replicas' and Envoy's CPU seconds (the run's
`cpu` record), the router's decision time (its decision histogram, real ms: the mean, and the
upper bucket bound holding the p50 and the p99), TTFT (simulated ms), KV hit rate and the token
count mismatches between router and engine. Comparing router builds (`policies[].router_bin`)
in one run.

    scripts/bench-router-cpu.py OUT/results.json
"""
import json
import sys
d=json.load(open(sys.argv[1]))
for r in d['runs']:
    dec=r['decision']; b=dec.get('buckets'); 
    mean=dec['sum']/dec['count']*1000 if dec.get('count') else float('nan')
    # p50/p99 from buckets: list of [le, count] cumulative?
    def q(p):
        if not b: return float('nan')
        tot=dec['count']; 
        for le,c in b:
            if c>=p*tot: return le*1000
        return float('inf')
    st=r['stats']
    print(f"{r['workload']:9} {r['label']:18} seed {r['seed']} order {r['order']} router_cpu {r['cpu']['router_s']:6.1f}s replicas {r['cpu']['replicas_s']:6.1f} envoy {r['cpu']['envoy_s']:5.1f} | decision mean {mean:6.2f} ms p50 <= {q(.5):5.1f} p99 <= {q(.99):5.1f} | ttft p50 {st['ttft_ms']['p50']:.0f} mean {st['ttft_ms']['mean']:.0f} hit {st['kv_hit_rate']:.3f} mismatches {r.get('token_mismatches')}")
