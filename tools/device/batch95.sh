# Ninety-fifth device batch (run in the twenty-seventh session, on bench_rank's code of then; its poll and ahead
# modes were removed after it, so this script now prints the sync parts only): the rank's step over three processes with
# its host parts split (bench_rank._step_parts: the wait for the last copy apart from the fill; modes sync, poll and
# ahead, the last staging each step's rows while the previous graph runs): where the 0.3 ms the device host spent
# filling 32 rows inside a step goes, and what staging off the critical path would give.
source tools/device/env.sh
source tools/device/rank_ab.sh
for i in 1 2 3; do RANK_S=90 RANK_OUT=rank_$i RANK_KEYS="batch step_ms graph_ms host_ gpu_ hbm" rank_ab; done
