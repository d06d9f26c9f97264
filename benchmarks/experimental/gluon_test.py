# ruff: noqa  (session prototype, WIP branch only: see README.md here)
"""H200: the Gluon sparse-attention prototype against the package's Triton kernel and the reference."""
import json, sys
sys.path.insert(0, ".device")
import torch
import gluon_attn as g
from benchmarks.timing import Timer
from benchmarks.suite import Env
from benchmarks import ops_attention as oa
from reference.config import get_config
from reference.attention import sparse_attention as ref_sparse
from optimized.triton import sparse_attention as tsa
from parity_tests.metrics import calc_diff

rows = []
def rec(**kw):
    rows.append(kw); print(json.dumps(kw), flush=True); json.dump(rows, open(sys.argv[1], "w"), indent=1)

env = Env(get_config("FLASH"), "cuda"); ctx = oa.setup(env)
sink, scale = ctx.weights.attn_sink, env.cfg.head_dim ** -0.5
timer = Timer("cuda")
# small edge cases: an all-empty row, a NaN query, H = 128 (two head blocks), K not a multiple of BLOCK_N
torch.manual_seed(0)
for H, K in ((64, 100), (128, 640)):
    T, N = 6, 300
    q = torch.randn(T, H, 512, device="cuda").bfloat16(); kv = torch.randn(N, 512, device="cuda").bfloat16()
    idx = torch.stack([torch.randperm(N, device="cuda")[:min(K, N)] for _ in range(T)]).int(); idx = torch.cat([idx, torch.full((T, K - idx.shape[1]), -1, device="cuda", dtype=torch.int32)], 1) if K > N else idx; idx[:, ::7] = -1; idx[2] = -1
    q[4, 3, 10] = float("nan")
    sk = torch.randn(H, device="cuda")
    for bn, st, v1b, v1c in ((64, 2, False, False), (64, 2, True, False), (64, 2, False, True)):
        a = g.sparse_attention_gluon(q, kv, idx, sk, scale, bn, st, v1b, v1c); b = tsa.sparse_attention(q, kv, idx, sk, scale)
        r = ref_sparse(q, kv, idx, sk, scale)
        fin = torch.isfinite(r.float())
        rec(case=f"edge H={H} K={K}", tiles=f"{bn}x{st}{' v1b' if v1b else ''}{' v1c' if v1c else ''}", nan_same=bool(torch.equal(torch.isnan(a), torch.isnan(r))),
            empty_row_zero=bool((a[2] == 0).all()), diff_vs_ref=calc_diff(a.float()[fin], r.float()[fin]),
            triton_vs_ref=calc_diff(b.float()[fin], r.float()[fin]), max_abs_vs_triton=float((a.float() - b.float())[fin].abs().max()))
for tokens in (8192, 64):
    c = oa.candidates(env, tokens)
    sub = torch.arange(0, tokens, max(1, tokens // 16), device="cuda")
    want = ref_sparse(c.q[sub], c.kv, c.indices[sub], sink, scale).float()
    # the portable Triton kernel (an explicit config keeps it off the branch's sm_90 dispatch at prefill)
    portable = ((lambda: tsa.sparse_attention(c.q, c.kv, c.indices, sink, scale, config=tsa.WIDE["nvidia"][False]))
                if tokens > 1000 else (lambda: tsa.sparse_attention(c.q, c.kv, c.indices, sink, scale)))
    b = portable()
    work = 4.0 * c.q.shape[1] * 512 * int((c.indices >= 0).sum())
    tb = timer.time(portable, graph=True)
    rec(case=f"T={tokens}", kernel="triton (package)", us=round(tb.median_s * 1e6, 1), tflops=round(work / tb.median_s / 1e12, 1),
        diff_vs_ref=calc_diff(b.float()[sub], want))
    for bn, st, v1b, v1c in ((64, 2, False, False), (64, 2, True, False), (64, 2, False, True)):
        fn = lambda: g.sparse_attention_gluon(c.q, c.kv, c.indices, sink, scale, bn, st, v1b, v1c)
        try:
            a = fn(); ta = timer.time(fn, graph=True)
            rec(case=f"T={tokens}", kernel=f"gluon {bn}x{st}{' v1b' if v1b else ''}{' v1c' if v1c else ''}", us=round(ta.median_s * 1e6, 1),
                tflops=round(work / ta.median_s / 1e12, 1), diff_vs_ref=calc_diff(a.float()[sub], want),
                diff_vs_triton=calc_diff(a.float(), b.float()), max_abs_vs_triton=float((a.float() - b.float()).abs().max()))
        except Exception as exc:
            rec(case=f"T={tokens}", kernel=f"gluon {bn}x{st}{' v1b' if v1b else ''}{' v1c' if v1c else ''}", error=str(exc)[:300])

# last: the warp-specialized prototype (a deadlock here only loses this part; the step's timeout kills it)
import gluon_ws as ws
for H, K in ((64, 100), (128, 640)):
    T, N = 6, 300
    q = torch.randn(T, H, 512, device="cuda").bfloat16(); kv = torch.randn(N, 512, device="cuda").bfloat16()
    idx = torch.stack([torch.randperm(N, device="cuda")[:min(K, N)] for _ in range(T)]).int()
    if K > N:
        idx = torch.cat([idx, torch.full((T, K - N), -1, device="cuda", dtype=torch.int32)], 1)
    idx[:, ::7] = -1; idx[2] = -1; q[4, 3, 10] = float("nan"); sk = torch.randn(H, device="cuda")
    a = ws.sparse_attention_ws(q, kv, idx, sk, scale); torch.cuda.synchronize()
    r = ref_sparse(q, kv, idx, sk, scale); fin = torch.isfinite(r.float())
    rec(case=f"edge H={H} K={K}", tiles="ws", nan_same=bool(torch.equal(torch.isnan(a), torch.isnan(r))),
        empty_row_zero=bool((a[2] == 0).all()), diff_vs_ref=calc_diff(a.float()[fin], r.float()[fin]))
for tokens in (8192, 64):
    c = oa.candidates(env, tokens)
    work = 4.0 * c.q.shape[1] * 512 * int((c.indices >= 0).sum())
    b = tsa.sparse_attention(c.q, c.kv, c.indices, sink, scale, config=tsa.WIDE["nvidia"][False])
    fn = lambda: ws.sparse_attention_ws(c.q, c.kv, c.indices, sink, scale)
    a = fn(); ta = timer.time(fn, graph=True)
    rec(case=f"T={tokens}", kernel="gluon ws", us=round(ta.median_s * 1e6, 1), tflops=round(work / ta.median_s / 1e12, 1),
        diff_vs_triton=calc_diff(a.float(), b.float()), max_abs_vs_triton=float((a.float() - b.float()).abs().max()))
