"""Optimized DSv4 ops: the same names and signatures as `reference/`, each with an optional `backend=`.

`backend=None` picks by `DSV4_BACKEND`, then the best available backend (see `optimized.backends`).
`python -m optimized` prints the capability table.
"""

from optimized.backends import Hardware, backend_status, detect, select
from optimized.einsum import fp8_einsum, output_projection, quantize_attn_output
from optimized.linear import fp8_linear

__all__ = [
    "Hardware",
    "backend_status",
    "detect",
    "fp8_einsum",
    "fp8_linear",
    "output_projection",
    "quantize_attn_output",
    "select",
]
