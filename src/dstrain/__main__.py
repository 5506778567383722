import sys

from dstrain.commands.cli import main

sys.exit(main())
