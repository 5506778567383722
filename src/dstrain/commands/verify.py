"""`dstrain verify RUN_DIR` checks every checkpoint of a run without loading it into a model.

    dstrain verify runs/tiny

One line per tag, oldest first: intact (every file's size and checksum match its record, and every ``.pt`` unpickles
without running code, structure only), damaged (the first file that does not match: expected against found), or
refused (a pickle that names something other than tensors and plain data). Exit 0 when every published tag is intact,
1 when one is not, 2 when RUN_DIR holds no checkpoints. Reads each tag once, at disk speed (XXH3 hashes ~10 GB/s).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dstrain.errors import DstrainError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run directory (holds checkpoints/)")


def main(args: argparse.Namespace) -> int:
    from dstrain.checkpoint import store
    from dstrain.checkpoint.record import PARTIAL, read_record
    from dstrain.checkpoint.safe_load import UnsafeCheckpoint
    from dstrain.run_dir import RunDir

    run = RunDir(Path(args.run_dir))
    checkpoints = run.checkpoints
    tags = store.published_tags(checkpoints)
    if not tags:
        raise DstrainError(f"{checkpoints}: no published checkpoint to verify; name a run directory of dstrain.train")
    latest = run.latest.read_text().strip() if run.latest.is_file() else None
    bad = 0
    for tag in tags:
        record = read_record(checkpoints / tag)
        verdict = store.damage(checkpoints / tag)
        if verdict is None:
            try:
                store.check_loadable(checkpoints / tag)
            except UnsafeCheckpoint as e:
                verdict = f"refused: {e}"
        else:
            verdict = f"damaged: {verdict}"
        files = record.files if record else {}
        intact = f"intact ({len(files)} files, {sum(files.values()) / 2**20:.1f} MiB, sizes and checksums match)"
        bad += verdict is not None
        print(f"{tag}{' (latest)' if tag == latest else ''}: {verdict or intact}", flush=True)
    for partial in sorted(checkpoints.glob(f"*{PARTIAL}")):
        print(f"{partial.name}: an unfinished save, never published (the next save of its step removes it)")
    return 1 if bad else 0
