"""`bazel query 'deps(//ling2/config)'` (captured by genquery) names no other //ling2 package."""

import os


def test_config_depends_on_no_other_ling2_package():
    path = os.path.join(os.environ["TEST_SRCDIR"], os.environ["TEST_WORKSPACE"], "ling2/config/config_deps")
    labels = open(path).read().split()
    assert "//ling2/config:config" in labels
    ling2 = [l for l in labels if l.startswith("//ling2")]
    others = [l for l in ling2 if not l.startswith("//ling2/config:")]
    assert others == [], others
