"""The test macro's `devices = 4` gives JAX four CPU devices."""

import jax


def test_fake_devices():
    assert jax.default_backend() == "cpu"
    assert len(jax.devices()) == 4
