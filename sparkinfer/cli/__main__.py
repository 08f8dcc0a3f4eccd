import sys

from sparkinfer.cli import main

sys.exit(main())
