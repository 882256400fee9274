# Source on the device machine from the repo root: fla-core from the carried wheel, k3plugins on PYTHONPATH.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
mkdir -p /tmp/pkgs && ln -sfn "$PWD/plugins" /tmp/pkgs/k3plugins
export PYTHONPATH=/tmp/pkgs:/tmp/site:$PYTHONPATH PYTHONUNBUFFERED=1
