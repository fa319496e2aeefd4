"""The resume digests (output/resume.py) against the standard library's CRC-32."""

import os
import zlib

from peft_shardmerge.output.resume import Crc32, range_digest


def test_crc32_in_pieces_is_the_standard_crc32_of_the_whole():
    data = os.urandom((3 << 20) + 17)
    h = Crc32()
    for cut in range(0, len(data), 1_000_003):  # pieces of an odd size, across the vector units' strides
        h.update(memoryview(data)[cut : cut + 1_000_003])
    assert h.hexdigest() == f"{zlib.crc32(data):08x}"
    assert h.hexdigest() != f"{zlib.crc32(data[:-1]):08x}"


def test_range_digest_covers_each_range_its_place_and_its_bytes(tmp_path):
    path = tmp_path / "a.bin"
    data = os.urandom(100_000)
    path.write_bytes(data)
    ranges = [(str(path), 10, 50_000), (str(path), 70_000, 30_000)]
    want = 0
    for p, offset, n in ranges:
        want = zlib.crc32(f"{p}\0{offset}\0{n}\0".encode(), want)
        want = zlib.crc32(data[offset : offset + n], want)
    assert range_digest(ranges) == f"{want:08x}"
    assert range_digest([(str(path), 10, 50_001)]) != range_digest([(str(path), 10, 50_000)])
    assert range_digest([(str(path), 70_000, 30_001)]) == "missing"  # past the end of the file
    assert range_digest([(str(tmp_path / "gone.bin"), 0, 1)]) == "missing"
