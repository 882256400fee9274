# Hundred-and-thirty-fourth device batch (forty-eighth session): the MLA bench's prefill case (batch133, never run
# before), then the whole GPU suite (last full run: forty-fifth session, on an H100; since then LEAN_SOFTMAX is on by
# default). The device has no fastapi/openai, so tests/server does not collect there (it has no GPU tests).
source tools/device/env.sh
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
bash tools/device/batch133.sh 2>&1 | tail -30
timeout 420 python3 -m pytest -q -m gpu tests --ignore=tests/server -p no:cacheprovider 2>&1 | tail -25
