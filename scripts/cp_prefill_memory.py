"""Peak memory per device of a prefill chunk under context parallelism against the unsharded
layer: prints ``glm5_dsa_jax.tools.cp_memory.prefill_memory``'s rows (XLA's memory analysis
of the compiled step; nothing runs, no cache is allocated).

    python scripts/cp_prefill_memory.py --context 1048576 --chunk 4096 --cp 1,2,8 [--json]
"""

from __future__ import annotations

import argparse
import json

from glm5_dsa_jax.cli.host import need_devices


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="glm53-flash")
    p.add_argument("--context", type=int, default=1 << 20, help="cache slots per sequence")
    p.add_argument("--chunk", type=int, default=4096, help="prefill chunk tokens")
    p.add_argument("--cp", default="1,2,8", help="comma-separated sequence-axis sizes (1: unsharded)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args(argv)
    cps = [int(c) for c in args.cp.split(",")]
    devices = need_devices(max(cps), "--cp")  # before anything starts jax's backend
    from glm5_dsa_jax.model.config import DsaConfig
    from glm5_dsa_jax.tools.cp_memory import prefill_memory

    rows = [prefill_memory(DsaConfig.preset(args.preset), args.context, args.chunk, cp, devices) for cp in cps]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    mib = 1 << 20
    print(f"{args.preset}: a {args.chunk}-token prefill chunk on a {args.context}-slot bf16 cache, "
          "per device (MiB)")
    print(f"{'cp':>3} {'arguments':>10} {'outputs':>9} {'temps':>9} {'aliased':>8}  selection")
    for r in rows:
        print(f"{r['cp']:>3} {r['argument_bytes'] / mib:>10.1f} {r['output_bytes'] / mib:>9.1f} "
              f"{r['temp_bytes'] / mib:>9.1f} {r['alias_bytes'] / mib:>8.1f}  {r['selection']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
