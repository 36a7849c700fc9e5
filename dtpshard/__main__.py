import sys

from dtpshard.cli import main

sys.exit(main())
