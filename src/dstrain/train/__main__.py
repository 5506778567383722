import sys

from dstrain.train.process import console

console.start(console.verbose_requested(sys.argv[1:]))  # before anything imports deepspeed, which logs as it loads

from dstrain.train.run import main  # noqa: E402

sys.exit(main())
