"""Print bench_rank's step figures and its profiled kernels (rank_decode / rank_profile JSON lines) from a file.

    python3 tools/device/print_profile.py $OUT/rank_profile.jsonl [top]    # top: kernels a batch (default all)
"""
import json
import sys

top = int(sys.argv[2]) if len(sys.argv) > 2 else None
for line in open(sys.argv[1]):
    d = json.loads(line)
    if d["bench"] == "rank_decode":
        print({k: d[k] for k in ("batch", "step_ms", "floor_ms", "step_x_floor")})
    if d["bench"] == "rank_profile":
        for row in d["top"][:top]:
            print(d["batch"], row)
