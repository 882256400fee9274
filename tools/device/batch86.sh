# Eighty-sixth device batch (twenty-fifth session): the top-k launch's cast, a whole row a program past 64 tokens
# (default) against 1024 columns a program at every size and a whole row at every size, one process (--ab); then
# two more processes of the default for the step's spread.
source tools/device/env.sh
source tools/device/rank_ab.sh
RANK_S=200 RANK_OUT=rank_ab rank_ab topk-cast-rows topk-cast-chunks
for i in 1 2; do RANK_S=70 RANK_OUT=rank_$i rank_ab; done
