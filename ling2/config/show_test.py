"""`//ling2/config:show` prints resolved YAML and exits 2 with the message on bad config."""

import os
import subprocess

import yaml


def _show(*args):
    exe = os.path.join(os.environ["TEST_SRCDIR"], os.environ["TEST_WORKSPACE"], "ling2/config/show")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)


def test_prints_resolved_yaml():
    r = _show("model_name=ling2", "num_experts=64")
    assert r.returncode == 0, r.stderr
    data = yaml.safe_load(r.stdout)
    assert data["num_experts"] == 64
    assert data["moe_shared_expert_dim"] == 2048
    assert data["mu_dtype"] == "" and "decoder_block" not in data


def test_bad_config_exits_2_with_message():
    r = _show("num_exprts=64")
    assert r.returncode == 2
    assert "unknown config key 'num_exprts'" in r.stderr and "num_experts" in r.stderr
    r = _show("n_routing_groups=3")
    assert r.returncode == 2 and "n_routing_groups" in r.stderr
