# ruff: noqa  (session prototype, WIP branch only: see README.md here)
"""PROTOTYPE v2 (not in the package, not run on a GPU yet): the bf16-row sparse attention with a producer warpgroup
(gl.warp_specialize) that gathers KV tiles with cp.async into two shared-memory stages, signalled through mbarriers,
and two consumer warpgroups (the default partition) that run S = Q K^T (split by rows between them), the online
softmax and P V (split by columns) as in gluon_attn.py's v1. The consumers never compute gather addresses or wait on
the index loads; a stage is refilled as soon as both consumer warpgroups are done with it.

Barriers: ready[s] (count 128: every producer thread's cp.async.mbarrier.arrive.noinc), empty[s] (count 1: consumer
thread 0 after a barrier of the consumer warps)."""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait

_async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

BLOCK_H, BLOCK_N, STAGES, CHUNK = 64, 64, 2, 128
PRODUCER_WARPS, PRODUCER_REGS = 4, 56


@gluon.jit
def _producer(kv_ptr, idx_ptr, kv_smem, ready, empty, t64, stride_it, stride_kv, K,
              BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CHUNK: gl.constexpr):
    LDP: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])  # [rows, CHUNK] over 4 warps
    n_tiles = gl.cdiv(K, BLOCK_N)
    for i in range(n_tiles):
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # first round: passes (previous phase)
        slots = i * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LDP))
        idx = gl.load(idx_ptr + t64 * stride_it + slots, mask=slots < K, other=-1)
        cols = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, LDP))
        base = kv_ptr + idx.to(gl.int64)[:, None] * stride_kv + cols[None, :]
        mask = (idx >= 0)[:, None] & (cols < CHUNK)[None, :]
        for c in gl.static_range(HEAD_DIM // CHUNK):
            _async_load(kv_smem.index(s).slice(c * CHUNK, CHUNK, dim=1), base + c * CHUNK, mask=mask)
        cp.mbarrier_arrive(ready.index(s), increment_count=False)


@gluon.jit
def _consumer(q_smem, kv_smem, ready, empty, idx_ptr, sink_ptr, out_ptr, t64, hb, H, K, scale, stride_it, stride_ot,
              stride_oh, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, HEAD_DIM // 2, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    n_tiles = gl.cdiv(K, BLOCK_N)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, S_L))
    nan_i = gl.zeros([BLOCK_H], gl.int32, layout=gl.SliceLayout(1, S_L))
    acc = gl.zeros([BLOCK_H, HEAD_DIM], gl.float32, layout=O_L)
    for i in range(n_tiles):
        s = i % STAGES
        slots = i * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
        valid = gl.load(idx_ptr + t64 * stride_it + slots, mask=slots < K, other=-1) >= 0
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        fence_async_shared()
        kv_t = kv_smem.index(s)
        sc = warpgroup_mma(q_smem, kv_t.permute((1, 0)), gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_L),
                           use_acc=False, is_async=True)
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
        z = gl.where(valid[None, :], sc * scale, float("-inf"))
        nan_i = gl.maximum(nan_i, gl.max((z != z).to(gl.int32), axis=1))
        m_new = gl.maximum(m_i, gl.max(z, axis=1))
        m_base = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp(m_i - m_base)
        p = gl.exp(z - m_base[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        acc = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), P_L), kv_t, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        _cta_barrier()  # both consumer warpgroups are done with stage s
        mbarrier.arrive(empty.index(s), count=1)
        m_i = m_new

    heads = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_L))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, O_L))
    head_ok = heads < H
    sink = gl.load(sink_ptr + heads, mask=head_ok, other=0.0)
    m_o = gl.convert_layout(m_i, gl.SliceLayout(1, O_L))
    any_valid = m_o != float("-inf")
    denom = gl.convert_layout(l_i, gl.SliceLayout(1, O_L)) + gl.exp(sink - gl.where(any_valid, m_o, 0.0))
    o = gl.where(any_valid[:, None], gl.div_rn(acc, denom[:, None]), 0.0)
    o = gl.where(gl.convert_layout(nan_i, gl.SliceLayout(1, O_L))[:, None] > 0, float("nan"), o)
    gl.store(out_ptr + t64 * stride_ot + heads[:, None] * stride_oh + cols[None, :], o.to(gl.bfloat16),
             mask=head_ok[:, None] & (cols < HEAD_DIM)[None, :])


@gluon.jit
def _sparse_attention_ws_kernel(
    q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, H, K, scale,
    stride_qt, stride_qh, stride_kv, stride_it, stride_ot, stride_oh,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CHUNK: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 2], [1, 0])
    SM_L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    t = gl.program_id(0)
    hb = gl.program_id(1)
    t64 = t.to(gl.int64)
    hq = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LD))
    cq = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))
    q = gl.load(q_ptr + t64 * stride_qt + hq[:, None] * stride_qh + cq[None, :], mask=(hq < H)[:, None], other=0.0)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, HEAD_DIM], SM_L, q)
    kv_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], SM_L)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=PRODUCER_WARPS * 32)
        mbarrier.init(empty.index(s), count=1)
    fence_async_shared()
    gl.warp_specialize(
        [(_consumer, (q_smem, kv_smem, ready, empty, idx_ptr, sink_ptr, out_ptr, t64, hb, H, K, scale, stride_it,
                      stride_ot, stride_oh, BLOCK_H, BLOCK_N, HEAD_DIM, STAGES)),
         (_producer, (kv_ptr, idx_ptr, kv_smem, ready, empty, t64, stride_it, stride_kv, K, BLOCK_N, HEAD_DIM, STAGES,
                      CHUNK))],
        [PRODUCER_WARPS], [PRODUCER_REGS])


def sparse_attention_ws(q, kv, indices, sink, scale):
    t, h, d = q.shape
    out = torch.empty_like(q)
    _sparse_attention_ws_kernel[(t, triton.cdiv(h, BLOCK_H))](
        q, kv, indices, sink, out, h, indices.shape[1], float(scale),
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), out.stride(0), out.stride(1),
        BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, HEAD_DIM=d, STAGES=STAGES, CHUNK=CHUNK,
        PRODUCER_WARPS=PRODUCER_WARPS, PRODUCER_REGS=PRODUCER_REGS, num_warps=8)
    return out


def aot():
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    sig = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "idx_ptr": "*i32", "sink_ptr": "*fp32", "out_ptr": "*bf16",
           "H": "i32", "K": "i32", "scale": "fp32", "stride_qt": "i32", "stride_qh": "i32", "stride_kv": "i32",
           "stride_it": "i32", "stride_ot": "i32", "stride_oh": "i32"}
    ce = {"BLOCK_H": BLOCK_H, "BLOCK_N": BLOCK_N, "HEAD_DIM": 512, "STAGES": STAGES, "CHUNK": CHUNK,
          "PRODUCER_WARPS": PRODUCER_WARPS, "PRODUCER_REGS": PRODUCER_REGS}
    for k in ce:
        sig[k] = "constexpr"
    fn = _sparse_attention_ws_kernel
    aligned = ("q_ptr", "kv_ptr", "idx_ptr", "sink_ptr", "out_ptr", "stride_qt", "stride_qh", "stride_kv", "stride_it",
               "stride_ot", "stride_oh")
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    return triton.compile(GluonASTSource(fn, sig, ce, attrs), target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})


if __name__ == "__main__":
    from optimized.triton.aot import _resources
    k = aot()
    print(_resources(k, "sm_90"))
    open("/tmp/gluon_ws.ttgir", "w").write(k.asm["ttgir"])
