"""--enable-deepep fails fast at start-up: without deep_ep, and with a DeepEP whose limits K3 exceeds."""

import json
import subprocess
import sys

import pytest

from k3runtime.dist.deepep import DeepEPCaps, check_deepep
from k3runtime.loader import EngineError

K3 = {"num_experts_per_token": 16, "routed_expert_hidden_size": 3584, "hidden_size": 7168}


def test_missing_deep_ep_is_a_clear_startup_error(k3_short_engine):
    pytest.importorskip("torch")
    code = ("import sys; sys.modules['deep_ep'] = None\n"
            "from k3runtime import LLM\n"
            f"LLM({str(k3_short_engine)!r}, enable_deepep=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "--enable-deepep: the 'deep_ep' package does not import" in proc.stderr
    assert "without --enable-deepep" in proc.stderr


def test_k3_exceeds_upstream_low_latency_limits():
    with pytest.raises(EngineError) as e:
        check_deepep(K3, DeepEPCaps())
    msg = str(e.value)
    assert "top-k 16 exceeds the low-latency kernels' maximum of 11" in msg
    assert "exchange width 3584 is not one of the compiled widths" in msg


def test_fake_capability_file_names_the_limit_hit(tmp_path, monkeypatch):
    caps = tmp_path / "caps.json"
    caps.write_text(json.dumps({"max_topk": 16, "hidden_sizes": [2048, 7168]}))
    monkeypatch.setenv("K3_DEEPEP_CAPS", str(caps))
    with pytest.raises(EngineError, match=r"exchange width 3584 is not one of the compiled widths \[2048, 7168\]"):
        check_deepep(K3)
    caps.write_text(json.dumps({"max_topk": 16, "hidden_sizes": [3584]}))
    assert check_deepep(K3).max_topk == 16
