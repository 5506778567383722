"""The ranks of dstrain doctor: every strategy's short run, then the kernel checks."""
