"""Optimized DSv4 ops: the same names and signatures as `reference/`, each with an optional `backend=`.

`backend=None` picks by `DSV4_BACKEND`, then the best available backend (see `optimized.backends`).
`python -m optimized` prints the capability table.
"""

from optimized.attention import (
    Attention,
    AttentionCache,
    compress,
    indexer_q,
    indexer_scores,
    indexer_topk,
    project_kv,
    project_q,
    sparse_attention,
)
from optimized.backends import Hardware, backend_status, detect, select
from optimized.einsum import fp8_einsum, output_projection, quantize_attn_output
from optimized.linear import fp8_linear
from optimized.moe import MoE, experts, moe, route

__all__ = [
    "Attention",
    "AttentionCache",
    "Hardware",
    "MoE",
    "backend_status",
    "compress",
    "detect",
    "experts",
    "fp8_einsum",
    "fp8_linear",
    "indexer_q",
    "indexer_scores",
    "indexer_topk",
    "moe",
    "output_projection",
    "project_kv",
    "project_q",
    "quantize_attn_output",
    "route",
    "select",
    "sparse_attention",
]
