"""Draw docs/flex-block-mask.png: the block mask of the custom-attention guide (two documents of 128 tokens, a
causal window of 80, tiles of 32), as ``attnkit.viz.plot_block_mask`` shows it.

Run with ``make docs-screenshot`` (needs the viz extra).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import attnkit.flex as F
from attnkit.viz import plot_block_mask


def main(out: str = "docs/flex-block-mask.png") -> int:
    mask = F.and_masks(F.sliding_window_mask(80), F.document_mask(np.repeat(np.arange(2), 128)))
    fig = plot_block_mask(F.create_block_mask(mask, None, None, 256, 256, block_size=32))
    fig.set_size_inches(7, 5.2)
    fig.savefig(Path(out), dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
