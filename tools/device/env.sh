# Source on the device machine from the repo root: fla-core from the carried wheel, our three packages on
# PYTHONPATH under their import names (no pip install: the device has no network for the build backend).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
mkdir -p /tmp/pkgs
ln -sfn "$PWD/plugins" /tmp/pkgs/k3plugins
ln -sfn "$PWD/runtime" /tmp/pkgs/k3runtime
ln -sfn "$PWD/k3build" /tmp/pkgs/k3build
export PYTHONPATH=/tmp/pkgs:/tmp/site:$PYTHONPATH PYTHONUNBUFFERED=1
