"""KDA prefill alone (bench_plugins --only kda_prefill): see kda.bench_kda_prefill."""

from kda import bench_kda_prefill  # noqa: F401
