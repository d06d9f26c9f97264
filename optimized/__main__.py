"""`python -m optimized`: print the hardware and the backend x op capability table."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from optimized.backends import BACKENDS, backend_status, capability_rows, detect


def main() -> None:
    hw = detect()
    console = Console()
    console.print(f"device: {hw.device} ({hw.name}, {hw.arch}); triton: {hw.triton}; deep_gemm: {hw.deep_gemm}; "
                  f"interpreter: {hw.interpret}; native FP8: {hw.fp8_format}")
    for name in BACKENDS:
        ok, why = backend_status(name)
        console.print(f"  {name:9s} {'available' if ok else 'unavailable'}: {why}")
    table = Table(title="ops x backends (yes = runs here, no = implemented but not available here, - = none)")
    for col in ("op", *BACKENDS, "notes"):
        table.add_column(col)
    for row in capability_rows():
        table.add_row(*(row[c] for c in ("op", *BACKENDS, "notes")))
    console.print(table)


if __name__ == "__main__":
    main()
