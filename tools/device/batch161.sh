# Hundred-and-sixty-first device batch (fifty-fifth session): batch160's first part cut to fit what is left of a
# session's device time: the Gluon MLA kernel against the fp64 definition (64 / 96 / 128 heads, ragged, 1-64 splits)
# and the 96-head mixer, after page_descriptors began keeping its TMA descriptors by cache tensor. Carry .whl.
source tools/device/env.sh
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
timeout 200 python3 -m pytest -q -x -m gpu tests/plugins/test_mla_gpu.py -rf -p no:cacheprovider \
  -k "gluon_mla_decode_matches_definition or mixer_matches_reference" 2>&1 | tail -4 | tee $OUT/tests.txt
