# ruff: noqa  (session prototype, WIP branch only: see README.md here)
"""PROTOTYPE (not in the package): the bf16-row sparse attention with sink as a Gluon kernel for sm_90, with the
layouts set by hand: S = Q K^T split between the two warpgroups along the rows (warps [4, 2], each warpgroup 64 heads
x 32 rows), P exchanged through shared memory into the P V operand layout, P V split along the 512 output columns.
Same math and roundings as optimized.triton.sparse_attention's kernel (fp32 online softmax, P rounded to bf16,
sink in the denominator, empty rows give 0)."""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def _issue(kv_ptr, idx_ptr, kv_smem, t64, stride_it, stride_kv, tile, K,
           BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, LD: gl.constexpr):
    slots = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD))
    idx = gl.load(idx_ptr + t64 * stride_it + slots, mask=slots < K, other=-1)
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))
    ptrs = kv_ptr + idx.to(gl.int64)[:, None] * stride_kv + cols[None, :]
    mask = (idx >= 0)[:, None] & (cols < HEAD_DIM)[None, :]
    cp.async_copy_global_to_shared(kv_smem.index(tile % STAGES), ptrs, mask=mask)
    cp.commit_group()


@gluon.jit
def _sparse_attention_gluon_kernel(
    q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, H, K, scale,
    stride_qt, stride_qh, stride_kv, stride_it, stride_ot, stride_oh,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
):
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 2], [1, 0])
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, HEAD_DIM // 2, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    SM_L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    t = gl.program_id(0)
    hb = gl.program_id(1)
    t64 = t.to(gl.int64)
    hq = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LD))
    cq = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))
    q = gl.load(q_ptr + t64 * stride_qt + hq[:, None] * stride_qh + cq[None, :], mask=(hq < H)[:, None], other=0.0)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, HEAD_DIM], SM_L, q)
    kv_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], SM_L)

    n_tiles = gl.cdiv(K, BLOCK_N)
    for j in gl.static_range(STAGES - 1):
        _issue(kv_ptr, idx_ptr, kv_smem, t64, stride_it, stride_kv, j, K, BLOCK_N, HEAD_DIM, STAGES, LD)

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, S_L))
    nan_i = gl.zeros([BLOCK_H], gl.int32, layout=gl.SliceLayout(1, S_L))
    acc = gl.zeros([BLOCK_H, HEAD_DIM], gl.float32, layout=O_L)
    for i in range(0, n_tiles):
        # the stage of tile i + STAGES - 1 held tile i - 1, whose P V was waited for
        _issue(kv_ptr, idx_ptr, kv_smem, t64, stride_it, stride_kv, i + STAGES - 1, K, BLOCK_N, HEAD_DIM, STAGES, LD)
        cp.wait_group(STAGES - 1)
        gl.thread_barrier()
        fence_async_shared()
        kv_t = kv_smem.index(i % STAGES)
        s = warpgroup_mma(q_smem, kv_t.permute((1, 0)), gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_L),
                          use_acc=False, is_async=True)
        slots = i * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
        idx = gl.load(idx_ptr + t64 * stride_it + slots, mask=slots < K, other=-1)
        valid = idx >= 0
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        z = s * scale
        z = gl.where(valid[None, :], z, float("-inf"))
        nan_i = gl.maximum(nan_i, gl.max((z != z).to(gl.int32), axis=1))
        m_new = gl.maximum(m_i, gl.max(z, axis=1))
        m_base = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp(m_i - m_base)
        p = gl.exp(z - m_base[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        pb = gl.convert_layout(p.to(gl.bfloat16), P_L)
        acc = warpgroup_mma(pb, kv_t, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        m_i = m_new
    cp.wait_group(0)

    heads = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_L))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, O_L))
    head_ok = heads < H
    sink = gl.load(sink_ptr + heads, mask=head_ok, other=0.0)
    m_o = gl.convert_layout(m_i, gl.SliceLayout(1, O_L))
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, O_L))
    nan_o = gl.convert_layout(nan_i, gl.SliceLayout(1, O_L))
    any_valid = m_o != float("-inf")
    denom = l_o + gl.exp(sink - gl.where(any_valid, m_o, 0.0))
    o = gl.where(any_valid[:, None], gl.div_rn(acc, denom[:, None]), 0.0)
    o = gl.where(nan_o[:, None] > 0, float("nan"), o)
    gl.store(out_ptr + t64 * stride_ot + heads[:, None] * stride_oh + cols[None, :], o.to(gl.bfloat16),
             mask=head_ok[:, None] & (cols < HEAD_DIM)[None, :])


@gluon.jit
def _load_idx(idx_ptr, t64, stride_it, tile, K, BLOCK_N: gl.constexpr, LD: gl.constexpr):
    slots = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD))
    return gl.load(idx_ptr + t64 * stride_it + slots, mask=slots < K, other=-1)


@gluon.jit
def _issue_rows(kv_ptr, kv_smem, idx, stride_kv, stage, HEAD_DIM: gl.constexpr, LD: gl.constexpr):
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))
    ptrs = kv_ptr + idx.to(gl.int64)[:, None] * stride_kv + cols[None, :]
    mask = (idx >= 0)[:, None] & (cols < HEAD_DIM)[None, :]
    cp.async_copy_global_to_shared(kv_smem.index(stage), ptrs, mask=mask)
    cp.commit_group()


@gluon.jit
def _sparse_attention_gluon_v1b_kernel(
    q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, H, K, scale,
    stride_qt, stride_qh, stride_kv, stride_it, stride_ot, stride_oh,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
):
    """v1 with the row indices loaded one tile ahead of their gather (registers), and the valid mask taken from
    them (no reload). STAGES must be 2."""
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 2], [1, 0])
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, HEAD_DIM // 2, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    SM_L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    t = gl.program_id(0)
    hb = gl.program_id(1)
    t64 = t.to(gl.int64)
    hq = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LD))
    cq = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))
    idx_a = _load_idx(idx_ptr, t64, stride_it, 0, K, BLOCK_N, LD)
    q = gl.load(q_ptr + t64 * stride_qt + hq[:, None] * stride_qh + cq[None, :], mask=(hq < H)[:, None], other=0.0)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, HEAD_DIM], SM_L, q)
    kv_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], SM_L)
    _issue_rows(kv_ptr, kv_smem, idx_a, stride_kv, 0, HEAD_DIM, LD)
    idx_b = _load_idx(idx_ptr, t64, stride_it, 1, K, BLOCK_N, LD)

    n_tiles = gl.cdiv(K, BLOCK_N)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, S_L))
    nan_i = gl.zeros([BLOCK_H], gl.int32, layout=gl.SliceLayout(1, S_L))
    acc = gl.zeros([BLOCK_H, HEAD_DIM], gl.float32, layout=O_L)
    for i in range(0, n_tiles):
        _issue_rows(kv_ptr, kv_smem, idx_b, stride_kv, (i + 1) % STAGES, HEAD_DIM, LD)  # tile i + 1
        idx_c = _load_idx(idx_ptr, t64, stride_it, i + 2, K, BLOCK_N, LD)  # first used next iteration
        cp.wait_group(1)
        gl.thread_barrier()
        fence_async_shared()
        kv_t = kv_smem.index(i % STAGES)
        s = warpgroup_mma(q_smem, kv_t.permute((1, 0)), gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_L),
                          use_acc=False, is_async=True)
        valid = gl.convert_layout(idx_a, gl.SliceLayout(0, S_L)) >= 0
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        z = s * scale
        z = gl.where(valid[None, :], z, float("-inf"))
        nan_i = gl.maximum(nan_i, gl.max((z != z).to(gl.int32), axis=1))
        m_new = gl.maximum(m_i, gl.max(z, axis=1))
        m_base = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp(m_i - m_base)
        p = gl.exp(z - m_base[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        pb = gl.convert_layout(p.to(gl.bfloat16), P_L)
        acc = warpgroup_mma(pb, kv_t, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        m_i = m_new
        idx_a = idx_b
        idx_b = idx_c
    cp.wait_group(0)

    heads = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_L))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, O_L))
    head_ok = heads < H
    sink = gl.load(sink_ptr + heads, mask=head_ok, other=0.0)
    m_o = gl.convert_layout(m_i, gl.SliceLayout(1, O_L))
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, O_L))
    nan_o = gl.convert_layout(nan_i, gl.SliceLayout(1, O_L))
    any_valid = m_o != float("-inf")
    denom = l_o + gl.exp(sink - gl.where(any_valid, m_o, 0.0))
    o = gl.where(any_valid[:, None], gl.div_rn(acc, denom[:, None]), 0.0)
    o = gl.where(nan_o[:, None] > 0, float("nan"), o)
    gl.store(out_ptr + t64 * stride_ot + heads[:, None] * stride_oh + cols[None, :], o.to(gl.bfloat16),
             mask=head_ok[:, None] & (cols < HEAD_DIM)[None, :])


@gluon.jit
def _sparse_attention_gluon_v1c_kernel(
    q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, H, K, scale,
    stride_qt, stride_qh, stride_kv, stride_it, stride_ot, stride_oh,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
):
    """v1 with S(i + 1) issued right behind P V(i) (the tensor cores run them back to back), the gather of tile
    i + 2 started as soon as P V(i) is done. STAGES must be 2."""
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 2], [1, 0])
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, HEAD_DIM // 2, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    SM_L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    t = gl.program_id(0)
    hb = gl.program_id(1)
    t64 = t.to(gl.int64)
    hq = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LD))
    cq = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))
    q = gl.load(q_ptr + t64 * stride_qt + hq[:, None] * stride_qh + cq[None, :], mask=(hq < H)[:, None], other=0.0)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, HEAD_DIM], SM_L, q)
    kv_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], SM_L)

    n_tiles = gl.cdiv(K, BLOCK_N)
    _issue(kv_ptr, idx_ptr, kv_smem, t64, stride_it, stride_kv, 0, K, BLOCK_N, HEAD_DIM, STAGES, LD)
    _issue(kv_ptr, idx_ptr, kv_smem, t64, stride_it, stride_kv, 1, K, BLOCK_N, HEAD_DIM, STAGES, LD)
    cp.wait_group(1)
    gl.thread_barrier()
    fence_async_shared()
    s_tok = warpgroup_mma(q_smem, kv_smem.index(0).permute((1, 0)),
                          gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_L), use_acc=False, is_async=True)

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, S_L))
    nan_i = gl.zeros([BLOCK_H], gl.int32, layout=gl.SliceLayout(1, S_L))
    acc = gl.zeros([BLOCK_H, HEAD_DIM], gl.float32, layout=O_L)
    for i in range(0, n_tiles):
        slots = i * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
        valid = gl.load(idx_ptr + t64 * stride_it + slots, mask=slots < K, other=-1) >= 0
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        z = gl.where(valid[None, :], s * scale, float("-inf"))
        nan_i = gl.maximum(nan_i, gl.max((z != z).to(gl.int32), axis=1))
        m_new = gl.maximum(m_i, gl.max(z, axis=1))
        m_base = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp(m_i - m_base)
        p = gl.exp(z - m_base[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        acc_tok = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), P_L), kv_smem.index(i % STAGES), acc,
                                is_async=True)
        # tile i + 1 (its copies are the latest committed group): S(i + 1) right behind P V(i)
        cp.wait_group(0)
        gl.thread_barrier()
        fence_async_shared()
        s_tok = warpgroup_mma(q_smem, kv_smem.index((i + 1) % STAGES).permute((1, 0)),
                              gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_L), use_acc=False, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc_tok,))  # P V(i) done (in order), S(i + 1) may run
        gl.thread_barrier()  # both warpgroups are done with stage i % 2
        _issue(kv_ptr, idx_ptr, kv_smem, t64, stride_it, stride_kv, i + 2, K, BLOCK_N, HEAD_DIM, STAGES, LD)
        m_i = m_new
    warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))  # the S of the tile past the end (all empty)
    cp.wait_group(0)

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


BLOCK_H, BLOCK_N, STAGES, NUM_WARPS = 64, 64, 2, 8


def sparse_attention_gluon(q, kv, indices, sink, scale, block_n=BLOCK_N, stages=STAGES, v1b=False, v1c=False):
    t, h, d = q.shape
    out = torch.empty_like(q)
    grid = (t, triton.cdiv(h, BLOCK_H))
    kernel = (_sparse_attention_gluon_v1c_kernel if v1c else _sparse_attention_gluon_v1b_kernel if v1b
              else _sparse_attention_gluon_kernel)
    kernel[grid](
        q, kv, indices, sink, out, h, indices.shape[1], float(scale),
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), out.stride(0), out.stride(1),
        BLOCK_H=BLOCK_H, BLOCK_N=block_n, HEAD_DIM=d, STAGES=stages, num_warps=NUM_WARPS)
    return out


def aot(block_n=BLOCK_N, stages=STAGES, v1b=False, v1c=False):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    sig = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "idx_ptr": "*i32", "sink_ptr": "*fp32", "out_ptr": "*bf16",
           "H": "i32", "K": "i32", "scale": "fp32", "stride_qt": "i32", "stride_qh": "i32", "stride_kv": "i32",
           "stride_it": "i32", "stride_ot": "i32", "stride_oh": "i32",
           "BLOCK_H": "constexpr", "BLOCK_N": "constexpr", "HEAD_DIM": "constexpr", "STAGES": "constexpr"}
    ce = {"BLOCK_H": BLOCK_H, "BLOCK_N": block_n, "HEAD_DIM": 512, "STAGES": stages}
    fn = (_sparse_attention_gluon_v1c_kernel if v1c else _sparse_attention_gluon_v1b_kernel if v1b
          else _sparse_attention_gluon_kernel)
    aligned = ("q_ptr", "kv_ptr", "idx_ptr", "sink_ptr", "out_ptr", "stride_qt", "stride_qh", "stride_kv", "stride_it",
               "stride_ot", "stride_oh")
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    return triton.compile(GluonASTSource(fn, sig, ce, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": NUM_WARPS})


if __name__ == "__main__":
    import re
    from optimized.triton.aot import _resources
    k = aot()
    print(_resources(k, "sm_90"))
    open("/tmp/gluon.ttgir", "w").write(k.asm["ttgir"])
    print(sorted(set(re.findall(r"nvidia_mma<\{[^}]*\}", k.asm["ttgir"]))))
