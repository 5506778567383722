"""One user-facing verb per module (`dstrain <verb>`), dispatched by cli.py; no module below imports these."""
