"""Text that tags a part of a message (<think>, <tool_call>, ...) arrives in pieces: a stream holds back what
may be the start of one."""
from __future__ import annotations


def marker_prefix_len(text: str, marker: str) -> int:
    """The length of the longest end of text that is the start of marker (what comes next may complete it)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
