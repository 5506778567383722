import sys

from dstrain.train.run import main

sys.exit(main())
