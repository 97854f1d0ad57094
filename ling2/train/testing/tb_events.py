"""Reads TensorBoard event files without TensorBoard: the TFRecord framing (length, masked CRC-32C of the
length, payload, masked CRC-32C of the payload), both CRCs checked with a CRC-32C computed here, and
each payload parsed as an `Event` protocol buffer (tensorboardX's generated classes).

`scalars(run_dir)` applies TensorBoard's purge rule: a SessionLog START at step S in a later file hides
the earlier files' events at steps >= S (tensorboardX writes one for `purge_step`).
"""

import struct
from pathlib import Path


def _crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def records(path) -> list[bytes]:
    """The payloads of a TFRecord file; AssertionError on a bad length, CRC or a cut-short record."""
    data, out, i = Path(path).read_bytes(), [], 0
    while i < len(data):
        assert i + 12 <= len(data), f"{path}: record header cut short at byte {i}"
        header = data[i:i + 8]
        (n,), (hcrc,) = struct.unpack("<Q", header), struct.unpack("<I", data[i + 8:i + 12])
        assert hcrc == masked_crc32c(header), f"{path}: bad length CRC at byte {i}"
        payload = data[i + 12:i + 12 + n]
        assert len(payload) == n and i + 16 + n <= len(data), f"{path}: record cut short at byte {i}"
        (pcrc,) = struct.unpack("<I", data[i + 12 + n:i + 16 + n])
        assert pcrc == masked_crc32c(payload), f"{path}: bad payload CRC at byte {i}"
        out.append(payload)
        i += 16 + n
    return out


def events(path) -> list:
    from tensorboardX.proto import event_pb2

    return [event_pb2.Event.FromString(r) for r in records(path)]


def scalars(run_dir) -> dict:
    """{tag: {step: value}} of every scalar in run_dir/tensorboard, files in the order they were opened, purges
    applied."""
    from tensorboardX.proto import event_pb2

    files = [events(f) for f in Path(run_dir, "tensorboard").glob("events.out.tfevents.*")]
    out: dict = {}
    for evs in sorted((e for e in files if e), key=lambda evs: evs[0].wall_time):  # each opens with file_version
        for e in evs:
            if e.HasField("session_log") and e.session_log.status == event_pb2.SessionLog.START:
                for steps in out.values():
                    for s in [s for s in steps if s >= e.step]:
                        del steps[s]
            for v in e.summary.value:
                out.setdefault(v.tag, {})[e.step] = v.simple_value
    return out
