"""Read Nsight Compute's CSV pages back on a machine without ncu: one line per profiled kernel, and where it stalls.

    ncu -i report.ncu-rep --page raw --csv > raw.csv                              # on the GPU machine
    ncu -i report.ncu-rep --page source --csv --print-source sass > source.csv
    python tools/ncu_summary.py raw.csv [--source source.csv --top 12]           # here

From raw.csv: duration, DRAM throughput, warp cycles per issued instruction, issue-slot use, occupancy and the
largest stall reasons (cycles per issued instruction) of each kernel, longest first. From source.csv: each
kernel's stall samples by opcode, and its instructions with the most samples (the long-scoreboard waits on a load
that showed the fused KDA decode's serialized loads, BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import collections
import csv
import os

from arg_types import count

# the raw page's units row names each column's unit; these bring durations to µs and throughputs to TB/s
_SCALE = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6,
          "second": 1e6, "Tbyte/s": 1.0, "Gbyte/s": 1e-3, "Mbyte/s": 1e-6, "Kbyte/s": 1e-9, "byte/s": 1e-12}
_STALL = ("smsp__average_warps_issue_stalled_", "_per_issue_active.ratio")


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return float("nan")


def kernels(raw_csv: str, stalls: int = 4) -> list[dict]:
    """One dict a profiled kernel of ncu's raw page, longest first."""
    with open(raw_csv, newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) < 2 or "Kernel Name" not in rows[0]:
        raise SystemExit(f"ncu_summary: {raw_csv} is not ncu's raw page in CSV (no 'Kernel Name' header)")
    header, units = rows[0], rows[1]
    col = {name: i for i, name in enumerate(header)}

    def value(row, name, unit_scaled=False):
        if name not in col:
            return float("nan")
        v = _number(row[col[name]])
        return v * _SCALE.get(units[col[name]], float("nan")) if unit_scaled else v

    out = []
    for row in rows[2:]:
        reasons = [(value(row, h), h[len(_STALL[0]):-len(_STALL[1])]) for h in header
                   if h.startswith(_STALL[0]) and h.endswith(_STALL[1])]
        reasons = sorted((r for r in reasons if r[0] == r[0]), reverse=True)[:stalls]
        out.append({"kernel": row[col["Kernel Name"]], "grid": row[col["launch__grid_size"]] if "launch__grid_size" in col
                    else "", "us": value(row, "gpu__time_duration.sum", True),
                    "dram_tbps": value(row, "dram__bytes.sum.per_second", True),
                    "cycles_per_issue": value(row, "smsp__average_warp_latency_per_inst_issued.ratio"),
                    "issue_pct": value(row, "smsp__issue_active.avg.pct_of_peak_sustained_active"),
                    "occupancy_pct": value(row, "sm__warps_active.avg.pct_of_peak_sustained_active"),
                    "stalls": {name: round(v, 2) for v, name in reasons}})
    return sorted(out, key=lambda k: -k["us"] if k["us"] == k["us"] else 0)


def hotspots(source_csv: str, top: int = 12) -> dict[str, dict]:
    """Per kernel of ncu's source page (SASS): stall samples by opcode (share of all) and the `top` instructions."""
    with open(source_csv, newline="") as f:
        rows = list(csv.reader(f))
    by_kernel, kernel, header = collections.defaultdict(list), None, None
    for row in rows:
        if row and row[0] == "Kernel Name":
            kernel = row[1]
        elif row and row[0] == "Address":
            header = row
        elif row and header and kernel:
            by_kernel[kernel].append(dict(zip(header, row)))
    if not by_kernel:
        raise SystemExit(f"ncu_summary: {source_csv} is not ncu's source page in CSV (no 'Kernel Name' rows)")
    out = {}
    for kernel, ins in by_kernel.items():
        samples = lambda i: int(_number(i.get("Warp Stall Sampling (All Samples)", "0")) or 0)
        total = sum(samples(i) for i in ins) or 1
        ops = collections.Counter()
        for i in ins:
            words = [w for w in i["Source"].split() if not w.startswith("@")]
            ops[words[0].split(".")[0] if words else "?"] += samples(i)
        worst = sorted(ins, key=samples, reverse=True)[:top]
        reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
        out[kernel] = {
            "samples": total,
            "by_opcode": {op: round(n / total, 3) for op, n in ops.most_common(top)},
            "top": [{"address": i["Address"], "share": round(samples(i) / total, 3), "sass": i["Source"].strip(),
                     "stalls": {r[6:]: int(_number(i[r])) for r in reasons if _number(i[r]) >= 0.2 * samples(i) > 0}}
                    for i in worst]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("raw", help="ncu --page raw --csv output")
    ap.add_argument("--source", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--top", type=count, default=12, help="instructions and opcodes listed a kernel")
    args = ap.parse_args()
    for name in filter(None, (args.raw, args.source)):
        if not os.path.isfile(name):
            ap.error(f"{name}: no such file")
    for k in kernels(args.raw):
        print(f"{k['us']:9.2f} us  {k['kernel'][:56]:56s} grid {k['grid']:>8}  DRAM {k['dram_tbps']:5.2f} TB/s  "
              f"{k['cycles_per_issue']:6.2f} cycles/issue  issue {k['issue_pct']:5.1f} %  occupancy "
              f"{k['occupancy_pct']:5.1f} %  " + " ".join(f"{n} {v}" for n, v in k["stalls"].items()))
    if args.source:
        for kernel, h in hotspots(args.source, args.top).items():
            print(f"\n{kernel}: {h['samples']} stall samples; by opcode: {h['by_opcode']}")
            for i in h["top"]:
                print(f"  {i['address'][-6:]} {i['share']:6.3f}  {i['sass'][:64]:64s} {i['stalls']}")


if __name__ == "__main__":
    main()
