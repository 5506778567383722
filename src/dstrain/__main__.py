import sys

from dstrain.cli import main

sys.exit(main())
