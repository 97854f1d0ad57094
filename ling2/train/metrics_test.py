"""The TensorBoard event file the trainer writes, read back by an independent TFRecord reader written here from the
format (each record: a little-endian uint64 length, its masked CRC-32C, the data, the data's masked CRC-32C;
masking as TensorFlow's `MaskedCrc`), CRC-32C from the Castagnoli polynomial and checked against its published
check value. The events themselves are parsed with the Event protobuf schema."""

import struct

from ling2.train.metrics import MetricsWriter


def _crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    crc = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _records(path):
    raw = path.read_bytes()
    at, out = 0, []
    while at < len(raw):
        header = raw[at:at + 8]
        (n,), (hcrc,) = struct.unpack("<Q", header), struct.unpack("<I", raw[at + 8:at + 12])
        data = raw[at + 12:at + 12 + n]
        (dcrc,) = struct.unpack("<I", raw[at + 12 + n:at + 16 + n])
        assert hcrc == _masked(header) and dcrc == _masked(data), f"bad CRC in record at byte {at}"
        out.append(data)
        at += 16 + n
    return out


def test_crc32c_check_value():
    assert _crc32c(b"123456789") == 0xE3069283  # the CRC-32C (Castagnoli) catalogue's check value


def test_events_are_whole_records_with_the_purge_marker_and_scalars(tmp_path):
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    w = MetricsWriter(tmp_path, tensorboard=True, start_step=3)
    w.write(4, {"loss": 1.5, "moe": {"aux": 0.25}})
    w.write(5, {"loss": 1.25})
    w.close()
    (path,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    events = [Event.FromString(r) for r in _records(path)]
    assert events[0].file_version == "brain.Event:2"
    # what TensorBoard reads as "hide what a cut-short run logged past step 3": a START session log at step 4,
    # before any scalar
    starts = [i for i, e in enumerate(events) if e.HasField("session_log")]
    assert [(events[i].session_log.status, events[i].step) for i in starts] == [(SessionLog.START, 4)]
    assert not any(e.HasField("summary") for e in events[:starts[0]])
    scalars = [(e.step, v.tag, v.simple_value) for e in events for v in e.summary.value]
    assert scalars == [(4, "loss", 1.5), (4, "moe/aux", 0.25), (5, "loss", 1.25)]
