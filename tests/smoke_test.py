import jax


def test_devices():
    assert len(jax.devices()) == 4
