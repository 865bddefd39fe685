import sys

from capes.cli import main

sys.exit(main())
