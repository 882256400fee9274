"""Instruction counts of a Triton kernel's loops in its sm_90 SASS, on a machine without a GPU (JSON lines).

    python tools/sass_loops.py moe_gate_up_paired                     # a kernel spec of tests/plugins/test_rocm_compile.py
    python tools/sass_loops.py moe_gate_up_paired --set BM=128 --set BN=128 --warps 8 --stages 2
    python tools/sass_loops.py kda_recurrent_vsplit --set BV=64 --dump /tmp/k.sass --ttgir /tmp/k.ttgir
    python tools/sass_loops.py kda_conv_prefill --set BT=32 --set BC=128 --warps 1 --div16 C,D,T

Triton compiles the kernel for sm_90 (its bundled ptxas) and cuobjdump disassembles it. For each loop (a backward
branch) it prints the instruction count and the opcode histogram, after the kernel's registers a thread and spill
instructions.
Divide a loop's count by the weights a thread handles per iteration to get instructions a weight: the figure
BENCHMARKS.md uses to compare MoE decode kernels (the decode was bound by instruction issue down to about 3.6 a
weight; at 3.0 it no longer is: BENCHMARKS.md, eleventh session).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "plugins"))


def _value(text: str):
    try:
        return int(text)
    except ValueError:
        return {"True": True, "False": False}.get(text, text)


def loops(sass: str) -> list[dict]:
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in
           (re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line) for line in sass.splitlines()) if m]
    found = []
    for addr, text in ins:
        m = re.search(r"BRA\s+0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
            found.append({"start": hex(int(m.group(1), 16)), "end": hex(addr), "instructions": len(body),
                          "ops": dict(ops.most_common())})
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel", help="a key of SPECS in tests/plugins/test_rocm_compile.py")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="override a constexpr")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--maxnreg", type=int, help="cap the registers a thread (ptx .maxnreg)")
    ap.add_argument("--dump", help="also write the whole SASS to this file")
    ap.add_argument("--ttgir", help="also write Triton's GPU IR to this file (the layouts it chose: #blocked, "
                                    "convert_layout)")
    ap.add_argument("--div16", default="", metavar="NAME,...",
                    help="integer arguments to take as multiples of 16, as Triton's launcher specializes them when "
                         "their values are (the spec marks only pointers and strides). Without it, a mask or an "
                         "offset built from such an argument can keep loads and stores scalar that run vectorized")
    args = ap.parse_args()

    import triton
    from triton.backends.compiler import GPUTarget

    import test_rocm_compile as specs
    if args.kernel not in specs.SPECS:
        raise SystemExit(f"sass_loops: unknown kernel {args.kernel!r}; one of {sorted(specs.SPECS)}")
    fn, ptrs, consts = specs.SPECS[args.kernel]
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep or (name not in consts and name not in fn.arg_names):
            raise SystemExit(f"sass_loops: --set {item!r}: expected NAME=VALUE with NAME a constexpr of "
                             f"{args.kernel} (the spec sets {sorted(consts)})")
        consts = {**consts, name: _value(value)}
    specs.SPECS[args.kernel] = (fn, ptrs, consts)
    source = specs._source(args.kernel, "sm90")
    for name in filter(None, args.div16.split(",")):
        if name not in fn.arg_names or name in consts or name.endswith("_ptr"):
            raise SystemExit(f"sass_loops: --div16 {name!r} is not an integer argument of {args.kernel}")
        source.attrs[(fn.arg_names.index(name),)] = [["tt.divisibility", 16]]
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=args.warps, num_stages=args.stages, maxnreg=args.maxnreg))
    sass, usage = specs.sm90_sass(compiled.asm["cubin"])
    regs = re.search(r"REG:(\d+)", usage)
    smem = re.search(r"SHARED:(\d+)", usage)
    if args.dump:
        with open(args.dump, "w") as out:
            out.write(sass)
    if args.ttgir:
        with open(args.ttgir, "w") as out:
            out.write(compiled.asm["ttgir"])
    spills = len(re.findall(r"\b(?:STL|LDL)\b", sass))
    print(json.dumps({"kernel": args.kernel, "constexprs": {k: str(v) for k, v in consts.items()},
                      "num_warps": args.warps, "num_stages": args.stages, "registers": int(regs.group(1)) if regs else None,
                      "static_shared": int(smem.group(1)) if smem else None, "shared": compiled.metadata.shared,
                      "spill_instructions": spills}))
    for loop in loops(sass):
        print(json.dumps(loop))


if __name__ == "__main__":
    main()
