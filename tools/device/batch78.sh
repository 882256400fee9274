# Seventy-eighth device batch (twenty-fourth session): the rank's step as a distribution over processes (batch77:
# the same code moves by up to 4 % between processes whatever the list of batch sizes): seven processes one after
# the other on one machine, 32,64,128 requests, 10 reps each; then the engines' GPU test on the final code.
source tools/device/env.sh
source tools/device/rank_ab.sh
for i in 1 2 3 4 5 6 7; do RANK_S=70 RANK_OUT=rank_$i rank_ab; done
timeout 150 python3 -m pytest -q -m gpu tests/model/test_gpu_engine.py -p no:cacheprovider --tb=short 2>&1 | tail -2
