import sys

from giantmodel.cli import main

sys.exit(main())
