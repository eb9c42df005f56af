"""The Pallas kernels split along height, width or a length on an Auto mesh equal one device.

The other half of tests/sharding/test_partitioning.py (its module doc says what the checks
assert): this file runs tests/sharding/partition_checks.py ``--part spatial`` in its own
subprocess with 8 CPU devices, so that ``make test``'s two workers (``--dist loadfile``: one file
a worker) run the two halves at once. Which checks belong here is the script's ``SPATIAL``.
"""

from __future__ import annotations

from pathlib import Path

import device_checks

SCRIPT = Path(__file__).with_name("partition_checks.py")

# (name prefix, how many checks at least (in the --quick run), only in the full run)
GROUPS = [
    ("auto/height/", 6, False),
    ("auto/height+width/", 3, False),
    ("auto/height_uneven_ceil_dilated/", 4, False),
    ("auto/height_window_wider_than_block/", 4, False),
    ("auto/height_few_outputs/", 3, False),
    ("auto/1d_length/", 3, False),
    ("auto/avg_exclude_pad_1d/", 2, False),
    ("auto/channels_first/height/", 3, False),
    ("auto/height_same_stride1/", 9, True),
    ("auto/2x2s2_height/", 9, True),
    ("auto/height_large_window/", 5, True),  # (a window of more than 32 taps, a dim a time)
]


results, test_split_equals_one_device, test_every_check_is_in_a_group = (
    device_checks.part_tests(SCRIPT, "spatial", GROUPS))
